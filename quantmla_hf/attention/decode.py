"""Latent-space decode attention: the glue both QuantMLA caches (and `chunk_attention`) share, and the static
cache's step.

Decode attends in the latent space: absorb W_UK into the query (`latent_query`), attend over the packed cache,
expand the output through W_UV (`expand_latent`); a mask other than left padding + causal goes through the
reconstructed history and `absorbed_attention_ref` instead (`reference_decode`). `attention.latent_decode_attention`
runs this for the growing `QuantMLACache`; `static_latent_decode_attention` for a `StaticQuantMLACache` layer, with
the length and left padding read on the device by `torch.ops.quantmla.mla_decode` (no host synchronisation), and
no mask inspection inside a compiled step or a step its caller checked (see `static_cache.py`, "Masks").
"""

from __future__ import annotations

import torch

from ..ops import custom  # noqa: F401  (registers torch.ops.quantmla)
from .absorbed import absorbed_attention_ref, split_kv_b
from ..cache.growing import _use_triton
from ..distributed import kv_b_weight
from .masks import layer_mask_is_padding_causal


def latent_weights(module, query: torch.Tensor):
    """`query: [B, H, Tq, d_nope + d_R]` split into `q_nope`, `q_rot`, with `w_uk: [H, d_nope, d_c]` and
    `w_uv: [H, d_v, d_c]` of this process's H heads (tensor parallel / offload: `distributed.kv_b_weight`)."""
    nope = module.qk_nope_head_dim
    H = query.shape[1]
    w_uk, w_uv = split_kv_b(kv_b_weight(module, H, query.device), H, nope, module.v_head_dim)
    return query[..., :nope], query[..., nope:], w_uk, w_uv


def latent_query(layer, q_nope: torch.Tensor, q_rot: torch.Tensor, w_uk: torch.Tensor):
    """`q_lat[b, h, t] = q_nope[b, h, t] @ W_UK[h]`: `[B, H, Tq, d_c]` in the model dtype (as the stock
    projections); `q_rot` rotated like the stored k_R copies when the layer has an online RoPE rotation (then fp32)."""
    B, H, T, _ = q_nope.shape
    # One matrix per head with the batch folded into its rows: a broadcast `matmul` over B would copy W_UK B times.
    q_lat = torch.bmm(q_nope.transpose(0, 1).reshape(H, B * T, -1), w_uk.to(q_nope.dtype))
    q_lat = q_lat.view(H, B, T, -1).transpose(0, 1)
    if layer.rope_rotation is not None:
        # The stored k_R copies are k_R @ rot.T; rotating the query the same way leaves q . k unchanged.
        q_rot = q_rot.float() @ layer.rope_rotation.to(device=q_rot.device, dtype=torch.float32).T
    return q_lat, q_rot


def expand_latent(o_lat: torch.Tensor, w_uv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`o_lat: [B, H, Tq, d_c]` through W_UV: `[B, Tq, H, d_v]`."""
    B, H, T, _ = o_lat.shape
    out = torch.bmm(o_lat.to(dtype).transpose(0, 1).reshape(H, B * T, -1), w_uv.to(dtype).transpose(1, 2))
    return out.view(H, B, T, -1).permute(1, 2, 0, 3)  # [B, Tq, H, d_v]


def reference_decode(layer, q_nope, q_rot, w_uk, w_uv, scaling: float, attention_mask) -> torch.Tensor:
    """Absorbed attention over the reconstructed history under any mask (`[.., K]`, K >= the cached length)."""
    content, k_rot = layer.read_history()
    n = content.shape[1]
    mask = attention_mask[..., :n] if attention_mask is not None else None
    out, _ = absorbed_attention_ref(q_nope, q_rot, content, k_rot, w_uk, w_uv, scaling, mask)
    return out


def static_latent_decode_attention(module, layer, query: torch.Tensor, attention_mask, scaling: float) -> torch.Tensor:
    """Absorbed attention of `query: [B, H, Tq, d_nope + d_R]` over everything the static `layer` holds.

    Returns `[B, Tq, H, d_v]`.
    """
    q_nope, q_rot, w_uk, w_uv = latent_weights(module, query)
    # Compiled steps trust the mask; captured ones were checked once by their caller (`layer.host_checked`); an
    # eager step checks it (one synchronisation per forward, shared by the layers through the model's state).
    checked = torch.compiler.is_compiling() or layer.host_checked
    state = getattr(module, "_quantmla_state", None)
    if not checked and not layer_mask_is_padding_causal(state, layer, attention_mask, query.shape[2], layer.length):
        return reference_decode(layer, q_nope, q_rot, w_uk, w_uv, scaling, attention_mask)
    q_lat, q_rot = latent_query(layer, q_nope, q_rot, w_uk)
    f = layer.fmt
    c = layer.content.planes
    r = layer.rope.planes
    e = layer.empty_plane
    c0, c1, c2 = (c["values"], e, e) if f.content.bits == 16 else (c["codes"], c["scale"], c["zero"])
    r0, r1, r2 = (r["values"], e, e) if f.rope.bits == 16 else (r["codes"], r["scale"], r["zero"])
    o_lat, _ = torch.ops.quantmla.mla_decode(
        q_lat.contiguous(), q_rot.contiguous(), c0, c1, c2, r0, r1, r2, layer.sink_content, layer.sink_rope,
        layer.recent_content, layer.recent_rope, layer.left_padding, layer.cumulative_length, layer.max_cache_len,
        float(scaling), f.content.bits, f.content.group, f.rope.bits, f.rope.group, f.sink_tokens,
        f.recent_tokens, _use_triton(layer.kernel, query.device),
    )
    return expand_latent(o_lat, w_uv, query.dtype)
