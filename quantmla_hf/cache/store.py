"""Block-grown storage of one cached path (content latent or RoPE key) for a batch of sequences.

Layout of the planes is documented in `quantmla_hf/format.py`. Storage grows geometrically while short (16, 32,
64, ... tokens up to one block of `block_size`) and then by whole blocks (`format.allocated_tokens`): when a
write would pass the capacity, planes are reallocated and the old contents copied once, so a short prompt holds
little, a long one at most one block of slack, and a decode step never concatenates the history.
"""

from __future__ import annotations

import torch

from ..format import SCALE_DTYPE, ZERO_DTYPE, PathFormat, allocated_tokens
from ..kernels.quant_pack_ref import dequantize_ref, quantize_ref
from ..ops.write import quantize_pack


class PackedPathStore:
    """Planes of one path: `codes/scale/zero` for 2-8 bits, `values` for 16 bits; all `[B, capacity, ...]`.

    Args:
        fmt: the path's format.
        batch_size: number of sequences.
        dtype: the model's compute dtype (used for 16-bit storage and for dequantized outputs).
        device: where the planes live.
        block_size: allocation granularity in tokens once the planes hold a block (geometric growth before).
    """

    def __init__(self, fmt: PathFormat, batch_size: int, dtype: torch.dtype, device, block_size: int):
        self.fmt = fmt
        self.dtype = dtype
        self.block_size = block_size
        self.planes: dict[str, torch.Tensor] = {
            name: torch.empty((batch_size, 0, width), dtype=plane_dtype, device=device)
            for name, (width, plane_dtype) in self._plane_specs().items()
        }

    def _plane_specs(self) -> dict[str, tuple[int, torch.dtype]]:
        f = self.fmt
        if not f.quantized:
            return {"values": (f.dim, self.dtype)}
        return {"codes": (f.code_bytes, torch.uint8), "scale": (f.n_groups, SCALE_DTYPE), "zero": (f.n_groups, ZERO_DTYPE)}

    @property
    def capacity(self) -> int:
        return next(iter(self.planes.values())).shape[1]

    @property
    def batch_size(self) -> int:
        return next(iter(self.planes.values())).shape[0]

    def nbytes(self) -> int:
        """Bytes allocated by the planes."""
        return sum(p.numel() * p.element_size() for p in self.planes.values())

    def reserve(self, n_tokens: int, used: int) -> None:
        """Make room for `n_tokens` tokens, keeping the first `used` ones."""
        if n_tokens <= self.capacity:
            return
        new_cap = allocated_tokens(n_tokens, self.block_size)
        for name, old in self.planes.items():
            new = torch.empty((old.shape[0], new_cap, old.shape[2]), dtype=old.dtype, device=old.device)
            new[:, :used].copy_(old[:, :used])
            self.planes[name] = new

    def grow_to(self, capacity: int) -> None:
        """Reallocate every plane to exactly `capacity` positions (zeros past the old ones), keeping the contents:
        a fixed-capacity (static) store growing in place. New tensors: their addresses change."""
        if capacity <= self.capacity:
            return
        for name, old in self.planes.items():
            new = torch.zeros((old.shape[0], capacity, old.shape[2]), dtype=old.dtype, device=old.device)
            new[:, : old.shape[1]].copy_(old)
            self.planes[name] = new
        self.block_size = capacity

    def shrink(self, n_tokens: int) -> None:
        """Release the storage past what `n_tokens` tokens are allocated (`allocated_tokens`)."""
        keep = allocated_tokens(n_tokens, self.block_size)
        if keep < self.capacity:
            self.planes = {k: v[:, :keep].clone() for k, v in self.planes.items()}

    def write(self, x: torch.Tensor, start: int, use_triton: bool) -> None:
        """Store `x: [B, T, dim]` at positions `[start, start + T)` (capacity must already be reserved)."""
        T = x.shape[1]
        if not self.fmt.quantized:
            self.planes["values"][:, start : start + T].copy_(x)
            return
        if use_triton:
            quantize_pack(x.contiguous(), self.planes["codes"], self.planes["scale"], self.planes["zero"], start, self.fmt)
            return
        codes, scale, zero = quantize_ref(x, self.fmt)
        self.planes["codes"][:, start : start + T].copy_(codes)
        self.planes["scale"][:, start : start + T].copy_(scale)
        self.planes["zero"][:, start : start + T].copy_(zero)

    def read(self, end: int, start: int = 0) -> torch.Tensor:
        """Reconstruct positions `[start, end)` as `[B, end - start, dim]` in the model dtype."""
        if not self.fmt.quantized:
            return self.planes["values"][:, start:end]
        p = self.planes
        return dequantize_ref(p["codes"][:, start:end], p["scale"][:, start:end], p["zero"][:, start:end], self.fmt, self.dtype)

    def apply_batch(self, fn) -> None:
        """Apply `fn` (index_select, repeat_interleave, ...) along the batch dimension of every plane."""
        self.planes = {k: fn(v) for k, v in self.planes.items()}
