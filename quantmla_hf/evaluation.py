"""Perplexity measured the way a cache is used: a prompt prefilled at once, then tokens decoded against it.

A plain forward over a whole window never reads a quantized cache (prefill attends to the exact latents of the
window itself), so it cannot show what the cache costs. Here each window is split into a prefill part and a
decoded part; every decoded token attends to the history as the cache holds it (sink and recent tokens in the
model dtype, the rest dequantized) and its next-token loss is what the perplexity counts.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from .mla import text_config


@dataclass
class DecodePerplexity:
    """Result of `decode_perplexity`: mean negative log-likelihood (nats) and the tokens it counts."""

    nll: float
    tokens: int

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll)


def _cache_kwarg(model) -> str:
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@torch.no_grad()
def decode_perplexity(
    model,
    token_ids: torch.Tensor,
    make_cache: Callable[[], object] | None = None,
    window: int = 512,
    prefill: int = 128,
    chunk: int = 1,
    max_windows: int | None = None,
) -> DecodePerplexity:
    """Perplexity of `token_ids: [T]` (or `[1, T]`) over non-overlapping windows of `window` tokens.

    Each window prefills its first `prefill` tokens, then feeds the rest `chunk` tokens at a time through the
    cache that `make_cache()` builds (a `DynamicCache` when None); only the decoded tokens are scored.
    """
    ids = token_ids.reshape(-1)
    if prefill < 1 or window <= prefill + 1:
        raise ValueError(f"need 1 <= prefill < window - 1, got prefill={prefill}, window={window}")
    if ids.numel() < window:
        raise ValueError(f"the text has {ids.numel()} tokens, fewer than one window of {window}")
    device = next(model.parameters()).device
    name = _cache_kwarg(model)
    total_nll, counted = 0.0, 0
    n_windows = ids.numel() // window if max_windows is None else min(max_windows, ids.numel() // window)
    for w in range(n_windows):
        seq = ids[w * window : (w + 1) * window].to(device)[None]
        cache = make_cache() if make_cache is not None else DynamicCache(config=text_config(model.config))
        out = model(seq[:, :prefill], **{name: cache}, use_cache=True)
        logits = [out.logits[:, -1:]]
        for start in range(prefill, window - 1, chunk):
            end = min(start + chunk, window - 1)
            out = model(seq[:, start:end], **{name: cache}, use_cache=True)
            logits.append(out.logits)
        logits = torch.cat(logits, dim=1).float()[0]  # predictions for positions prefill .. window-1
        targets = seq[0, prefill:window]
        total_nll += torch.nn.functional.cross_entropy(logits, targets, reduction="sum").item()
        counted += targets.numel()
    return DecodePerplexity(total_nll / counted, counted)
