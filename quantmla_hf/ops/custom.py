"""The QuantMLA kernels as torch custom ops (namespace `quantmla`), so `torch.compile(fullgraph=True)` traces a
decode step without graph breaks and `mode="reduce-overhead"` captures it as one CUDA graph.

    torch.ops.quantmla.quant_append(x, codes, scale, zero, position, bits, group, use_triton)      (in place)
        quantize `x: [B, T, dim]` and write it at positions `[position, position + T)` of the planes
        `codes: [B, capacity, dim * bits / 8] uint8`, `scale, zero: [B, capacity, dim / group]`;
        `position`: int64 `[1]` on the planes' device.
    torch.ops.quantmla.mla_decode(q_lat, q_rot, c0, c1, c2, r0, r1, r2, sink_c, sink_r, recent_c, recent_r,
                                  left_padding, length, capacity, scaling, c_bits, c_group, r_bits, r_group,
                                  sink_tokens, recent_tokens, use_triton) -> (o_lat [B, H, Tq, d_c], lse [B, H, Tq])
        absorbed attention over the static cache; `length` int64 `[1]` and `left_padding` `[B]` on the device.
        A quantized path passes its `codes, scale, zero` planes; a 16-bit path passes its `values` plane as
        `codes` (c0 / r0) and empty tensors for scale and zero.

`mla_decode` runs `decode_contiguous`: `backends.mla_decode_static`, whose `select_backend` picks the kernel, or the
PyTorch reference when `use_triton` is False (the config's kernel is "torch", or CPU without the interpreter).
Outside a compiled step `decode.decode` calls `decode_contiguous` itself, for every contiguous cache, so eager,
captured and compiled steps of the growing and the static cache run the same kernel with the same split boundaries
and agree bit for bit. None of them synchronises with the host. Every op has a fake (meta)
implementation giving its output shapes, and the decode outputs are fresh tensors (no aliasing), as
`torch.library.opcheck` requires (the split-K combine runs inside `mla_decode`).
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from ..format import CacheFormat, PathFormat
from ..kernels.mla_decode_ref import mla_decode_static_ref
from ..kernels.quant_pack_ref import quantize_pack_at_ref

if importlib.util.find_spec("triton") is not None:  # the Triton-backed kernels, for this module and the caches
    from .backends import mla_decode_paged, mla_decode_static
    from ..kernels.paged_write import paged_write
    from ..kernels.quant_pack import quantize_pack, quantize_pack_slots
else:  # Triton is a dependency on Linux only (pyproject.toml): without it every op runs its PyTorch reference
    mla_decode_static = mla_decode_paged = paged_write = quantize_pack = quantize_pack_slots = None

LIB = "quantmla"


@functools.lru_cache(maxsize=None)
def cache_format(c_dim: int, c_bits: int, c_group: int, r_dim: int, r_bits: int, r_group: int, sink: int,
                 recent: int) -> CacheFormat:
    """The `CacheFormat` the ops rebuild from their int arguments (cached: one object per format)."""
    return CacheFormat(PathFormat(c_dim, c_bits, c_group), PathFormat(r_dim, r_bits, r_group), sink, recent)


def _planes(p0: torch.Tensor, p1: torch.Tensor, p2: torch.Tensor, bits: int) -> dict[str, torch.Tensor]:
    return {"values": p0} if bits == 16 else {"codes": p0, "scale": p1, "zero": p2}


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


# ---------------------------------------------------------------------------------------------- decode
def decode_contiguous(
    q_lat: torch.Tensor, q_rot: torch.Tensor, content_planes: dict[str, torch.Tensor],
    rope_planes: dict[str, torch.Tensor], fmt: CacheFormat, sink_c: torch.Tensor, sink_r: torch.Tensor,
    recent_c: torch.Tensor, recent_r: torch.Tensor, left_padding: torch.Tensor, length: torch.Tensor, capacity: int,
    scaling: float, use_triton: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed decode over the first `length` (int64 `[1]` on the device) positions of planes `[B, capacity, .]`:
    the body of `torch.ops.quantmla.mla_decode`, and what `decode.decode` runs outside a compiled step.
    `use_triton` False takes the PyTorch reference. Returns `(o_lat [B, H, Tq, d_c] fp32, lse [B, H, Tq] fp32)`; no host synchronisation."""
    args = (q_lat, q_rot, content_planes, rope_planes, fmt, sink_c, sink_r, recent_c, recent_r, left_padding, length,
            capacity, scaling)
    if not use_triton:
        return mla_decode_static_ref(*args)
    return mla_decode_static(*args)


@torch.library.custom_op(f"{LIB}::mla_decode", mutates_args=())
def mla_decode(
    q_lat: torch.Tensor, q_rot: torch.Tensor,
    c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor, r0: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor,
    sink_c: torch.Tensor, sink_r: torch.Tensor, recent_c: torch.Tensor, recent_r: torch.Tensor,
    left_padding: torch.Tensor, length: torch.Tensor, capacity: int, scaling: float,
    c_bits: int, c_group: int, r_bits: int, r_group: int, sink_tokens: int, recent_tokens: int, use_triton: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    fmt = cache_format(q_lat.shape[-1], c_bits, c_group, q_rot.shape[-1], r_bits, r_group, sink_tokens,
                       recent_tokens)
    return decode_contiguous(q_lat, q_rot, _planes(c0, c1, c2, c_bits), _planes(r0, r1, r2, r_bits), fmt, sink_c,
                             sink_r, recent_c, recent_r, left_padding, length, capacity, scaling, use_triton)


@mla_decode.register_fake
def _(q_lat, q_rot, c0, c1, c2, r0, r1, r2, sink_c, sink_r, recent_c, recent_r, left_padding, length, capacity,
      scaling, c_bits, c_group, r_bits, r_group, sink_tokens, recent_tokens, use_triton):
    B, H, Tq, d_c = q_lat.shape
    return q_lat.new_empty((B, H, Tq, d_c), dtype=torch.float32), q_lat.new_empty((B, H, Tq), dtype=torch.float32)

