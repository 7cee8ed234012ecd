"""The "quantmla_paged" attention implementation: MLA attention of a varlen batch of requests on the paged cache.

Continuous batching runs the stock modeling code of every MLA family on one flat sequence `[1, N]` holding the new
tokens of several requests (prefill chunks and decode steps together, no padding). The modeling code projects and
ropes the latents and hands them to `cache.update`; the paged forward cache (`PagedForward`) stores them in the pages
and returns them unchanged. This function then attends per request:

- decode rows (a request whose new tokens the latent decode takes, `native_request`): absorbed latent attention
  straight from the pages, all such requests in one varlen decode (`decode.latent_decode` on the pages'
  `DecodeView`, as every cache);
- prefill chunks: the request's history as stock attention sees it (`PagedQuantMLACache.history`: this chunk's
  latents exact, sink/recent copies, the rest dequantized), expanded through `kv_b_proj` and attended with SDPA.

This is the split the contiguous "quantmla" implementation makes, so a request's greedy tokens match `generate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface

from ..cache.paged import PagedQuantMLACache, PagedStep
from ..ops.decode import NATIVE_MAX_QUERY, native_chunk
from .decode import latent_decode

PAGED_ATTN_IMPLEMENTATION = "quantmla_paged"


@dataclass
class PagedForward:
    """The cache the model sees during one continuous-batching forward (the `cache` / `past_key_values` argument).

    `update` stores the new latents of one layer in the pages and returns them as given; the attention function
    reads the pages through `step`. `native_requests` are the batch indices attended in the latent space,
    `dense_requests` the others (with their own `PagedStep`, for their histories).
    """

    paged: PagedQuantMLACache
    step: PagedStep
    native_requests: list[int]
    dense_requests: list[int]
    native_step: PagedStep | None = None
    native_tokens: torch.Tensor | None = None
    new_latents: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    dense_steps: dict[int, PagedStep] = field(default_factory=dict)  # per dense request, built once per forward
    is_compileable = False
    is_sliding = [False]

    def update(self, latent: torch.Tensor, k_rot: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Store `latent: [1, 1, N, d_c]`, `k_rot: [1, 1, N, d_R]` of layer `layer_idx`; return them unchanged."""
        if latent.dim() != 4 or latent.shape[:2] != (1, 1):
            raise ValueError(f"continuous batching packs requests in one row: latent must be [1, 1, N, d], got "
                             f"{tuple(latent.shape)}")
        c, r = latent[0, 0], k_rot[0, 0]
        self.paged.write(layer_idx, self.step, c, r)
        self.new_latents[layer_idx] = (c, r)
        return latent, k_rot

    # What mask creation and the modeling code ask a cache (the mask is built per request by the attention).
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        n = sum(self.step.query_lens)
        return n, 0


def native_request(paged: PagedQuantMLACache, query_len: int) -> bool:
    """True when a request's chunk of `query_len` tokens is attended in the latent space straight from the pages
    (`ops.decode.native_chunk`; a 16-bit cache keeps no recent copies, and any chunk it takes is short enough)."""
    return native_chunk(query_len, paged.recent_tokens if paged.protected else NATIVE_MAX_QUERY)


def _latent_attention(module, ctx: PagedForward, query: torch.Tensor, scaling: float) -> torch.Tensor:
    """Rows of the native requests: `[n_tokens, H, d_v]`, through the one latent decode on the pages' view."""
    view = ctx.paged.decode_view(module.layer_idx, ctx.native_step)
    return latent_decode(module, query[:, :, ctx.native_tokens], view, scaling)[0]


def _expand(module, c: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Latents `[T, d_c]`, `[T, d_R]` -> keys `[1, H, T, d_nope + d_R]` and values `[1, H, T, d_v]`."""
    T = c.shape[0]
    kv = module.kv_b_proj(c).view(T, -1, module.qk_nope_head_dim + module.v_head_dim).transpose(0, 1)
    k_nope, v = kv.split([module.qk_nope_head_dim, module.v_head_dim], dim=-1)
    k = torch.cat([k_nope, r[None].expand(k_nope.shape[0], -1, -1)], dim=-1)
    return k.unsqueeze(0), v.unsqueeze(0)


def _flash_width(v: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Values `[1, H, T, d_v]` padded with zero columns to the keys' width on a CUDA device in 16 bits, where SDPA's
    flash kernel takes the chunk only when queries, keys and values are equally wide (it is faster than the
    memory-efficient kernel that takes unequal widths); the extra output columns are zero and dropped."""
    if v.shape[-1] == k.shape[-1] or not v.is_cuda or v.dtype not in (torch.float16, torch.bfloat16):
        return v
    return torch.nn.functional.pad(v, (0, k.shape[-1] - v.shape[-1]))


def paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """`AttentionInterface` entry point: `query: [1, H, N, d_qk]` of the step's packed tokens; `([1, N, H, d_v], None)`."""
    ctx: PagedForward | None = getattr(module, "_quantmla_paged", None)
    if ctx is None:
        raise ValueError(
            f"the {PAGED_ATTN_IMPLEMENTATION!r} attention runs inside continuous batching on a paged QuantMLA cache "
            "(quantmla_hf.serving.batching.generate_batch); use attn_implementation='quantmla' or 'sdpa' for generate"
        )
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    step, layer = ctx.step, module.layer_idx
    N, H = query.shape[2], query.shape[1]
    out = query.new_empty((N, H, module.v_head_dim))
    if ctx.native_requests:
        out[ctx.native_tokens] = _latent_attention(module, ctx, query, scaling)
    c_all, r_all = ctx.new_latents[layer]
    cu_q = [0]
    for q in step.query_lens:
        cu_q.append(cu_q[-1] + q)
    for i in ctx.dense_requests:
        q0, q1 = cu_q[i], cu_q[i + 1]
        sub = ctx.dense_steps.get(i)
        if sub is None:
            sub = ctx.dense_steps[i] = ctx.paged.sub_step(step, [i])
        hist_c, hist_r = ctx.paged.history(layer, sub, c_all[q0:q1], r_all[q0:q1])
        k, v = _expand(module, hist_c, hist_r)
        # Token t of the chunk sees positions <= n - q + t: causal aligned to the bottom right, which the fused
        # kernels apply without a mask tensor (a whole prompt, n == q, is plain causal attention).
        causal = causal_lower_right(q1 - q0, hist_c.shape[0])
        o = torch.nn.functional.scaled_dot_product_attention(query[:, :, q0:q1], k, _flash_width(v, k),
                                                             attn_mask=causal, scale=scaling)
        out[q0:q1] = o[0, :, :, : module.v_head_dim].transpose(0, 1)
    return out.unsqueeze(0), None


def register_paged_attention() -> None:
    """Register "quantmla_paged" with transformers' attention interface (idempotent). It is deliberately left out
    of the mask interface: transformers then builds no mask (its path for custom attention), and the attention
    masks each request itself."""
    AttentionInterface.register(PAGED_ATTN_IMPLEMENTATION, paged_attention_forward)
