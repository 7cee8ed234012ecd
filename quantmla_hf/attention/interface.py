"""The "quantmla" attention implementation: absorbed-latent decode on the QuantMLA cache, SDPA elsewhere.

It plugs into transformers through `AttentionInterface`, so the stock modeling code of every MLA family still
computes the projections, the RoPE of its own layout, YaRN mscale and family scalings (LongCat's LoRA scales);
only the attention itself changes:

- prefill and long chunks: the cache returns the history as stock attention expects, and this function runs
  SDPA on the expanded heads (compute-friendly, exact latents for the new tokens);
- decode (few query tokens, all of them inside the recent window): the cache stores the new tokens and returns
  only them, and this function attends in the latent space straight from the cache, without expanding the
  history through `kv_b_proj`;
- a chunk after cached tokens (draft verification) or a prompt fed with its drafts: each decode query attended as
  one-token decoding would attend it (`chunk.py`).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from ..cache.growing import QuantMLACache
from .chunk import chunk_window_attention
from .decode import latent_decode, reference_decode
from .masks import layer_mask_is_padding_causal
from .state import ATTN_IMPLEMENTATION


def kernel_masks_it(state, layer, attention_mask, q_len: int) -> bool:
    """Whether the decode's own masking (each row's left padding, causal over the cached positions) is exactly
    `attention_mask` for this step of `layer`, so that the step may read the packed cache (else the reconstructed
    history, `decode.reference_decode`): checked once per forward and shared by the layers
    (`masks.layer_mask_is_padding_causal`); a compiled step trusts it, a captured one was checked by its caller."""
    if layer.is_compileable and (torch.compiler.is_compiling() or layer.host_checked):
        return True
    return layer_mask_is_padding_causal(state, layer, attention_mask, q_len, layer.length)


# --- output_attentions: the weights need the full score matrix, which only an eager attention forms ---------
def eager_attention_with_weights(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stock eager attention: `query: [B, H, Tq, d]`, `key`/`value: [B, H_kv, N, d]`, additive or bool mask.

    `attention_mask=None` means causal (the SDPA mask interface "quantmla" registers drops a plain causal mask and
    lets SDPA apply `is_causal`): query t sees keys up to `N - Tq + t`.
    Returns `([B, Tq, H, d_v], weights [B, H, Tq, N])` (weights in the query dtype, as transformers' eager).
    """
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    q_len, kv_len = query.shape[-2], key.shape[-2]
    mask = attention_mask[:, :, :, :kv_len] if attention_mask is not None else None
    if mask is None and q_len > 1 and getattr(module, "is_causal", True):
        mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - q_len)
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min) if mask.dtype == torch.bool else scores + mask
    weights = torch.nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = torch.nn.functional.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights
# --- end output_attentions ---------------------------------------------------------------------------------------


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
    """`AttentionInterface` entry point: `query: [B, H, Tq, d_qk]`; returns `([B, Tq, H, d_v], None)`.

    With `output_attentions` requested it returns the weights `[B, H, Tq, N]` too, computed eagerly over the
    history the cache returned (the pre-forward hook turns the latent-space decode off for that forward).
    """
    state = getattr(module, "_quantmla_state", None)
    if state is not None and state.output_attentions:
        if scaling is None:
            scaling = query.shape[-1] ** -0.5
        return eager_attention_with_weights(module, query, key, value, attention_mask, scaling, dropout)
    cache = state.cache if state is not None else None
    layer = cache.layers[module.layer_idx] if isinstance(cache, QuantMLACache) else None
    if getattr(layer, "chunk_window", None) is not None and kernel_masks_it(  # draft verification
            state, layer, attention_mask, query.shape[2]):
        scaling = scaling or query.shape[-1] ** -0.5
        return chunk_window_attention(module, layer, query, key, value, attention_mask, scaling, dropout, **kwargs), None
    if layer is None or not layer.last_update_native:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if not kernel_masks_it(state, layer, attention_mask, query.shape[2]):
        return reference_decode(module, layer, query, scaling, attention_mask), None
    return latent_decode(module, query, layer.decode_view(), scaling), None


def register_attention() -> None:
    """Register "quantmla" with transformers' attention and mask interfaces (idempotent)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, quantmla_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, sdpa_mask)
