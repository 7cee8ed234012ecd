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
  one-token decoding would attend it (`quantmla_hf.chunk_attention`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from ..ops import custom as ops
from ..cache.growing import QuantMLACache, _use_triton
from .chunk import chunk_window_attention
from ..distributed import device_guard
from .masks import layer_mask_is_padding_causal
from .decode import (
    expand_latent,
    latent_query,
    latent_weights,
    reference_decode,
    static_latent_decode_attention,
)

ATTN_IMPLEMENTATION = "quantmla"


@dataclass
class QuantMLAState:
    """Shared by the MLA modules of one model: the cache of the forward in flight, and whether the attention mask
    of that forward is plain left padding + causal (checked once per forward, not once per layer)."""

    cache: QuantMLACache | None = None
    mask_key: tuple | None = None
    mask_is_padding_causal: bool = False
    # The forward in flight asked for attention weights (`output_attentions`): attend eagerly, return them.
    output_attentions: bool = False


def _mask_is_padding_causal(state, layer, attention_mask, q_len: int) -> bool:
    """True when the kernel's own masking (left padding + causal) is exactly `attention_mask` (the growing cache's
    masks span its `length` positions); checked once per forward (`masks.layer_mask_is_padding_causal`)."""
    n = layer.length
    if attention_mask is not None and (attention_mask.dim() != 4 or attention_mask.shape[-1] != n):
        return False
    return layer_mask_is_padding_causal(state, layer, attention_mask, q_len, n)


def latent_decode_attention(module, layer, query: torch.Tensor, attention_mask, scaling: float) -> torch.Tensor:
    """Absorbed attention of `query: [B, H, Tq, d_nope + d_R]` over everything `layer` holds.

    With a left-padding + causal mask (or none) it reads the packed planes and the sink/recent copies directly
    through the static cache's dispatch (`ops.decode_device_length`: the same kernel and split boundaries, so eager
    and static decoding agree bit for bit; the PyTorch reference where the layer's kernel is "torch").
    Any other mask goes through the reconstructed history and `absorbed_attention_ref`.

    Returns `[B, Tq, H, d_v]`.
    """
    if layer.is_compileable:  # the static cache: device-side lengths, no host synchronisation
        return static_latent_decode_attention(module, layer, query, attention_mask, scaling)
    q_nope, q_rot, w_uk, w_uv = latent_weights(module, query)
    state = getattr(module, "_quantmla_state", None)
    if not _mask_is_padding_causal(state, layer, attention_mask, query.shape[2]):
        return reference_decode(layer, q_nope, q_rot, w_uk, w_uv, scaling, attention_mask)
    # Model-dtype queries go to the kernel as they are: bf16/fp16 values are exact in its fp16 operands (one dot),
    # where fp32 queries need a high/low split (two dots).
    q_lat, q_rot = latent_query(layer, q_nope, q_rot, w_uk)
    use_triton = _use_triton(layer.kernel, query.device)
    with device_guard(query.device):  # device maps: Triton launches on the current device, make it this layer's
        # The length goes as a device tensor (a fill, no synchronisation).
        length = torch.full((1,), layer.length, dtype=torch.int64, device=query.device)
        o_lat, _ = ops.decode_device_length(
            q_lat, q_rot, layer.content.planes, layer.rope.planes, layer.fmt, layer.sink_content, layer.sink_rope,
            layer.recent_content, layer.recent_rope, layer.left_padding, length,
            min(layer.content.capacity, layer.rope.capacity), scaling, use_triton,
        )
    return expand_latent(o_lat, w_uv, query.dtype)


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
    if getattr(layer, "chunk_window", None) is not None and _mask_is_padding_causal(  # draft verification
            state, layer, attention_mask, query.shape[2]):
        scaling = scaling or query.shape[-1] ** -0.5
        return chunk_window_attention(module, layer, query, key, value, attention_mask, scaling, dropout, **kwargs), None
    if layer is None or not layer.last_update_native:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    return latent_decode_attention(module, layer, query, attention_mask, scaling), None


def register_attention() -> None:
    """Register "quantmla" with transformers' attention and mask interfaces (idempotent)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, quantmla_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, sdpa_mask)
