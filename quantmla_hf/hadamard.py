"""Normalized Walsh-Hadamard matrices (QuaRot-style rotations)."""

from __future__ import annotations

import torch


def hadamard_matrix(n: int, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """Orthogonal `[n, n]` Sylvester-Hadamard matrix scaled by `1/sqrt(n)`; `n` must be a power of two."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two width, got {n}")
    h = torch.ones((1, 1), dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / n**0.5).to(dtype=dtype, device=device)
