"""Attention of a multi-token chunk whose queries read the cache as one-token decoding would (speculative = greedy).

One-token decoding at position `p` (a cache holding `p + 1` tokens) reads the sink tokens and the positions
`[p + 1 - R, p]` from their model-dtype copies and everything else from the packed low-bit copies. A chunk of `T`
tokens (assisted generation, prompt lookup and any draft verification feed `k + 1` tokens at once; their first
verification feeds the prompt and its drafts into an empty cache) must give each of its decode queries exactly that
view, or verification accepts tokens the model would not have produced one at a time. The cache's recent ring only
holds the window of the LAST position, so `QuantMLALayer.update` keeps the model-dtype rows of the chunk and of the
ring before it (`QuantMLALayer.chunk_window`, a `cache.growing.ChunkWindow`), and marks the first decode query `first`:

    queries before `first` (a prompt)   -> as a prefill of the tokens up to `first`: SDPA over the history `update`
                                           returned, or the latent-space step where that prefill would take it
    each query at p >= first            -> the decode step of a cache holding p + 1 tokens: the same kernel call
                                           (`ops.decode.decode`), on the same packed planes, with the recent
                                           ring that step would hold (built from the window rows) and the capacity
                                           the growing cache has at that length

so each query's output is the one-token step's, bit for bit, whatever the dtype; only the projections around the
attention run on `T` rows at once. A decode query costs one decode step; a prompt costs its prefill.
"""

from __future__ import annotations

import dataclasses

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ..cache.growing import ChunkWindow
from ..format import allocated_tokens
from ..ops.decode import native_chunk
from .decode import decode_latents, latent_weights


def chunk_window_attention(module, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask, scaling: float, dropout: float = 0.0, **kwargs) -> torch.Tensor:
    """Attention of `query: [B, H, T, d_nope + d_R]` for the chunk `layer` just stored; `[B, T, H, d_v]`.

    `key`/`value: [B, H, N, d]` are the expanded history `layer.update` returned (read only by a prompt's queries
    attended through SDPA); the caller checked that `attention_mask` (`[B, 1, T, L]` or None) is left padding +
    causal (`interface.kernel_masks_it`).
    """
    window: ChunkWindow = layer.chunk_window
    T = query.shape[2]
    start = layer.length - T
    prompt = window.first - start  # queries [0, prompt) form a prompt fed with its drafts
    q_nope, q_rot, w_uk, w_uv = latent_weights(module, query)
    outputs = []
    if prompt > 0 and layer.native and native_chunk(prompt, layer.fmt.recent_tokens):
        # A prefill that short is attended in the latent space (`QuantMLALayer.update`), as one decode chunk.
        outputs.append(_decode_step(layer, window, q_nope[:, :, :prompt], q_rot[:, :, :prompt], w_uk, w_uv,
                                    window.first, scaling, query.dtype))
    elif prompt > 0:
        mask = attention_mask[:, :, :prompt, : window.first] if attention_mask is not None else None
        outputs.append(sdpa_attention_forward(
            module, query[:, :, :prompt].contiguous(), key[:, :, : window.first], value[:, :, : window.first], mask,
            scaling=scaling, dropout=dropout, **kwargs)[0])
    for t in range(max(prompt, 0), T):
        outputs.append(_decode_step(layer, window, q_nope[:, :, t:t + 1], q_rot[:, :, t:t + 1], w_uk, w_uv,
                                    start + t + 1, scaling, query.dtype))
    return torch.cat(outputs, dim=1)


def _decode_step(layer, window: ChunkWindow, q_nope: torch.Tensor, q_rot: torch.Tensor, w_uk: torch.Tensor,
                 w_uv: torch.Tensor, end: int, scaling: float, dtype: torch.dtype) -> torch.Tensor:
    """The latent-space step of the queries `q_nope: [B, H, Tq, d_nope]`, `q_rot: [B, H, Tq, d_R]` at positions
    `[end - Tq, end)` on a cache holding `end` tokens, as `decode.latent_decode` computes it at that
    length; `[B, Tq, H, d_v]`.

    With `recent_tokens = 0` one-token decoding reads its own token exactly (it is the new token, attended through
    SDPA over the returned history): a one-slot ring holding that token gives the same view.
    """
    fmt = layer.fmt
    if fmt.recent_tokens == 0:
        fmt = dataclasses.replace(fmt, recent_tokens=1)
    ring_c, ring_r = _ring(window, end, fmt.recent_tokens)
    length = torch.full((1,), end, dtype=torch.int64, device=q_nope.device)
    view = dataclasses.replace(layer.decode_view(), fmt=fmt, recent_content=ring_c, recent_rope=ring_r, length=length,
                               capacity=_capacity(layer, end))
    return decode_latents(q_nope, q_rot, w_uk, w_uv, view, scaling, dtype)


def _capacity(layer, end: int) -> int:
    """The planes' capacity a decode step at length `end` passes: the growing cache's allocation for `end` tokens
    (`format.allocated_tokens`; a crop shrinks back to it), a static cache's fixed `max_cache_len`."""
    return layer.max_cache_len if layer.is_compileable else allocated_tokens(end, layer.block_size)


def _ring(window: ChunkWindow, end: int, R: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The recent ring (`[B, R, d_c]`, `[B, R, d_R]`, position p in slot p % R) of a cache holding `end` tokens:
    positions `[end - R, end)` from the window rows; slots of no position yet hold zeros (never read)."""
    positions = torch.arange(max(0, end - R), end, device=window.content.device)
    rings = []
    for rows in (window.content, window.rope):
        ring = rows.new_zeros((rows.shape[0], R, rows.shape[2]))
        ring[:, positions % R] = rows[:, positions - window.lo]
        rings.append(ring)
    return rings[0], rings[1]
