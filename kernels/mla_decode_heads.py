"""The many-heads Triton decode kernel: the portable kernel's function (`mla_decode_triton.py`, reference
`mla_decode_ref.py`) with 64 query rows per program as the matrix products' M, so that on Hopper every product is a
`wgmma` and each token tile is unpacked once per 64 rows.

Per token tile `[BT]` the program unpacks the whole content and RoPE rows once into fp16 values
`fp16((code - z) * s)` (one rounding; the model-dtype copies as stored), and both products read that tile:

    scores[BM, BT] = (q_c[BM, D_C] @ k_c[BT, D_C]^T) * f_c + (q_r[BM, D_R] @ k_r[BT, D_R]^T) * f_r
    acc[BM, D_C]   = acc * alpha + p[BM, BT] @ k_c[BT, D_C]

Queries are staged once per program as fp16 after the per-row power of two `f` of the portable kernel (fp32 queries
with their low part); staged bf16 queries pass through the program's own partial rows so that the products read them
from shared memory. Same arguments, grid, splits, paged reads and partials as `mla_decode_triton_kernel`, so
`mla_decode_triton.launch_triton` launches either and `mla_decode_combine.py` merges their partials.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantmla_hf.format import CacheFormat

from .mla_decode_triton import _magic_codes, _program, _row_scale, _split_range, launch_triton


@triton.jit
def _dequant_rows(p0, p1, p2, s_t, s_mt, o_t, m_t, D: tl.constexpr, GROUP: tl.constexpr, BITS: tl.constexpr,
                  NATIVE: tl.constexpr, KD: tl.constexpr):
    """Rows `o_t: [BT]` of one path (row-offset pointers, rows at stride `s_t`, metadata rows at `s_mt`) as values
    `[BT, D]`: packed (`BITS` < 16; `p0, p1, p2` = codes, fp16 scales, zero points) `fp16((code - z) * s)`, 16-bit
    (`p0` the values) as stored when NATIVE, else in fp16. Masked rows are zeros."""
    G: tl.constexpr = D // GROUP
    if BITS == 16:
        o_k = tl.arange(0, D)
        v = tl.load(p0 + (o_t * s_t)[:, None] + o_k[None, :], mask=m_t[:, None], other=0.0)
        if not NATIVE:
            v = v.to(tl.float16)
    else:
        BT: tl.constexpr = o_t.shape[0]
        HALF: tl.constexpr = 1 << (BITS - 1)
        if BITS == 8:
            o_b = tl.arange(0, D)
            b_byte = tl.load(p0 + (o_t * s_t)[:, None] + o_b[None, :], mask=m_t[:, None], other=0)
            codes = (b_byte.to(tl.int16) | 0x6400).to(tl.float16, bitcast=True)
        else:
            o_b = tl.arange(0, D * BITS // 8)
            b_byte = tl.load(p0 + (o_t * s_t)[:, None] + o_b[None, :], mask=m_t[:, None], other=0)
            codes = _magic_codes(b_byte, D, BITS)  # [BT, D] fp16 1024 + code
        o_g = tl.arange(0, G)
        b_s = tl.load(p1 + (o_t * s_mt)[:, None] + o_g[None, :], mask=m_t[:, None], other=0.0).to(tl.float16)
        b_z = tl.load(p2 + (o_t * s_mt)[:, None] + o_g[None, :], mask=m_t[:, None], other=0).to(tl.int32)
        z = (b_z + (1024 + HALF)).to(tl.float16)  # 1024 + z, exact
        k = tl.reshape(codes, (BT, G, GROUP)) - z[:, :, None]  # code - z, exact
        if NATIVE:
            v = tl.reshape((k.to(tl.float32) * b_s.to(tl.float32)[:, :, None]).to(KD), (BT, D))
        else:
            v = tl.reshape(k * b_s[:, :, None], (BT, D))
    return v


@triton.jit
def _stage_rows(p, o_m, m_m, inv_f, D: tl.constexpr, NATIVE: tl.constexpr):
    """Rows `o_m` of queries `p: [., D]` divided by their power of two: `(hi, lo)` fp16 `[BM, D]` (`lo` the rounding
    error of `hi`), or `(q, q)` as stored when NATIVE."""
    o_k = tl.arange(0, D)
    q = tl.load(p + o_m[:, None] * D + o_k[None, :], mask=m_m[:, None], other=0.0)
    if NATIVE:
        hi = q
        lo = q
    else:
        q = q.to(tl.float32) * inv_f[:, None]
        hi = q.to(tl.float16)
        lo = (q - hi.to(tl.float32)).to(tl.float16)
    return hi, lo


@triton.jit
def _scores(q_hi, q_lo, k, Q_SPLIT: tl.constexpr):
    """`[BM, D] x [BT, D]^T -> [BM, BT]` fp32 (the low query part added when Q_SPLIT; fp32 operands an IEEE dot)."""
    k_t = tl.trans(k)
    if k.dtype == tl.float32:
        return tl.dot(q_hi, k_t, input_precision="ieee")
    d = tl.dot(q_hi, k_t)
    if Q_SPLIT:
        d += tl.dot(q_lo, k_t)
    return d


@triton.jit
def _tile(qc_hi, qc_lo, qr_hi, qr_lo, fc, fr, c0, c1, c2, r0, r1, r2, s_ct, s_cmt, s_rt, s_rmt, o_t, m_t, m_valid,
          m_i, l_i, acc, D_C: tl.constexpr, GROUP_C: tl.constexpr, C_BITS: tl.constexpr, D_R: tl.constexpr,
          R_BITS: tl.constexpr, Q_SPLIT: tl.constexpr, NATIVE: tl.constexpr):
    """One token tile `o_t: [BT]` (mask `m_t`; `m_valid: [BM, BT]` which row sees which token): the content and
    RoPE rows unpacked once, scores, an online-softmax step in base 2 and the value product. Returns `(m_i, l_i,
    acc)`."""
    k_c = _dequant_rows(c0, c1, c2, s_ct, s_cmt, o_t, m_t, D_C, GROUP_C, C_BITS, NATIVE, qc_hi.dtype)
    k_r = _dequant_rows(r0, r1, r2, s_rt, s_rmt, o_t, m_t, D_R, D_R, R_BITS, NATIVE, qc_hi.dtype)
    b_s = _scores(qc_hi, qc_lo, k_c, Q_SPLIT) * fc[:, None] + _scores(qr_hi, qr_lo, k_r, Q_SPLIT) * fr[:, None]
    b_s = tl.where(m_valid, b_s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(b_s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    b_p = tl.exp2(b_s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(b_p, axis=1)
    if k_c.dtype == tl.float32:
        pv = tl.dot(b_p, k_c, input_precision="ieee")
    else:
        pv = tl.dot(b_p.to(k_c.dtype), k_c)
    return m_new, l_i, acc * alpha[:, None] + pv


# Lengths, counts and the page-table width change every step: no specialisation on them.
@triton.jit(do_not_specialize=["M", "Tq", "s_pt", "split_target", "num_splits"])
def mla_decode_heads_kernel(
    q_ptr, qr_ptr,
    cc_ptr, cs_ptr, cz_ptr, rc_ptr, rs_ptr, rz_ptr,
    snc_ptr, snr_ptr, rcc_ptr, rcr_ptr,
    len_ptr, lp_ptr, pt_ptr, rows_ptr, cu_q_ptr, tok_req_ptr,
    o_ptr, lse_ptr,
    M, Tq, s_pt, split_target, num_splits, qk_scale,
    s_qb, s_qrb, s_ccb, s_cct, s_csb, s_cst, s_rcb, s_rct, s_rsb, s_rst,
    s_sncb, s_snct, s_snrb, s_snrt, s_rccb, s_rcct, s_rcrb, s_rcrt,
    D_C: tl.constexpr, GC: tl.constexpr, GROUP_C: tl.constexpr, C_BITS: tl.constexpr,
    D_R: tl.constexpr, R_BITS: tl.constexpr, S: tl.constexpr, R: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr, Q_SPLIT: tl.constexpr, NATIVE: tl.constexpr,
):
    """`mla_decode_triton_kernel`'s programs, arguments and partials (its docstring) over whole-row tiles: one
    program per (split, block of `BLOCK_M` rows, sequence program); `GC` is unused (the content path is unpacked
    whole, in groups of `GROUP_C`)."""
    i_s, i_p, i_req, row, length, lp, limit0, o_m, m_m, lim_m = _program(
        len_ptr, lp_ptr, rows_ptr, cu_q_ptr, tok_req_ptr, M, Tq, PAGE, BLOCK_M)

    p_q = q_ptr + i_p * s_qb
    p_qr = qr_ptr + i_p * s_qrb
    fc, inv_fc = _row_scale(p_q, o_m, m_m, D_C, NATIVE)
    fr, inv_fr = _row_scale(p_qr, o_m, m_m, D_R, NATIVE)
    qc_hi, qc_lo = _stage_rows(p_q, o_m, m_m, inv_fc, D_C, NATIVE)
    qr_hi, qr_lo = _stage_rows(p_qr, o_m, m_m, inv_fr, D_R, NATIVE)
    o_row = (i_p * M + o_m) * (num_splits + 1) + i_s  # [BM] index of (sequence program, row, split)
    if not NATIVE and not Q_SPLIT:
        # The staged fp16 queries go through this program's own partial rows (2 * D_C fp16 each, written again at
        # the end) and are loaded back: operands loaded as they are, the products read them from shared memory
        # instead of holding `[BM, D_C]` in registers.
        p_st = o_ptr.to(tl.pointer_type(tl.float16)) + o_row[:, None].to(tl.int64) * (2 * D_C)
        o_c = tl.arange(0, D_C)[None, :]
        o_r = D_C + tl.arange(0, D_R)[None, :]
        tl.store(p_st + o_c, qc_hi, mask=m_m[:, None])
        tl.store(p_st + o_r, qr_hi, mask=m_m[:, None])
        tl.debug_barrier()
        qc_hi = tl.load(p_st + o_c, mask=m_m[:, None], other=0.0)
        qr_hi = tl.load(p_st + o_r, mask=m_m[:, None], other=0.0)
        qc_lo = qc_hi
        qr_lo = qr_hi
    fc = fc * qk_scale
    fr = fr * qk_scale
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D_C), tl.float32)
    is_dense = i_s == num_splits

    # Packed positions: this split's share of [S, length - R) (the portable kernel's rule), from valid positions on.
    lo_s, hi_s = _split_range(length, limit0, i_s, is_dense, split_target, S, R, BLOCK_T)
    lo_valid = lp + S
    p_cc, p_cs, p_cz = cc_ptr + i_req * s_ccb, cs_ptr + i_req * s_csb, cz_ptr + i_req * s_csb
    p_rc, p_rs, p_rz = rc_ptr + i_req * s_rcb, rs_ptr + i_req * s_rsb, rz_ptr + i_req * s_rsb
    p_pt = pt_ptr + i_req * s_pt
    o_bt = tl.arange(0, BLOCK_T).to(tl.int64)
    for start in range(lo_s, hi_s, BLOCK_T):
        o_t = start + o_bt
        m_t = (o_t < hi_s) & (o_t >= lo_valid)
        slot = o_t
        if PAGE:
            slot = tl.load(p_pt + o_t // PAGE, mask=m_t, other=0).to(tl.int64) * PAGE + o_t % PAGE
        m_i, l_i, acc = _tile(qc_hi, qc_lo, qr_hi, qr_lo, fc, fr, p_cc, p_cs, p_cz, p_rc, p_rs, p_rz, s_cct, s_cst,
                              s_rct, s_rst, slot, m_t, m_m[:, None] & m_t[None, :], m_i, l_i, acc, D_C, GROUP_C,
                              C_BITS, D_R, R_BITS, Q_SPLIT, NATIVE)

    # The last split takes the model-dtype copies: the sink (slot j = position lp + j) and the recent ring
    # (positions [length - R, length) past the sink, slot p % R), causal per query row.
    n_sink = tl.where(is_dense, S, 0)
    p_snc = snc_ptr + row * s_sncb
    p_snr = snr_ptr + row * s_snrb
    for start in range(0, n_sink, BLOCK_T):
        o_j = start + o_bt
        o_t = lp + o_j
        m_t = (o_j < S) & (o_t < length)
        m_valid = m_m[:, None] & m_t[None, :] & (o_t[None, :] < lim_m[:, None])
        m_i, l_i, acc = _tile(qc_hi, qc_lo, qr_hi, qr_lo, fc, fr, p_snc, p_snc, p_snc, p_snr, p_snr, p_snr, s_snct,
                              s_snct, s_snrt, s_snrt, o_j, m_t, m_valid, m_i, l_i, acc, D_C, GROUP_C, 16, D_R, 16,
                              Q_SPLIT, NATIVE)
    r_lo = tl.maximum(length - R, 0)
    r_hi = tl.where(is_dense, length, r_lo)
    p_rcc = rcc_ptr + row * s_rccb
    p_rcr = rcr_ptr + row * s_rcrb
    RING: tl.constexpr = R if R > 0 else 1
    for start in range(r_lo, r_hi, BLOCK_T):
        o_t = start + o_bt
        m_t = (o_t < r_hi) & (o_t >= lo_valid)
        m_valid = m_m[:, None] & m_t[None, :] & (o_t[None, :] < lim_m[:, None])
        m_i, l_i, acc = _tile(qc_hi, qc_lo, qr_hi, qr_lo, fc, fr, p_rcc, p_rcc, p_rcc, p_rcr, p_rcr, p_rcr, s_rcct,
                              s_rcct, s_rcrt, s_rcrt, o_t % RING, m_t, m_valid, m_i, l_i, acc, D_C, GROUP_C, 16, D_R,
                              16, Q_SPLIT, NATIVE)

    has = l_i > 0
    inv_l = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
    b_lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    tl.debug_barrier()  # every thread's staged queries read before the partial overwrites them
    o_k = tl.arange(0, D_C)
    tl.store(o_ptr + o_row[:, None] * D_C + o_k[None, :], acc * inv_l[:, None], mask=m_m[:, None])
    tl.store(lse_ptr + o_row, b_lse, mask=m_m)


BLOCK_M = 64  # query rows per program: the M of every wgmma


def launch_shape(fmt: CacheFormat) -> tuple[int, int, int]:
    """`(tokens per tile, warps, pipeline stages)`: two warpgroups (the `[64, d_c]` fp32 accumulator at 128
    registers a thread), 32-token tiles for packed content and 64 for 16-bit (the fewest spills of the sm_90
    compile)."""
    return (32 if fmt.content.quantized else 64), 8, 2


def native_operands(q_dtype: torch.dtype, qr_dtype: torch.dtype, copy_dtype: torch.dtype) -> bool:
    """Whether a launch keeps the products in the model dtype (`NATIVE`: queries as stored, keys rounded once to the
    model dtype): fp16 and fp32 models whose queries are in the copies' dtype. A bf16 model's keys go to fp16 (11-bit
    mantissa, the other kernels' accuracy) with its queries scaled into fp16's range; `launch_heads(native=True)`
    gives it bf16 keys (8-bit mantissa, the precision of a bf16 cache)."""
    return q_dtype == qr_dtype == copy_dtype and copy_dtype in (torch.float16, torch.float32)


def launch_heads(q, qr, cp, rp, fmt, *args, pages=None, block_t=None, native=None, shape=None):
    """Launch `mla_decode_heads_kernel` through `mla_decode_triton.launch_triton` (its arguments; grid
    `(NS + 1, cdiv(M, 64), B)`); `shape` overrides `launch_shape`, `native` `native_operands` (benchmarks)."""
    tile, warps, stages = shape or launch_shape(fmt)
    if native is None:
        native = native_operands(q.dtype, qr.dtype, args[0].dtype)
    launch_triton(q, qr, cp, rp, fmt, *args, native=native, pages=pages, kernel=mla_decode_heads_kernel,
                  rows_and_shape=(BLOCK_M, (block_t or tile, warps, stages)))
