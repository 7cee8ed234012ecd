"""The "quantmla" attention implementation: absorbed-latent decode on the QuantMLA cache, SDPA elsewhere.

It plugs into transformers through `AttentionInterface`, so the stock modeling code of every MLA family still
computes the projections, the RoPE of its own layout, YaRN mscale and family scalings (LongCat's LoRA scales);
only the attention itself changes:

- prefill and long chunks: the cache returns the history as stock attention expects, and this function runs
  SDPA on the expanded heads (compute-friendly, exact latents for the new tokens);
- decode (few query tokens, all of them inside the recent window): the cache stores the new tokens and returns
  only them, and this function attends in the latent space straight from the cache, without expanding the
  history through `kv_b_proj`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .absorbed import absorbed_attention_ref, split_kv_b
from .cache import QuantMLACache

ATTN_IMPLEMENTATION = "quantmla"


@dataclass
class QuantMLAState:
    """Shared by the MLA modules of one model: the cache of the forward in flight."""

    cache: QuantMLACache | None = None


def latent_decode_attention(module, layer, query: torch.Tensor, attention_mask, scaling: float) -> torch.Tensor:
    """Absorbed attention of `query: [B, H, Tq, d_nope + d_R]` over everything `layer` holds.

    Returns `[B, Tq, H, d_v]`.
    """
    nope = module.qk_nope_head_dim
    q_nope, q_rot = query[..., :nope], query[..., nope:]
    w_uk, w_uv = split_kv_b(module.kv_b_proj.weight, query.shape[1], nope, module.v_head_dim)
    content, k_rot = layer.read_history()
    out, _ = absorbed_attention_ref(q_nope, q_rot, content, k_rot, w_uk, w_uv, scaling, attention_mask)
    return out


def quantmla_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """`AttentionInterface` entry point: `query: [B, H, Tq, d_qk]`; returns `([B, Tq, H, d_v], None)`."""
    state = getattr(module, "_quantmla_state", None)
    cache = state.cache if state is not None else None
    layer = cache.layers[module.layer_idx] if isinstance(cache, QuantMLACache) else None
    if layer is None or not layer.last_update_native:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    return latent_decode_attention(module, layer, query, attention_mask, scaling), None


def register_attention() -> None:
    """Register "quantmla" with transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, quantmla_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, sdpa_mask)
