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
    torch.ops.quantmla.lse_combine(o_part [B, M, NSP, d_c], lse_part [B, M, NSP]) -> (o [B, M, d_c], lse [B, M])
        merge split-K partials by log-sum-exp (`-inf` partials are empty splits).

Dispatch of `mla_decode` (`decode_device_length`): `quantmla_hf.kernels.mla_decode_fast.mla_decode_static` when
that module exists, the kernels are wanted (CUDA, or `use_triton`: the Triton interpreter on CPU) and its
`fast_supported(fmt, q_dtype, device, copy_dtype)` says so (`fast_decode_module`), else the Triton kernel of
`kernels/mla_decode.py` on CUDA or when `use_triton`, else the PyTorch reference `mla_decode_static_ref`. None of
them synchronises with the host. The growing `QuantMLACache` calls the same `decode_device_length` where
`fast_decode_module` takes the case (attention.py), so eager and static decoding run the same kernel with the same
split boundaries (they follow the length, not the capacity: `mla_decode_fast.split_plan`) and agree bit for bit.
Every op has a fake (meta) implementation giving its output shapes, and the decode and combine outputs are fresh
tensors (no aliasing), as `torch.library.opcheck` requires.
"""

from __future__ import annotations

import functools
import importlib

import torch

from .format import CacheFormat, PathFormat

LIB = "quantmla"


@functools.lru_cache(maxsize=None)
def cache_format(c_dim: int, c_bits: int, c_group: int, r_dim: int, r_bits: int, r_group: int, sink: int,
                 recent: int) -> CacheFormat:
    """The `CacheFormat` the ops rebuild from their int arguments (cached: one object per format)."""
    return CacheFormat(PathFormat(c_dim, c_bits, c_group), PathFormat(r_dim, r_bits, r_group), sink, recent)


@functools.lru_cache(maxsize=None)
def _fast_module():
    """`quantmla_hf.kernels.mla_decode_fast` (issue #11) if this installation has it, else None."""
    name = "quantmla_hf.kernels.mla_decode_fast"
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name != name:
            raise
        return None


def _planes(p0: torch.Tensor, p1: torch.Tensor, p2: torch.Tensor, bits: int) -> dict[str, torch.Tensor]:
    return {"values": p0} if bits == 16 else {"codes": p0, "scale": p1, "zero": p2}


# ---------------------------------------------------------------------------------------------- quantize + append
@torch.library.custom_op(f"{LIB}::quant_append", mutates_args=("codes", "scale", "zero"))
def quant_append(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                 position: torch.Tensor, bits: int, group: int, use_triton: bool) -> None:
    fmt = PathFormat(x.shape[-1], bits, group)
    if use_triton:
        from .kernels.quant_pack import quant_pack_fwd

        quant_pack_fwd(x.contiguous(), codes, scale, zero, position, fmt)
    else:
        from .kernels.quant_pack_ref import quantize_pack_at_ref

        quantize_pack_at_ref(x, codes, scale, zero, position, fmt)


@quant_append.register_fake
def _(x, codes, scale, zero, position, bits, group, use_triton) -> None:
    return None


# ---------------------------------------------------------------------------------------------- decode
def fast_decode_module(fmt: CacheFormat, q_lat: torch.Tensor, copy_dtype: torch.dtype, use_triton: bool):
    """`kernels/mla_decode_fast.py` when it takes this decode (kernels wanted: CUDA or `use_triton`; the module
    present; `fast_supported`, which includes the Triton interpreter on CPU), else None."""
    if not (q_lat.is_cuda or use_triton):
        return None
    fast = _fast_module()
    if fast is None or not fast.fast_supported(fmt, q_lat.dtype, q_lat.device, copy_dtype):
        return None
    return fast


def decode_device_length(
    q_lat: torch.Tensor, q_rot: torch.Tensor, content_planes: dict[str, torch.Tensor],
    rope_planes: dict[str, torch.Tensor], fmt: CacheFormat, sink_c: torch.Tensor, sink_r: torch.Tensor,
    recent_c: torch.Tensor, recent_r: torch.Tensor, left_padding: torch.Tensor, length: torch.Tensor, capacity: int,
    scaling: float, use_triton: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed decode over the first `length` (int64 `[1]` on the device) positions of planes `[B, capacity, .]`:
    the dispatch of `torch.ops.quantmla.mla_decode`, also what the growing cache's fast path calls. Returns
    `(o_lat [B, H, Tq, d_c] fp32, lse [B, H, Tq] fp32)`; no host synchronisation."""
    args = (q_lat, q_rot, content_planes, rope_planes, fmt, sink_c, sink_r, recent_c, recent_r, left_padding,
            length, capacity, scaling)
    # fp32 models keep fp32 sink/recent copies: those take the fallback's exact fp32 path, not fp16 operands.
    fast = fast_decode_module(fmt, q_lat, sink_c.dtype, use_triton)
    if fast is not None:
        return fast.mla_decode_static(*args)
    if q_lat.is_cuda or use_triton:
        from .kernels.mla_decode import mla_decode_static

        return mla_decode_static(*args)
    from .kernels.mla_decode_ref import mla_decode_static_ref

    return mla_decode_static_ref(*args)


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
    return decode_device_length(q_lat, q_rot, _planes(c0, c1, c2, c_bits), _planes(r0, r1, r2, r_bits), fmt, sink_c,
                                sink_r, recent_c, recent_r, left_padding, length, capacity, scaling, use_triton)


@mla_decode.register_fake
def _(q_lat, q_rot, c0, c1, c2, r0, r1, r2, sink_c, sink_r, recent_c, recent_r, left_padding, length, capacity,
      scaling, c_bits, c_group, r_bits, r_group, sink_tokens, recent_tokens, use_triton):
    B, H, Tq, d_c = q_lat.shape
    return q_lat.new_empty((B, H, Tq, d_c), dtype=torch.float32), q_lat.new_empty((B, H, Tq), dtype=torch.float32)


# ---------------------------------------------------------------------------------------------- combine
@torch.library.custom_op(f"{LIB}::lse_combine", mutates_args=())
def lse_combine(o_part: torch.Tensor, lse_part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if o_part.is_cuda:
        from .kernels.mla_decode import combine_partials

        return combine_partials(o_part.contiguous(), lse_part.contiguous())
    return lse_combine_ref(o_part, lse_part)


@lse_combine.register_fake
def _(o_part, lse_part):
    B, M, _, D = o_part.shape
    return o_part.new_empty((B, M, D), dtype=torch.float32), o_part.new_empty((B, M), dtype=torch.float32)


def lse_combine_ref(o_part: torch.Tensor, lse_part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of the combine: `o = sum_s exp(lse_s - lse) o_s`, `lse = logsumexp_s lse_s` (fp32)."""
    lse_part = lse_part.float()
    lse = torch.logsumexp(lse_part, dim=-1)  # -inf where every split is empty
    w = torch.exp(lse_part - lse.unsqueeze(-1)).nan_to_num(0.0)
    return (w.unsqueeze(-1) * o_part.float()).sum(-2), lse

