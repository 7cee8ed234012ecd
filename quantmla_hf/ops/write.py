"""Writing packed tokens: the Triton quantize-and-pack kernels the caches call (`quantize_pack` for growing planes,
`quantize_pack_slots` and `paged_write` for page pools; None without Triton, where the caches run the PyTorch
references), and the write of a static cache's decode step as a torch custom op (namespace `quantmla`), so that
`torch.compile(fullgraph=True)` traces the step without graph breaks:

    torch.ops.quantmla.quant_append(x, codes, scale, zero, position, bits, group, use_triton)      (in place)
        quantize `x: [B, T, dim]` and write it at positions `[position, position + T)` of the planes
        `codes: [B, capacity, dim * bits / 8] uint8`, `scale, zero: [B, capacity, dim / group]`;
        `position`: int64 `[1]` on the planes' device.

The decode's op, `torch.ops.quantmla.mla_decode`, is in `decode.py`.
"""

from __future__ import annotations

import importlib.util

import torch

from ..format import PathFormat
from ..kernels.quant_pack_ref import quantize_pack_at_ref

if importlib.util.find_spec("triton") is not None:
    from ..kernels.paged_write import paged_write
    from ..kernels.quant_pack import quantize_pack, quantize_pack_slots
else:  # Triton is a dependency on Linux only (pyproject.toml): without it the writes run their PyTorch references
    paged_write = quantize_pack = quantize_pack_slots = None

LIB = "quantmla"


# ---------------------------------------------------------------------------------------------- quantize + append
@torch.library.custom_op(f"{LIB}::quant_append", mutates_args=("codes", "scale", "zero"))
def quant_append(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                 position: torch.Tensor, bits: int, group: int, use_triton: bool) -> None:
    fmt = PathFormat(x.shape[-1], bits, group)
    if use_triton:
        quantize_pack(x.contiguous(), codes, scale, zero, position, fmt)
    else:
        quantize_pack_at_ref(x, codes, scale, zero, position, fmt)


@quant_append.register_fake
def _(x, codes, scale, zero, position, bits, group, use_triton) -> None:
    return None
