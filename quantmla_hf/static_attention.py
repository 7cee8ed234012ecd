"""Latent-space decode attention on a `StaticQuantMLACache` layer, without host synchronisation.

The same computation as `attention.latent_decode_attention` (absorb W_UK into the query, attend over the packed
cache in the latent space, expand the output through W_UV), with the length and left padding read on the device by
`torch.ops.quantmla.mla_decode` and no mask inspection inside a compiled step (see `static_cache.py`, "Masks").
"""

from __future__ import annotations

import torch

from . import ops  # noqa: F401  (registers torch.ops.quantmla)
from .absorbed import absorbed_attention_ref, split_kv_b
from .cache import _use_triton

try:  # issue #14 (tensor parallel / offload): the kv_b_proj rows of this process's heads
    from .distributed import kv_b_weight
except ImportError:  # a tree without quantmla_hf/distributed.py: the whole weight

    def kv_b_weight(module, num_heads: int, device) -> torch.Tensor:
        return module.kv_b_proj.weight


def _mask_is_padding_causal_eager(layer, attention_mask, q_len: int) -> bool:
    """Eager check that `attention_mask` (`[B, 1, q_len, K]` bool, K >= length, or None) is exactly left padding +
    causal over the cached positions (and nothing past them). Synchronises; never called while compiling."""
    n = layer.length
    if attention_mask is None:
        return layer.max_left_padding == 0
    if attention_mask.dtype != torch.bool or attention_mask.dim() != 4 or attention_mask.shape[-1] < n:
        return False
    from .attention import expected_mask

    want = expected_mask(layer.left_padding, q_len, n)
    mask = attention_mask[:, 0]
    return bool(torch.equal(mask[..., :n].expand_as(want), want)) and not bool(mask[..., n:].any())


def static_latent_decode_attention(module, layer, query: torch.Tensor, attention_mask, scaling: float) -> torch.Tensor:
    """Absorbed attention of `query: [B, H, Tq, d_nope + d_R]` over everything the static `layer` holds.

    Returns `[B, Tq, H, d_v]`.
    """
    nope = module.qk_nope_head_dim
    B, H, Tq, _ = query.shape
    q_nope, q_rot = query[..., :nope], query[..., nope:]
    w_uk, w_uv = split_kv_b(kv_b_weight(module, H, query.device), H, nope, module.v_head_dim)
    # Compiled steps trust the mask; captured ones were checked once by their caller (`layer.host_checked`).
    checked = torch.compiler.is_compiling() or layer.host_checked
    if not checked and not _mask_is_padding_causal_eager(layer, attention_mask, Tq):
        content, k_rot = layer.read_history()
        n = content.shape[1]
        mask = attention_mask[..., :n] if attention_mask is not None else None
        out, _ = absorbed_attention_ref(q_nope, q_rot, content, k_rot, w_uk, w_uv, scaling, mask)
        return out
    q_lat = torch.matmul(q_nope, w_uk.to(q_nope.dtype).unsqueeze(0))  # [B, H, Tq, d_c]
    if layer.rope_rotation is not None:
        q_rot = q_rot.float() @ layer.rope_rotation.to(device=q_rot.device, dtype=torch.float32).T
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
    out = torch.matmul(o_lat.to(query.dtype), w_uv.to(query.dtype).transpose(1, 2).unsqueeze(0))  # [B, H, Tq, d_v]
    return out.transpose(1, 2)
