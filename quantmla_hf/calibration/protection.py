"""The cache's sink/recent protection, as seen by a calibration window.

At decode, a query at position `t` reads key `j <= t` exact when `j < sink` (a sink token) or `t - j < recent`
(one of the last `recent` tokens, the query itself included), and dequantized otherwise. Over a calibration window
of `T` tokens this is a per-pair pattern, so one latent per token cannot express it. The content objective therefore
hands the module a doubled history `[quantized copies (T) | exact copies (T)]` and a `[T, 2T]` mask that lets query
`t` see the quantized copy of `j` where the pair is quantized and the exact copy where it is protected: every query
attends over exactly the history the cache would give it, in one softmax.

`sink = recent = 0` is the unprotected case (every pair quantized), the paper's ablation setting.
"""

from __future__ import annotations

import torch


def quantized_pairs(T: int, sink: int, recent: int, device=None) -> torch.Tensor:
    """Bool `[T, T]`: True where query `t` reads key `j` dequantized (`j <= t`, `j >= sink`, `t - j >= recent`)."""
    t = torch.arange(T, device=device)[:, None]
    j = torch.arange(T, device=device)[None, :]
    return (j <= t) & (j >= sink) & (t - j >= recent)


def dual_history_mask(T: int, sink: int, recent: int, dtype: torch.dtype, device=None) -> torch.Tensor:
    """Additive mask `[1, 1, T, 2T]` over the doubled history `[quantized (T) | exact (T)]` (0 = attend, the dtype's
    lowest value = not)."""
    quant = quantized_pairs(T, sink, recent, device)
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    allowed = torch.cat([quant, causal & ~quant], dim=1)
    mask = torch.zeros(T, 2 * T, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def dual_history(latent: torch.Tensor, k_rot: torch.Tensor, latent_hat: torch.Tensor, k_rot_hat: torch.Tensor):
    """`(latent [B, 1, 2T, d_c], k_rot [B, 1, 2T, d_R])`: the quantized copies, then the exact ones (token axis -2)."""
    return torch.cat([latent_hat, latent], dim=-2), torch.cat([k_rot_hat, k_rot], dim=-2)


def quantized_fraction(T: int, sink: int, recent: int) -> float:
    """Fraction of the causal pairs of a `T`-token window that read a dequantized key."""
    return float(quantized_pairs(T, sink, recent).sum()) / (T * (T + 1) / 2)
