"""Triton kernel: one launch writes a layer's new tokens into the paged QuantMLA cache.

Per new token `i` (one program): the content row `c[i]` and the RoPE row `r[i]` are quantized and packed into row
`slots[i]` of their page planes (viewed as `[P * page_size, width]`) by `quant_pack._quantize_pack_groups`, which
the contiguous write runs too (`quant_pack_ref.quantize_ref`'s arithmetic: the same codes, scales and zero points,
bit for bit), and both rows are copied as given into the model-dtype sink copies at flat row `copy_rows[0, i]` and
the recent ring at flat row `copy_rows[1, i]` of `[rows * S, d]` / `[rows * R, d]` (-1: the token enters neither).
A decode step of a packed format thus writes each layer in one launch, where two quantize launches and the gathers
and scatters of the copies took up to ten."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantmla_hf.format import CacheFormat, PathFormat

from .quant_pack import _quantize_pack_groups
from .quant_pack_ref import SCALE_MIN


@triton.jit
def _quantize_pack_row(p_x, p_codes, p_scale, p_zero, G: tl.constexpr, BLOCK_G: tl.constexpr, GROUP: tl.constexpr,
                       BITS: tl.constexpr, S_MIN: tl.constexpr):
    """Quantize one row of `G` groups of `GROUP` elements at `p_x` and store its codes, scales and zero points."""
    PACK: tl.constexpr = 8 // BITS
    NB: tl.constexpr = GROUP // PACK
    o_g = tl.arange(0, BLOCK_G)
    o_n = tl.arange(0, NB)
    m_g = o_g < G
    m_x = m_g[:, None] & (o_n[None, :] < NB)
    b_byte, s, zq = _quantize_pack_groups(p_x + o_g[:, None] * GROUP + o_n[None, :] * PACK, m_x, BLOCK_G, NB, BITS,
                                          S_MIN)
    tl.store(p_codes + o_g[:, None] * NB + o_n[None, :], b_byte, mask=m_x)
    tl.store(p_scale + o_g, s, mask=m_g)
    tl.store(p_zero + o_g, zq, mask=m_g)


@triton.jit
def _copy_row(p_x, p_dst, D: tl.constexpr, BLOCK_D: tl.constexpr):
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    tl.store(p_dst + o_d, tl.load(p_x + o_d, mask=m_d), mask=m_d)


# The token count changes every step: specialising on it would compile the kernel again in the middle of serving.
@triton.jit(do_not_specialize=["N"])
def paged_write_fwd_kernel(
    c_ptr, r_ptr, slots_ptr, cc_ptr, cs_ptr, cz_ptr, rc_ptr, rs_ptr, rz_ptr,
    sink_c_ptr, sink_r_ptr, recent_c_ptr, recent_r_ptr, copy_ptr, N, stride_c, stride_r,
    D_C: tl.constexpr, BLOCK_DC: tl.constexpr, C_G: tl.constexpr, C_BLOCK_G: tl.constexpr,
    C_GROUP: tl.constexpr, C_BITS: tl.constexpr, C_BYTES: tl.constexpr,
    D_R: tl.constexpr, BLOCK_DR: tl.constexpr, R_G: tl.constexpr, R_BLOCK_G: tl.constexpr,
    R_GROUP: tl.constexpr, R_BITS: tl.constexpr, R_BYTES: tl.constexpr,
    S_MIN: tl.constexpr, SINK: tl.constexpr, RECENT: tl.constexpr,
):
    # One program per new token; int64 so that offsets past 2**31 bytes stay valid.
    i = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + i).to(tl.int64)
    p_c = c_ptr + i * stride_c
    p_r = r_ptr + i * stride_r
    _quantize_pack_row(p_c, cc_ptr + slot * C_BYTES, cs_ptr + slot * C_G, cz_ptr + slot * C_G, C_G, C_BLOCK_G,
                       C_GROUP, C_BITS, S_MIN)
    _quantize_pack_row(p_r, rc_ptr + slot * R_BYTES, rs_ptr + slot * R_G, rz_ptr + slot * R_G, R_G, R_BLOCK_G,
                       R_GROUP, R_BITS, S_MIN)
    if SINK:
        row = tl.load(copy_ptr + i)
        if row >= 0:
            _copy_row(p_c, sink_c_ptr + row * D_C, D_C, BLOCK_DC)
            _copy_row(p_r, sink_r_ptr + row * D_R, D_R, BLOCK_DR)
    if RECENT:
        row = tl.load(copy_ptr + N + i)
        if row >= 0:
            _copy_row(p_c, recent_c_ptr + row * D_C, D_C, BLOCK_DC)
            _copy_row(p_r, recent_r_ptr + row * D_R, D_R, BLOCK_DR)


def _flat(planes: dict[str, torch.Tensor], path: PathFormat, name: str) -> tuple[torch.Tensor, ...]:
    """The `codes, scale, zero` page planes `[P, page_size, width]` of a packed path, checked to be laid out as
    `[P * page_size, width]` rows."""
    widths = {"codes": path.code_bytes, "scale": path.n_groups, "zero": path.n_groups}
    out = []
    for key, width in widths.items():
        plane = planes[key]
        if plane.shape[-1] != width or not plane.is_contiguous():
            raise ValueError(f"paged_write: the {name} {key} plane must be contiguous [P, page_size, {width}], got "
                             f"{tuple(plane.shape)} with strides {plane.stride()}")
        out.append(plane)
    return tuple(out)


def paged_write(c: torch.Tensor, r: torch.Tensor, content: dict[str, torch.Tensor], rope: dict[str, torch.Tensor],
                slots: torch.Tensor, copies: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                copy_rows: torch.Tensor, fmt: CacheFormat) -> None:
    """Write `N` new tokens of one layer into the paged cache in one launch (module docstring).

    Args:
        c, r: `[N, d_c]`, `[N, d_R]` new content and RoPE rows (rows may be strided, each row contiguous).
        content, rope: the layer's page planes `codes/scale/zero` `[P, page_size, width]` (both paths packed).
        slots: int64 `[N]`, each token's flat page row `page * page_size + p % page_size`.
        copies: `(sink_c, sink_r, recent_c, recent_r)` model-dtype copies `[rows, S, d]` / `[rows, R, d]`
            (contiguous; empty when the format keeps no such copies).
        copy_rows: int64 `[2, N]`, each token's flat sink row `row * S + p` and recent row `row * R + p % R`, -1
            where it enters neither.
        fmt: the cache format (both paths 2, 4 or 8 bits).
    """
    if not (fmt.content.quantized and fmt.rope.quantized):
        raise ValueError(f"paged_write writes packed paths; {fmt.name} keeps a 16-bit path: copy it as it is")
    N = c.shape[0]
    if c.shape != (N, fmt.content.dim) or r.shape != (N, fmt.rope.dim) or c.stride(-1) != 1 or r.stride(-1) != 1:
        raise ValueError(f"paged_write: c must be [N, {fmt.content.dim}] and r [N, {fmt.rope.dim}] with contiguous "
                         f"rows, got {tuple(c.shape)} and {tuple(r.shape)}")
    if slots.shape != (N,) or slots.dtype != torch.int64 or copy_rows.shape != (2, N) or copy_rows.dtype != torch.int64:
        raise ValueError(f"paged_write: slots must be int64 [N] and copy_rows int64 [2, N] for N = {N}, got "
                         f"{slots.dtype} {tuple(slots.shape)} and {copy_rows.dtype} {tuple(copy_rows.shape)}")
    if any(t.numel() and not t.is_contiguous() for t in copies):
        raise ValueError("paged_write: the sink and recent copies must be contiguous [rows, S or R, d]")
    if N == 0:
        return
    cc, cs, cz = _flat(content, fmt.content, "content")
    rc, rs, rz = _flat(rope, fmt.rope, "rope")
    sink_c, sink_r, recent_c, recent_r = copies
    sink, recent = sink_c.numel() > 0, recent_c.numel() > 0
    # An empty copy tensor has no storage to point at: pass the rows (never written, the flag is off).
    sink_c, sink_r = (sink_c, sink_r) if sink else (c, r)
    recent_c, recent_r = (recent_c, recent_r) if recent else (c, r)
    fc, fr = fmt.content, fmt.rope
    paged_write_fwd_kernel[(N,)](
        c, r, slots, cc, cs, cz, rc, rs, rz, sink_c, sink_r, recent_c, recent_r, copy_rows.contiguous(), N,
        c.stride(0), r.stride(0),
        D_C=fc.dim, BLOCK_DC=triton.next_power_of_2(fc.dim), C_G=fc.n_groups,
        C_BLOCK_G=triton.next_power_of_2(fc.n_groups), C_GROUP=fc.group, C_BITS=fc.bits, C_BYTES=fc.code_bytes,
        D_R=fr.dim, BLOCK_DR=triton.next_power_of_2(fr.dim), R_G=fr.n_groups,
        R_BLOCK_G=triton.next_power_of_2(fr.n_groups), R_GROUP=fr.group, R_BITS=fr.bits, R_BYTES=fr.code_bytes,
        S_MIN=SCALE_MIN, SINK=sink, RECENT=recent,
    )
