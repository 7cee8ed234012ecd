"""Offline fusion of the content and RoPE transforms into the weights of one MLA attention module.

The fused module has the same tensors (names, shapes, dtypes) and, in exact arithmetic, the same function; only
the cached latent and RoPE key change. Content (`n = x_c / rms(x_c)`, old norm weight `w`, transform `s * R n`):

    kv_a_proj_with_mqa content rows   W_a[:d_c]  ->  R W_a[:d_c]          (bias likewise)
    kv_a_layernorm weight             w          ->  s
    kv_b_proj                         W_b        ->  W_b diag(w) R^T diag(1 / s)

RoPE (pair `i` at pre-RoPE rows `(a_i, b_i)`, angle `theta_i`, scale `s_i`):

    kv_a_proj_with_mqa RoPE rows      pair i     ->  s_i Q(theta_i) pair i
    q_proj / q_b_proj RoPE rows of every head    ->  Q(theta_i) pair i / s_i
"""

from __future__ import annotations

import torch

from .transforms import RopeLayout, rotate_pairs

FUSION_DTYPE = torch.float64


def query_projection(module: torch.nn.Module) -> torch.nn.Linear:
    """The linear layer whose output holds the per-head queries: `q_proj` (no query LoRA) or `q_b_proj`."""
    q_proj = getattr(module, "q_proj", None)
    return q_proj if q_proj is not None else module.q_b_proj


def _check_materialized(module: torch.nn.Module) -> None:
    for name, p in module.named_parameters():
        if p.device.type == "meta":
            raise ValueError(
                f"parameter {name} of {type(module).__name__} is on the meta device (offloaded by accelerate); "
                "calibrate with the attention weights resident on a device (e.g. device_map without disk/cpu offload "
                "of attention, or quantize before dispatching)"
            )


def content_weights(module: torch.nn.Module, rotation: torch.Tensor, scale: torch.Tensor, base=None) -> dict:
    """Weights of `module` with the content transform applied (differentiable in `rotation` and `scale`).

    Args:
        rotation: `[d_c, d_c]` orthogonal `R`.
        scale: `[d_c]` positive `s`.
        base: optional dict of the original tensors (same keys as returned) in the compute dtype; read from the
            module when omitted.

    Returns:
        dict with "kv_a_proj_with_mqa.weight" `[d_c + d_R, hidden]`, optionally "kv_a_proj_with_mqa.bias",
        "kv_a_layernorm.weight" `[d_c]` and "kv_b_proj.weight" `[H * (d_nope + d_v), d_c]`.
    """
    base = base if base is not None else original_weights(module, rotation.dtype)
    d_c = rotation.shape[0]
    w_a, w, w_b = base["kv_a_proj_with_mqa.weight"], base["kv_a_layernorm.weight"], base["kv_b_proj.weight"]
    out = {
        "kv_a_proj_with_mqa.weight": torch.cat([rotation @ w_a[:d_c], w_a[d_c:]], 0),
        "kv_a_layernorm.weight": scale,
        "kv_b_proj.weight": ((w_b * w) @ rotation.T) / scale,
    }
    if "kv_a_proj_with_mqa.bias" in base:
        bias = base["kv_a_proj_with_mqa.bias"]
        out["kv_a_proj_with_mqa.bias"] = torch.cat([rotation @ bias[:d_c], bias[d_c:]], 0)
    return out


def original_weights(module: torch.nn.Module, dtype: torch.dtype) -> dict:
    """The tensors the content transform touches, as `dtype` copies."""
    out = {
        "kv_a_proj_with_mqa.weight": module.kv_a_proj_with_mqa.weight,
        "kv_a_layernorm.weight": module.kv_a_layernorm.weight,
        "kv_b_proj.weight": module.kv_b_proj.weight,
    }
    if module.kv_a_proj_with_mqa.bias is not None:
        out["kv_a_proj_with_mqa.bias"] = module.kv_a_proj_with_mqa.bias
    return {k: v.detach().to(dtype) for k, v in out.items()}


@torch.no_grad()
def fuse_content(module: torch.nn.Module, rotation: torch.Tensor, scale: torch.Tensor) -> None:
    """Write the content transform `c' = s * R n` into `module`'s weights, in place (computed in fp64)."""
    _check_materialized(module)
    d_c = module.kv_a_layernorm.weight.numel()
    if rotation.shape != (d_c, d_c) or scale.shape != (d_c,):
        raise ValueError(f"expected rotation [{d_c}, {d_c}] and scale [{d_c}], got {tuple(rotation.shape)}, {tuple(scale.shape)}")
    if not (scale > 0).all():
        raise ValueError("the content scale must be positive everywhere (it becomes the kv_a_layernorm weight)")
    new = content_weights(module, rotation.to(FUSION_DTYPE), scale.to(FUSION_DTYPE),
                          original_weights(module, FUSION_DTYPE))
    params = dict(module.named_parameters())
    for name, value in new.items():
        params[name].data.copy_(value.to(device=params[name].device, dtype=params[name].dtype))


@torch.no_grad()
def fuse_rope(module: torch.nn.Module, layout: RopeLayout, theta: torch.Tensor, scale: torch.Tensor) -> None:
    """Write the per-pair RoPE transform into the pre-RoPE key rows of `kv_a_proj_with_mqa` (`s Q`) and the
    pre-RoPE query rows of every head of `q_proj`/`q_b_proj` (`Q / s`), in place.

    Args:
        theta, scale: `[d_R / 2]` angle and positive scale per frequency pair.
    """
    _check_materialized(module)
    if not (scale > 0).all():
        raise ValueError("the RoPE pair scale must be positive everywhere")
    theta, scale = theta.detach().to(FUSION_DTYPE), scale.detach().to(FUSION_DTYPE)
    d_c = module.kv_a_layernorm.weight.numel()
    d_nope, d_r = module.qk_nope_head_dim, module.qk_rope_head_dim
    kv_a = module.kv_a_proj_with_mqa
    key_a, key_b = layout.pre_a + d_c, layout.pre_b + d_c
    _rotate_rows(kv_a, key_a, key_b, theta, scale)
    q = query_projection(module)
    head = d_nope + d_r
    n_heads = q.weight.shape[0] // head
    offsets = torch.arange(n_heads)[:, None] * head + d_nope
    _rotate_rows(q, (offsets + layout.pre_a).flatten(), (offsets + layout.pre_b).flatten(),
                 theta.repeat(n_heads), (1 / scale).repeat(n_heads))


def _rotate_rows(linear: torch.nn.Linear, a: torch.Tensor, b: torch.Tensor, theta, scale) -> None:
    for p in (linear.weight, linear.bias):
        if p is None:
            continue
        x = p.data.to(FUSION_DTYPE)
        x = x.T if x.dim() == 2 else x
        y = rotate_pairs(x, a, b, theta.to(x.device), scale.to(x.device))
        p.data.copy_((y.T if p.dim() == 2 else y).to(p.dtype))
