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

from ..mla import text_config


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
def window_nll(model, windows: torch.Tensor, make_cache: Callable[[], object] | None = None, prefill: int = 128,
               chunk: int = 1) -> torch.Tensor:
    """Summed next-token NLL `[B]` (fp64, nats) of the decoded part of each window of `windows: [B, W]`.

    The windows run together (one cache of batch `B`): each prefills its first `prefill` tokens, then feeds the rest
    `chunk` tokens at a time through the cache that `make_cache()` builds (a `DynamicCache` when None); positions
    `prefill .. W - 1` are scored. Equal-length windows need no padding, so each row computes what it would alone
    (up to the rounding of batched matrix products).
    """
    W = windows.shape[1]
    if prefill < 1 or W <= prefill + 1:
        raise ValueError(f"need 1 <= prefill < window - 1, got prefill={prefill}, window={W}")
    seq = windows.to(next(model.parameters()).device)
    name = _cache_kwarg(model)
    cache = make_cache() if make_cache is not None else DynamicCache(config=text_config(model.config))
    out = model(seq[:, :prefill], **{name: cache}, use_cache=True)
    logits = [out.logits[:, -1:]]
    for start in range(prefill, W - 1, chunk):
        out = model(seq[:, start : min(start + chunk, W - 1)], **{name: cache}, use_cache=True)
        logits.append(out.logits)
    logits = torch.cat(logits, dim=1).float()  # [B, W - prefill, V]: predictions for positions prefill .. W - 1
    nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), seq[:, prefill:], reduction="none")
    return nll.double().sum(1).cpu()


def decode_perplexity(
    model,
    token_ids: torch.Tensor,
    make_cache: Callable[[], object] | None = None,
    window: int = 512,
    prefill: int = 128,
    chunk: int = 1,
    max_windows: int | None = None,
    batch: int = 1,
) -> DecodePerplexity:
    """Perplexity of `token_ids: [T]` (or `[1, T]`) over non-overlapping windows of `window` tokens.

    Each window prefills its first `prefill` tokens, then feeds the rest `chunk` tokens at a time through the
    cache that `make_cache()` builds (a `DynamicCache` when None); only the decoded tokens are scored. `batch` windows
    decode together (`window_nll`), which on a CPU costs little more per step than one.
    """
    ids = token_ids.reshape(-1)
    if prefill < 1 or window <= prefill + 1:
        raise ValueError(f"need 1 <= prefill < window - 1, got prefill={prefill}, window={window}")
    if ids.numel() < window:
        raise ValueError(f"the text has {ids.numel()} tokens, fewer than one window of {window}")
    n_windows = ids.numel() // window if max_windows is None else min(max_windows, ids.numel() // window)
    windows = ids[: n_windows * window].view(n_windows, window)
    total = sum(float(window_nll(model, windows[i : i + batch], make_cache, prefill, chunk).sum())
                for i in range(0, n_windows, max(1, batch)))
    counted = n_windows * (window - prefill)
    return DecodePerplexity(total / counted, counted)
