"""The latent-space decode every cache goes through (growing, static, paged; each draft of a verification chunk):

    q_lat = q_nope @ W_UK   (`latent_query`, the model dtype)
    o_lat = attention over the packed cache and its copies   (`ops.decode.decode` on the layer's `DecodeView`)
    out   = o_lat @ W_UV    (`expand_latent`)

`latent_decode` is that step for a module's query; `decode_latents` the same for queries already split (a chunk's
drafts, one view each). Under a mask other than left padding + causal the step reads the reconstructed history
instead (`reference_decode`); `attention.interface` decides which.
"""

from __future__ import annotations

import torch

from ..distributed import device_guard, kv_b_weight
from ..ops.decode import DecodeView, decode
from .absorbed import absorbed_attention_ref, split_kv_b


def latent_weights(module, query: torch.Tensor):
    """`query: [B, H, Tq, d_nope + d_R]` split into `q_nope`, `q_rot`, with `w_uk: [H, d_nope, d_c]` and
    `w_uv: [H, d_v, d_c]` of this process's H heads (tensor parallel / offload: `distributed.kv_b_weight`)."""
    nope = module.qk_nope_head_dim
    H = query.shape[1]
    w_uk, w_uv = split_kv_b(kv_b_weight(module, H, query.device), H, nope, module.v_head_dim)
    return query[..., :nope], query[..., nope:], w_uk, w_uv


def latent_query(rope_rotation, q_nope: torch.Tensor, q_rot: torch.Tensor, w_uk: torch.Tensor):
    """`q_lat[b, h, t] = q_nope[b, h, t] @ W_UK[h]`: `[B, H, Tq, d_c]` in the model dtype (as the stock
    projections); `q_rot` rotated like the stored k_R copies when the cache has an online RoPE rotation
    (`rope_rotation: [d_R, d_R]`, then fp32)."""
    B, H, T, _ = q_nope.shape
    # One matrix per head with the batch folded into its rows: a broadcast `matmul` over B would copy W_UK B times.
    q_lat = torch.bmm(q_nope.transpose(0, 1).reshape(H, B * T, -1), w_uk.to(q_nope.dtype))
    q_lat = q_lat.view(H, B, T, -1).transpose(0, 1)
    if rope_rotation is not None:
        # The stored k_R copies are k_R @ rot.T; rotating the query the same way leaves q . k unchanged.
        q_rot = q_rot.float() @ rope_rotation.to(device=q_rot.device, dtype=torch.float32).T
    return q_lat, q_rot


def expand_latent(o_lat: torch.Tensor, w_uv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`o_lat: [B, H, Tq, d_c]` through W_UV: `[B, Tq, H, d_v]`."""
    B, H, T, _ = o_lat.shape
    out = torch.bmm(o_lat.to(dtype).transpose(0, 1).reshape(H, B * T, -1), w_uv.to(dtype).transpose(1, 2))
    return out.view(H, B, T, -1).permute(1, 2, 0, 3)  # [B, Tq, H, d_v]


def decode_latents(q_nope: torch.Tensor, q_rot: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor,
                   view: DecodeView, scaling: float, dtype: torch.dtype) -> torch.Tensor:
    """The decode of split queries (`latent_weights`) over `view`: `[B, Tq, H, d_v]` in `dtype`. Model-dtype queries
    go to the kernels as they are (bf16/fp16 values are exact in their fp16 operands, fp32 ones take a high/low
    split)."""
    q_lat, q_rot = latent_query(view.rope_rotation, q_nope, q_rot, w_uk)
    with device_guard(q_lat.device):  # device maps: Triton launches on the current device, make it this layer's
        o_lat, _ = decode(view, q_lat, q_rot, scaling)
    return expand_latent(o_lat, w_uv, dtype)


def latent_decode(module, query: torch.Tensor, view: DecodeView, scaling: float) -> torch.Tensor:
    """Absorbed attention of the MLA `module`'s `query: [B, H, Tq, d_nope + d_R]` over `view`: `[B, Tq, H, d_v]`."""
    q_nope, q_rot, w_uk, w_uv = latent_weights(module, query)
    return decode_latents(q_nope, q_rot, w_uk, w_uv, view, scaling, query.dtype)


def reference_decode(module, layer, query: torch.Tensor, scaling: float, attention_mask) -> torch.Tensor:
    """Absorbed attention of `query` over `layer`'s reconstructed history under any mask (`[.., K]`, K >= the cached
    length): `[B, Tq, H, d_v]`."""
    q_nope, q_rot, w_uk, w_uv = latent_weights(module, query)
    content, k_rot = layer.read_history()
    n = content.shape[1]
    mask = attention_mask[..., :n] if attention_mask is not None else None
    out, _ = absorbed_attention_ref(q_nope, q_rot, content, k_rot, w_uk, w_uv, scaling, mask)
    return out
