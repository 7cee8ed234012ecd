"""Fast split-K MLA decode on the packed QuantMLA cache (issue #11), behind the static launch interface.

Same function as `mla_decode.py` (reference: `mla_decode_ref.py`; notes: docs/KERNELS.md "Fast kernel"):

    rows m = (head h, query token t) of `q_lat: [B, H, Tq, d_c]`, `q_rot: [B, H, Tq, d_R]`, flattened to `M = H * Tq`
    score[m, j] = (q_lat[m] . c[j] + q_rot[m] . k_R[j]) * scaling          for every valid cached position j
    o_lat[m] = softmax_j(score[m]) @ c,  lse[m] = logsumexp_j score[m]

What differs from the fallback kernel (details: docs/KERNELS.md "Fast kernel"):

* The queries are loaded once per program (before the token loop), per quantization group, as fp16 operands.
* Each group of a token tile is read as bytes and unpacked into exact fp16 integers `code - z` (fp16 "magic
  number": `code | 0x6400` is the fp16 `1024 + code`; no int-to-float conversion), used for the scores
  `s += (q_g . (code - z)_g) * scale_g` (scale applied after an exact integer dot: the LSE stays within 1e-4 at
  8 bits) and, times its per-token scale (`fp16((code - z) * s)`, one rounding), for that group's values:
  `acc_g = acc_g * alpha + p @ v_g`, eight `[BM, group]` accumulators (for the values the group's bytes are read
  again, an L1 hit, and unpacked again rather than held in registers across the softmax). No per-element
  zero/scale gathers.
* Split boundaries depend on (B, head blocks, device) and the device-side `length` only, never on the capacity
  (`split_plan`): the kernel computes `tokens_per_split` from `length`, so a growing cache and a static one of
  any capacity cut the same positions into the same splits, and the combine (fixed-size chunks, empty splits
  skipped) sums them in the same order: bitwise-identical results. The grid follows the capacity (enough splits
  for its last position); `length` and `left_padding` are read in-kernel, so the launch never synchronises with
  the host and can be captured in a CUDA graph. A split whose range lies past `length` writes an empty partial
  (`lse = -inf`, `o = 0`) that the combine skips.

The Gluon kernels (sm_90) sit behind the same launcher (`backend="gluon"`): `mla_decode_gluon_regs.py` (keys
unpacked into the registers of the score `wgmma`; `regs=True`) is the default at up to 16 query rows for C4R4 and
C2R4 at batch >= 8 and for C8R8 at every batch (`gluon_regs_measured_faster`), its two-warpgroup form
`mla_decode_gluon_wide.py` (32 rows per program; `wide=True`) at 128 or more rows (128 heads) from batch 16
(`gluon_wide_measured_faster`), `mla_decode_gluon_scaled.py` (fp16 `(code - z) * s` tiles, two programs per SM;
`scaled=True`) for the other C4R4 and C2R4 cases (`gluon_scaled_measured_faster`), `mla_decode_gluon.py`
(exact-integer tiles) for the other 8-bit cases (`gluon_measured_faster`). The strided-plane kernel of `mla_decode_strided.py` is a third backend
(`backend="strided"`), measured slower everywhere so far.

`fast_handles` says which cases the kernel computes; `fast_supported` (what the decode op dispatches on) also
requires it to have been measured faster than the fallback (2- and 4-bit content; 8-bit content is correct here
but slower on the H200, docs/BENCHMARKS.md). Plain Triton: the interpreter runs the same code on CPU in the tests.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from quantmla_hf.format import CacheFormat

from . import mla_decode_gluon as gluon_kernel
from . import mla_decode_gluon_regs as regs_kernel
from . import mla_decode_gluon_scaled as scaled_kernel
from . import mla_decode_gluon_wide as wide_kernel
from . import mla_decode_strided as strided_kernel

LOG2E = 1.4426950408889634
COMBINE_CHUNK = 8  # packed splits merged per step of the combine (fixed: the summation order must not follow the grid)
COMBINE_BLOCK_D = 512  # latent columns per combine program


@triton.jit
def _magic_codes(b_byte, BITS: tl.constexpr):
    """`[BT, NB]` uint8 code bytes -> `[BT, NB * 8 // BITS]` fp16 `1024 + code` in element order (exact).

    4 bits: byte i holds element 2i (bits 0-3) and 2i+1 (bits 4-7); 2 bits: elements 4i..4i+3 at bits 0-1, 2-3,
    4-5, 6-7; 8 bits: one element per byte (quantmla_hf/format.py)."""
    BT: tl.constexpr = b_byte.shape[0]
    NB: tl.constexpr = b_byte.shape[1]
    x = b_byte.to(tl.int16)
    if BITS == 4:
        x = tl.reshape(tl.join(x & 15, x >> 4), (BT, NB * 2))
    elif BITS == 2:
        # join stacks on a new last axis: join(join(e0, e2), join(e1, e3))[..., k, j] = e(2k + j): flattened e0 e1 e2 e3
        x = tl.reshape(tl.join(tl.join(x & 3, (x >> 4) & 3), tl.join((x >> 2) & 3, x >> 6)), (BT, NB * 4))
    return (x | 0x6400).to(tl.float16, bitcast=True)


@triton.jit
def _group_tile(p0, p1, p2, s_t, s_mt, o_t, m_t, g: tl.constexpr, GROUP: tl.constexpr, BITS: tl.constexpr):
    """Group `g` of tokens `o_t: [BT]` of one path (row-offset pointers): keys `[BT, GROUP]` fp16 and scales `[BT]`
    fp32. Packed (`BITS` < 16): `p0, p1, p2` = codes, scale, zero planes; the keys are the exact integers
    `code - z` (fp16 magic number: `(code | 0x6400) - (1024 + z)`, no int-to-float conversion). Model-dtype copies
    (`BITS` == 16): `p0` holds the values, converted to fp16, with unit scales. Masked tokens give zero scales (and
    zero keys for copies)."""
    if BITS == 16:
        o_k = tl.arange(0, GROUP)
        b_v = tl.load(p0 + (o_t * s_t)[:, None] + g * GROUP + o_k[None, :], mask=m_t[:, None], other=0.0)
        b_k = b_v.to(tl.float16)
        b_s = tl.where(m_t, 1.0, 0.0)
    else:
        NB: tl.constexpr = GROUP * BITS // 8
        HALF: tl.constexpr = 1 << (BITS - 1)
        o_b = tl.arange(0, NB)
        b_byte = tl.load(p0 + (o_t * s_t)[:, None] + g * NB + o_b[None, :], mask=m_t[:, None], other=0)
        b_s = tl.load(p1 + o_t * s_mt + g, mask=m_t, other=0.0).to(tl.float32)
        b_z = tl.load(p2 + o_t * s_mt + g, mask=m_t, other=0).to(tl.int32)
        z = (b_z + (1024 + HALF)).to(tl.float16)  # 1024 + z, exact
        b_k = _magic_codes(b_byte, BITS) - z[:, None]
    return b_k, b_s


@triton.jit
def _load_query_group(p_q, o_m, m_m, inv_f, g: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr,
                      NG: tl.constexpr):
    """Columns of group `g` of rows `o_m` times the per-row power of two `inv_f`: `(hi, lo)` fp16 `[BM, GROUP]`
    (`lo` the rounding error of `hi`); zeros for a group past the path's `NG` groups (never used)."""
    o_k = tl.arange(0, GROUP)
    m = m_m[:, None] & (g < NG)
    q = tl.load(p_q + o_m[:, None] * D + g * GROUP + o_k[None, :], mask=m, other=0.0).to(tl.float32)
    q = q * inv_f[:, None]
    q_hi = q.to(tl.float16)
    return q_hi, (q - q_hi.to(tl.float32)).to(tl.float16)


@triton.jit
def _row_scale(p_q, o_m, m_m, D: tl.constexpr):
    """Per-row power of two `f = 2**e` (`[BM]`) that keeps `|q| / f` below 2**14 (fp16 query operands neither
    overflow nor lose bf16 bits); returns `(f, 1 / f)`."""
    o_k = tl.arange(0, D)
    q = tl.load(p_q + o_m[:, None] * D + o_k[None, :], mask=m_m[:, None], other=0.0)
    amax = tl.max(tl.abs(q.to(tl.float32)), axis=1)
    e = tl.maximum(tl.ceil(tl.log2(tl.maximum(amax, 1.0) / 16384.0)), 0.0)
    return tl.exp2(e), tl.exp2(-e)


@triton.jit
def _qk(q_hi, q_lo, b_k, Q_SPLIT: tl.constexpr):
    """`[BM, GROUP] x [BT, GROUP]^T -> [BM, BT]` fp32 (fp16 operands; plus the low query part when Q_SPLIT)."""
    k_t = tl.trans(b_k)
    d = tl.dot(q_hi, k_t)
    if Q_SPLIT:
        d += tl.dot(q_lo, k_t)
    return d


@triton.jit
def _tile(c0, c1, c2, r0, r1, r2, s_ct, s_cmt, s_rt, s_rmt, o_t, m_t, m_valid, fc, fr,
          qh0, ql0, qh1, ql1, qh2, ql2, qh3, ql3, qh4, ql4, qh5, ql5, qh6, ql6, qh7, ql7, qrh, qrl,
          m_i, l_i, a0, a1, a2, a3, a4, a5, a6, a7,
          GC: tl.constexpr, GROUP_C: tl.constexpr, C_BITS: tl.constexpr, GROUP_R: tl.constexpr,
          R_BITS: tl.constexpr, Q_SPLIT: tl.constexpr):
    """One token tile: scores `sum_g s_g * (q_g . k_g)` over the content groups plus the RoPE group (keys as exact
    integers), an online-softmax step in base 2, and per group `a_g = a_g * alpha + p @ fp16(k_g * s_g)` (the
    group re-read and re-unpacked, scaled: one fp16 rounding). Queries `qh*/ql*: [BM, GROUP_C]` (content) and
    `qrh/qrl: [BM, GROUP_R]`, accumulators `a*: [BM, GROUP_C]` fp32, `m_valid: [BM, BT]`."""
    k, s = _group_tile(c0, c1, c2, s_ct, s_cmt, o_t, m_t, 0, GROUP_C, C_BITS)
    sc = _qk(qh0, ql0, k, Q_SPLIT) * s[None, :]
    if GC > 1:
        k, s = _group_tile(c0, c1, c2, s_ct, s_cmt, o_t, m_t, 1, GROUP_C, C_BITS)
        sc += _qk(qh1, ql1, k, Q_SPLIT) * s[None, :]
    if GC > 2:
        k, s = _group_tile(c0, c1, c2, s_ct, s_cmt, o_t, m_t, 2, GROUP_C, C_BITS)
        sc += _qk(qh2, ql2, k, Q_SPLIT) * s[None, :]
        k, s = _group_tile(c0, c1, c2, s_ct, s_cmt, o_t, m_t, 3, GROUP_C, C_BITS)
        sc += _qk(qh3, ql3, k, Q_SPLIT) * s[None, :]
    if GC > 4:
        k, s = _group_tile(c0, c1, c2, s_ct, s_cmt, o_t, m_t, 4, GROUP_C, C_BITS)
        sc += _qk(qh4, ql4, k, Q_SPLIT) * s[None, :]
        k, s = _group_tile(c0, c1, c2, s_ct, s_cmt, o_t, m_t, 5, GROUP_C, C_BITS)
        sc += _qk(qh5, ql5, k, Q_SPLIT) * s[None, :]
        k, s = _group_tile(c0, c1, c2, s_ct, s_cmt, o_t, m_t, 6, GROUP_C, C_BITS)
        sc += _qk(qh6, ql6, k, Q_SPLIT) * s[None, :]
        k, s = _group_tile(c0, c1, c2, s_ct, s_cmt, o_t, m_t, 7, GROUP_C, C_BITS)
        sc += _qk(qh7, ql7, k, Q_SPLIT) * s[None, :]
    k, s = _group_tile(r0, r1, r2, s_rt, s_rmt, o_t, m_t, 0, GROUP_R, R_BITS)
    b_s = sc * fc[:, None] + _qk(qrh, qrl, k, Q_SPLIT) * (s[None, :] * fr[:, None])

    b_s = tl.where(m_valid, b_s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(b_s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    b_p = tl.exp2(b_s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(b_p, axis=1)
    p16 = b_p.to(tl.float16)

    # Values: the group tiles again (an L1 hit), scaled per token: fp16((code - z) * s).
    k, s = _group_tile(c0, c1, c2, s_ct, s_cmt, o_t, m_t, 0, GROUP_C, C_BITS)
    a0 = a0 * alpha[:, None] + tl.dot(p16, k * s.to(tl.float16)[:, None])
    if GC > 1:
        k, s = _group_tile(c0, c1, c2, s_ct, s_cmt, o_t, m_t, 1, GROUP_C, C_BITS)
        a1 = a1 * alpha[:, None] + tl.dot(p16, k * s.to(tl.float16)[:, None])
    if GC > 2:
        k, s = _group_tile(c0, c1, c2, s_ct, s_cmt, o_t, m_t, 2, GROUP_C, C_BITS)
        a2 = a2 * alpha[:, None] + tl.dot(p16, k * s.to(tl.float16)[:, None])
        k, s = _group_tile(c0, c1, c2, s_ct, s_cmt, o_t, m_t, 3, GROUP_C, C_BITS)
        a3 = a3 * alpha[:, None] + tl.dot(p16, k * s.to(tl.float16)[:, None])
    if GC > 4:
        k, s = _group_tile(c0, c1, c2, s_ct, s_cmt, o_t, m_t, 4, GROUP_C, C_BITS)
        a4 = a4 * alpha[:, None] + tl.dot(p16, k * s.to(tl.float16)[:, None])
        k, s = _group_tile(c0, c1, c2, s_ct, s_cmt, o_t, m_t, 5, GROUP_C, C_BITS)
        a5 = a5 * alpha[:, None] + tl.dot(p16, k * s.to(tl.float16)[:, None])
        k, s = _group_tile(c0, c1, c2, s_ct, s_cmt, o_t, m_t, 6, GROUP_C, C_BITS)
        a6 = a6 * alpha[:, None] + tl.dot(p16, k * s.to(tl.float16)[:, None])
        k, s = _group_tile(c0, c1, c2, s_ct, s_cmt, o_t, m_t, 7, GROUP_C, C_BITS)
        a7 = a7 * alpha[:, None] + tl.dot(p16, k * s.to(tl.float16)[:, None])
    return m_new, l_i, a0, a1, a2, a3, a4, a5, a6, a7


@triton.jit
def _store_group(o_ptr, o_row, m_m, acc, inv_l, g: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr,
                 GC: tl.constexpr):
    if g < GC:
        o_k = tl.arange(0, GROUP)
        tl.store(o_ptr + o_row[:, None] * D + g * GROUP + o_k[None, :], acc * inv_l[:, None], mask=m_m[:, None])


# Lengths and counts change every decode step: no specialisation on them (the length is read from memory anyway).
@triton.jit(do_not_specialize=["M", "Tq", "split_target", "num_splits"])
def mla_decode_fast_kernel(
    q_ptr, qr_ptr,
    cc_ptr, cs_ptr, cz_ptr, rc_ptr, rs_ptr, rz_ptr,
    snc_ptr, snr_ptr, rcc_ptr, rcr_ptr, lp_ptr, len_ptr,
    o_ptr, lse_ptr,
    M, Tq, split_target, num_splits, qk_scale,
    s_qb, s_qrb, s_ccb, s_cct, s_csb, s_cst, s_rcb, s_rct, s_rsb, s_rst,
    s_sncb, s_snct, s_snrb, s_snrt, s_rccb, s_rcct, s_rcrb, s_rcrt,
    D_C: tl.constexpr, GC: tl.constexpr, GROUP_C: tl.constexpr, C_BITS: tl.constexpr,
    D_R: tl.constexpr, R_BITS: tl.constexpr,
    S: tl.constexpr, R: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr, Q_SPLIT: tl.constexpr,
):
    """One program per (split, head block, batch row): splits `0 .. num_splits-1` take `tokens_per_split` packed
    positions each from `S`, where `tokens_per_split = max(2 * BLOCK_T, round_up(cdiv(length - S - R,
    split_target), BLOCK_T))` comes from the device-side length (`split_plan`: the same boundaries whatever the
    capacity); split `num_splits` takes the sink and recent copies. Writes the normalised partial
    `o: [B, M, num_splits + 1, D_C]` and `lse: [B, M, num_splits + 1]` (natural log, -inf when empty)."""
    i_s = tl.program_id(0).to(tl.int64)
    i_hb = tl.program_id(1).to(tl.int64)
    i_b = tl.program_id(2).to(tl.int64)

    length = tl.load(len_ptr).to(tl.int64)
    lp = tl.load(lp_ptr + i_b).to(tl.int64)
    o_m = (i_hb * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int32)
    m_m = o_m < M
    lim_m = length - Tq + (o_m % Tq) + 1  # query t of Tq sees positions < length - Tq + t + 1

    # Queries, once per program: per-row powers of two, then fp16 high/low parts per group.
    p_q = q_ptr + i_b * s_qb
    p_qr = qr_ptr + i_b * s_qrb
    fc, inv_fc = _row_scale(p_q, o_m, m_m, D_C)
    fr, inv_fr = _row_scale(p_qr, o_m, m_m, D_R)
    fc = fc * qk_scale  # scores in base 2, pre-multiplied by scaling * log2(e)
    fr = fr * qk_scale
    qh0, ql0 = _load_query_group(p_q, o_m, m_m, inv_fc, 0, GROUP_C, D_C, GC)
    qh1, ql1 = _load_query_group(p_q, o_m, m_m, inv_fc, 1, GROUP_C, D_C, GC)
    qh2, ql2 = _load_query_group(p_q, o_m, m_m, inv_fc, 2, GROUP_C, D_C, GC)
    qh3, ql3 = _load_query_group(p_q, o_m, m_m, inv_fc, 3, GROUP_C, D_C, GC)
    qh4, ql4 = _load_query_group(p_q, o_m, m_m, inv_fc, 4, GROUP_C, D_C, GC)
    qh5, ql5 = _load_query_group(p_q, o_m, m_m, inv_fc, 5, GROUP_C, D_C, GC)
    qh6, ql6 = _load_query_group(p_q, o_m, m_m, inv_fc, 6, GROUP_C, D_C, GC)
    qh7, ql7 = _load_query_group(p_q, o_m, m_m, inv_fc, 7, GROUP_C, D_C, GC)
    qrh, qrl = _load_query_group(p_qr, o_m, m_m, inv_fr, 0, D_R, D_R, 1)

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    a0 = tl.zeros((BLOCK_M, GROUP_C), tl.float32)
    a1 = tl.zeros((BLOCK_M, GROUP_C), tl.float32)
    a2 = tl.zeros((BLOCK_M, GROUP_C), tl.float32)
    a3 = tl.zeros((BLOCK_M, GROUP_C), tl.float32)
    a4 = tl.zeros((BLOCK_M, GROUP_C), tl.float32)
    a5 = tl.zeros((BLOCK_M, GROUP_C), tl.float32)
    a6 = tl.zeros((BLOCK_M, GROUP_C), tl.float32)
    a7 = tl.zeros((BLOCK_M, GROUP_C), tl.float32)
    is_dense = i_s == num_splits

    # Packed positions: this split's share of [S, length - R), intersected with [lp + S, ...). Every one of them lies
    # before each causal limit because Tq <= R. The share follows the length, not the capacity (`split_plan`).
    packed_len = tl.maximum(length - R - S, 0)
    tokens_per_split = (packed_len + split_target - 1) // split_target
    tokens_per_split = tl.maximum((tokens_per_split + BLOCK_T - 1) // BLOCK_T * BLOCK_T, 2 * BLOCK_T)
    lo_s = S + i_s * tokens_per_split
    hi_s = tl.where(is_dense, lo_s, tl.minimum(lo_s + tokens_per_split, length - R))
    lo_valid = lp + S
    p_cc = cc_ptr + i_b * s_ccb
    p_cs = cs_ptr + i_b * s_csb
    p_cz = cz_ptr + i_b * s_csb
    p_rc = rc_ptr + i_b * s_rcb
    p_rs = rs_ptr + i_b * s_rsb
    p_rz = rz_ptr + i_b * s_rsb
    o_bt = tl.arange(0, BLOCK_T).to(tl.int64)
    for start in range(lo_s, hi_s, BLOCK_T):
        o_t = start + o_bt
        m_t = (o_t < hi_s) & (o_t >= lo_valid)
        m_i, l_i, a0, a1, a2, a3, a4, a5, a6, a7 = _tile(
            p_cc, p_cs, p_cz, p_rc, p_rs, p_rz, s_cct, s_cst, s_rct, s_rst, o_t, m_t, m_m[:, None] & m_t[None, :],
            fc, fr, qh0, ql0, qh1, ql1, qh2, ql2, qh3, ql3, qh4, ql4, qh5, ql5, qh6, ql6, qh7, ql7, qrh, qrl,
            m_i, l_i, a0, a1, a2, a3, a4, a5, a6, a7, GC, GROUP_C, C_BITS, D_R, R_BITS, Q_SPLIT)

    # The last split takes the model-dtype copies: the sink (slot j = position lp + j) and the recent ring
    # (positions [length - R, length) past the sink, slot p % R), causal per query row.
    n_sink = tl.where(is_dense, S, 0)
    p_snc = snc_ptr + i_b * s_sncb
    p_snr = snr_ptr + i_b * s_snrb
    for start in range(0, n_sink, BLOCK_T):
        o_j = start + o_bt
        o_t = lp + o_j
        m_t = (o_j < S) & (o_t < length)
        m_valid = m_m[:, None] & m_t[None, :] & (o_t[None, :] < lim_m[:, None])
        m_i, l_i, a0, a1, a2, a3, a4, a5, a6, a7 = _tile(
            p_snc, p_snc, p_snc, p_snr, p_snr, p_snr, s_snct, s_snct, s_snrt, s_snrt, o_j, m_t, m_valid,
            fc, fr, qh0, ql0, qh1, ql1, qh2, ql2, qh3, ql3, qh4, ql4, qh5, ql5, qh6, ql6, qh7, ql7, qrh, qrl,
            m_i, l_i, a0, a1, a2, a3, a4, a5, a6, a7, GC, GROUP_C, 16, D_R, 16, Q_SPLIT)
    r_lo = tl.maximum(length - R, 0)
    r_hi = tl.where(is_dense, length, r_lo)
    p_rcc = rcc_ptr + i_b * s_rccb
    p_rcr = rcr_ptr + i_b * s_rcrb
    for start in range(r_lo, r_hi, BLOCK_T):
        o_t = start + o_bt
        m_t = (o_t < r_hi) & (o_t >= lo_valid)
        m_valid = m_m[:, None] & m_t[None, :] & (o_t[None, :] < lim_m[:, None])
        m_i, l_i, a0, a1, a2, a3, a4, a5, a6, a7 = _tile(
            p_rcc, p_rcc, p_rcc, p_rcr, p_rcr, p_rcr, s_rcct, s_rcct, s_rcrt, s_rcrt, o_t % R, m_t, m_valid,
            fc, fr, qh0, ql0, qh1, ql1, qh2, ql2, qh3, ql3, qh4, ql4, qh5, ql5, qh6, ql6, qh7, ql7, qrh, qrl,
            m_i, l_i, a0, a1, a2, a3, a4, a5, a6, a7, GC, GROUP_C, 16, D_R, 16, Q_SPLIT)

    # Partial results: o normalised by this split's sum, lse in natural log (-inf for an empty split).
    has = l_i > 0
    inv_l = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
    b_lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    o_row = (i_b * M + o_m) * (num_splits + 1) + i_s  # [BM] index of (b, m, split)
    _store_group(o_ptr, o_row, m_m, a0, inv_l, 0, GROUP_C, D_C, GC)
    _store_group(o_ptr, o_row, m_m, a1, inv_l, 1, GROUP_C, D_C, GC)
    _store_group(o_ptr, o_row, m_m, a2, inv_l, 2, GROUP_C, D_C, GC)
    _store_group(o_ptr, o_row, m_m, a3, inv_l, 3, GROUP_C, D_C, GC)
    _store_group(o_ptr, o_row, m_m, a4, inv_l, 4, GROUP_C, D_C, GC)
    _store_group(o_ptr, o_row, m_m, a5, inv_l, 5, GROUP_C, D_C, GC)
    _store_group(o_ptr, o_row, m_m, a6, inv_l, 6, GROUP_C, D_C, GC)
    _store_group(o_ptr, o_row, m_m, a7, inv_l, 7, GROUP_C, D_C, GC)
    tl.store(lse_ptr + o_row, b_lse, mask=m_m)


@triton.jit(do_not_specialize=["NSP"])
def mla_decode_fast_combine_kernel(o_part_ptr, lse_part_ptr, o_ptr, lse_ptr, NSP, D_C: tl.constexpr,
                                   BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, N_TAIL: tl.constexpr = 1):
    """Log-sum-exp merge of the splits of one (batch row, query row) and block of d_c columns; a row with no
    visible position gives zeros and lse -inf.

    The packed splits `0 .. NSP-N_TAIL-1` are summed in chunks of a fixed `BLOCK_S` (one chunk sum after the
    other), their partials read only where non-empty, then the `N_TAIL` sink/recent slots at the end, one by one
    in order (1 for the kernels with one copy split; the scaled Gluon kernel spreads the copies over 3): a launch
    with more (trailing, empty) packed splits adds exact zeros, so the result depends on the non-empty partials
    only, not on `NSP`."""
    i_bm = tl.program_id(0).to(tl.int64)
    i_d = tl.program_id(1).to(tl.int64)
    n_packed = NSP - N_TAIL
    p_lse = lse_part_ptr + i_bm * NSP
    o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D)
    m_d = o_d < D_C
    m = tl.load(p_lse + n_packed)
    for j in tl.static_range(1, N_TAIL):
        m = tl.maximum(m, tl.load(p_lse + n_packed + j))
    for s0 in range(0, n_packed, BLOCK_S):
        o_s = s0 + tl.arange(0, BLOCK_S)
        m = tl.maximum(m, tl.max(tl.load(p_lse + o_s, mask=o_s < n_packed, other=float("-inf")), axis=0))
    m_use = tl.where(m == float("-inf"), 0.0, m)
    total = tl.zeros((1,), tl.float32)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for s0 in range(0, n_packed, BLOCK_S):
        o_s = s0 + tl.arange(0, BLOCK_S)
        b_lse = tl.load(p_lse + o_s, mask=o_s < n_packed, other=float("-inf"))
        has = b_lse > float("-inf")
        w = tl.where(has, tl.exp(b_lse - m_use), 0.0)
        b_o = tl.load(o_part_ptr + (i_bm * NSP + o_s[:, None]) * D_C + o_d[None, :], mask=has[:, None] & m_d[None, :],
                      other=0.0)
        total += tl.sum(w, axis=0)
        acc += tl.sum(b_o * w[:, None], axis=0)
    for j in tl.static_range(N_TAIL):
        lse_dense = tl.load(p_lse + n_packed + j)
        w_d = tl.where(lse_dense > float("-inf"), tl.exp(lse_dense - m_use), 0.0)
        m_od = m_d & (lse_dense + tl.zeros((BLOCK_D,), tl.float32) > float("-inf"))  # read only if non-empty
        b_od = tl.load(o_part_ptr + (i_bm * NSP + n_packed + j) * D_C + o_d, mask=m_od, other=0.0)
        total += w_d
        acc += b_od * w_d
    tot = tl.sum(total, axis=0)
    out = acc / tl.where(tot > 0, tot, 1.0)
    tl.store(o_ptr + i_bm * D_C + o_d, out, mask=m_d)
    if i_d == 0:
        tl.store(lse_ptr + i_bm, tl.where(tot > 0, m_use + tl.log(tot), float("-inf")))


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def fast_handles(fmt: CacheFormat, q_dtype: torch.dtype, device, copy_dtype: torch.dtype | None = None) -> bool:
    """Whether `mla_decode_static` can compute this case: both paths packed at 2, 4 or 8 bits, power-of-two widths,
    at most 8 content groups and one RoPE group, groups of at least 16 elements, queries in bf16/fp16/fp32,
    model-dtype copies (`copy_dtype`, when given) in bf16/fp16, and a CUDA device of compute capability >= 8 (the
    Triton interpreter also runs it, on CPU, for tests)."""
    for p in (fmt.content, fmt.rope):
        if not p.quantized or p.bits not in (2, 4, 8):
            return False
        if not (_pow2(p.dim) and _pow2(p.group) and p.group >= 16 and _pow2(p.n_groups)):
            return False
    if fmt.content.n_groups > 8 or fmt.rope.n_groups != 1:
        return False
    if q_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    if copy_dtype is not None and copy_dtype not in (torch.bfloat16, torch.float16):
        return False
    device = torch.device(device)
    if device.type == "cuda":
        return _interpreting() or torch.cuda.get_device_capability(device)[0] >= 8
    return device.type == "cpu" and _interpreting()


def fast_supported(fmt: CacheFormat, q_dtype: torch.dtype, device, copy_dtype: torch.dtype | None = None) -> bool:
    """Whether to dispatch to `mla_decode_static` (else `mla_decode.py`): it handles the case (`fast_handles`) AND
    was measured faster than the fallback there. 2- and 4-bit content: the Triton fast kernel (or the Gluon one,
    `use_gluon`). 8-bit content: only where the Gluon kernel runs (sm_90), measured faster than the fallback; the
    Triton fast kernel is correct at 8 bits but slower than the fallback (16 heads, B32, 32K: 1.30 vs 1.00 ms)."""
    if not fast_handles(fmt, q_dtype, device, copy_dtype):
        return False
    if fmt.content.bits in (2, 4):
        return True
    return (fmt.content.bits == 8 and gluon_measured_faster(8, fmt.rope.bits, 1) and not _interpreting()
            and gluon_kernel.gluon_handles(fmt, q_dtype, device, copy_dtype))


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_launch(B: int, M: int, capacity: int, fmt: CacheFormat, device) -> dict:
    """Launch from static sizes only (the winners of the H200 sweep, docs/BENCHMARKS.md "Fast kernel"): up to 32
    rows: 16-row blocks (each token tile unpacked once per 16 rows), 32-token tiles, 4 warps, 1 stage (the
    fastest of 1-3 at every content width measured); more rows (128 heads, several query tokens): 32-row blocks,
    4 warps, 2 stages. Splits for about 8 programs per multiprocessor."""
    if M > 32:
        return dict(block_m=32, block_t=32, num_warps=4, num_stages=2, waves=8)
    return dict(block_m=16, block_t=32, num_warps=4, num_stages=1, waves=8)


def split_plan(B: int, head_blocks: int, capacity: int, first: int, fmt: CacheFormat, sms: int, block_t: int,
               waves: float, num_splits: int | None = None) -> tuple[int, int]:
    """Packed-position splits as `(split_target, grid_splits)`.

    `split_target` fixes the split boundaries and depends on static sizes other than the capacity: about `waves *
    sms` programs in all, `cdiv(waves * sms, B * head_blocks)` splits per (row, head block) (or `num_splits` when
    given). The kernels cut the packed positions the device-side length holds, `n = length - R - first` (`first`:
    where the splits start, `S` for the Triton kernel, 0 for the tile-aligned Gluon kernel), into
    `tokens_per_split = max(2 * block_t, round_up(cdiv(n, split_target), block_t))` each: the same boundaries for
    a growing cache and a static one, whatever their capacities. At most `min(split_target, cdiv(n, 2 * block_t))`
    splits hold positions, so `grid_splits`, that bound at the capacity, is enough for every length the planes can
    hold; the splits past the data write empty partials that the combine skips (its sum does not depend on the
    grid)."""
    target = num_splits or -(-int(waves * sms) // max(1, B * head_blocks))
    target = max(1, int(target))
    n_cap = max(0, capacity - fmt.recent_tokens - first)
    return target, max(1, min(target, -(-n_cap // (2 * block_t))))


def mla_decode_static(
    q_lat: torch.Tensor,
    q_rot: torch.Tensor,
    content_planes: dict[str, torch.Tensor],
    rope_planes: dict[str, torch.Tensor],
    fmt: CacheFormat,
    sink_c: torch.Tensor,
    sink_r: torch.Tensor,
    recent_c: torch.Tensor,
    recent_r: torch.Tensor,
    left_padding: torch.Tensor,
    length: torch.Tensor,
    capacity: int,
    scaling: float,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    **launch,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed attention of `Tq` query tokens over the first `length` positions of a packed cache layer, with no
    host synchronisation and a grid fixed by static sizes (the agreed interface, /work/notes/decode_interface.md).

    Args:
        q_lat: `[B, H, Tq, d_c]` queries with W_UK absorbed (bf16, fp16 or fp32).
        q_rot: `[B, H, Tq, d_R]` post-RoPE queries, rotated like the stored keys.
        content_planes, rope_planes: `codes/scale/zero` planes `[B, capacity, .]` of the two paths.
        fmt: the cache format (must pass `fast_supported`).
        sink_c, sink_r: `[B, S, d]` model-dtype copies of the first S real tokens of each row.
        recent_c, recent_r: `[B, R, d]` model-dtype ring of the last R positions (slot `p % R`).
        left_padding: `[B]` int64 on the device.
        length: int64 tensor of shape `[1]` on the device: positions cached (the Tq queries are the last Tq).
        capacity: static number of positions the planes hold; fixes the grid (not the split boundaries, which
            follow `length`: `split_plan`).
        scaling: softmax scale.
        out: optional preallocated `(o_lat [B, H, Tq, d_c] fp32, lse [B, H, Tq] fp32)`.
        launch: `block_m, block_t, num_warps, num_stages, waves, num_splits` (the split target of `split_plan`)
            overrides (benchmarks), and
            `backend`: "triton" (this module's kernel), "gluon" (`mla_decode_gluon.py`, sm_90; its launch keys are
            `block_m, num_warps, stages, waves, num_splits, async_mma, scaled, regs, wide, inflight, store_a,
            vote, overlap, row_ptrs`: `regs` picks the register-operand kernel of `mla_decode_gluon_regs.py` (keys
            `waves, num_splits, inflight, store_a, vote, overlap, row_ptrs`; without `waves` or `num_splits` the
            splits are `fill_splits`), `wide` its two-warpgroup form of `mla_decode_gluon_wide.py` (keys `block_m` 32 or 64,
            `waves, num_splits, inflight, launch_regs, worker_regs, store_a, vote`), `scaled` the scaled-tile kernel of
            `mla_decode_gluon_scaled.py`) or "strided" (`mla_decode_strided.py`; keys `block_m, block_t,
            num_warps, num_stages, waves, num_splits`); default `default_backend(...)`.

    Returns:
        `o_lat: [B, H, Tq, d_c]` fp32 and `lse: [B, H, Tq]` fp32 (natural log; zeros and -inf for a row with no
        visible position).
    """
    if q_lat.dim() != 4 or q_rot.dim() != 4 or q_lat.shape[:3] != q_rot.shape[:3]:
        raise ValueError(f"q_lat and q_rot must be [B, H, Tq, d], got {tuple(q_lat.shape)} and {tuple(q_rot.shape)}")
    B, H, Tq, D_C = q_lat.shape
    D_R = q_rot.shape[-1]
    if D_C != fmt.content.dim or D_R != fmt.rope.dim:
        raise ValueError(f"query widths ({D_C}, {D_R}) do not match the cache format ({fmt.content.dim}, {fmt.rope.dim})")
    if not fast_handles(fmt, q_lat.dtype, q_lat.device, sink_c.dtype):
        raise ValueError(
            f"the fast decode kernel does not handle {fmt.name} (content {fmt.content}, rope {fmt.rope}) with "
            f"{q_lat.dtype} queries and {sink_c.dtype} copies on {q_lat.device}: check fast_supported() first and use "
            "kernels/mla_decode.py otherwise"
        )
    if Tq > fmt.recent_tokens:
        raise ValueError(f"{Tq} query tokens need a recent window of at least {Tq} tokens "
                         f"(recent_tokens={fmt.recent_tokens}); longer chunks go through the prefill path")
    if length.numel() != 1 or length.device != q_lat.device:
        raise ValueError(f"length must be a one-element tensor on {q_lat.device}, got shape {tuple(length.shape)} "
                         f"on {length.device}")
    for name, planes in (("content", content_planes), ("rope", rope_planes)):
        for key in ("codes", "scale", "zero"):
            if key not in planes:
                raise ValueError(f"{name} planes need 'codes', 'scale' and 'zero', got {sorted(planes)}")
            plane = planes[key]
            if plane.shape[0] != B or plane.shape[1] < capacity or plane.stride(-1) != 1:
                raise ValueError(f"{name} plane {key!r} must be [B={B}, capacity >= {capacity}, .] with a contiguous "
                                 f"last dimension, got shape {tuple(plane.shape)} strides {plane.stride()}")
        if planes["scale"].stride() != planes["zero"].stride():
            raise ValueError(f"{name} scale and zero planes must share strides, got {planes['scale'].stride()} and "
                             f"{planes['zero'].stride()}")
    for name, t, n in (("sink_c", sink_c, fmt.sink_tokens), ("sink_r", sink_r, fmt.sink_tokens),
                       ("recent_c", recent_c, fmt.recent_tokens), ("recent_r", recent_r, fmt.recent_tokens)):
        if t.shape[0] != B or t.shape[1] < n or t.stride(-1) != 1:
            raise ValueError(f"{name} must be [B={B}, {n}, d] with a contiguous last dimension, got {tuple(t.shape)}")

    M = H * Tq
    backend = launch.pop("backend", None) or default_backend(fmt, q_lat, content_planes, rope_planes, sink_c)
    if backend == "gluon":
        return _gluon_static(q_lat, q_rot, content_planes, rope_planes, fmt, sink_c, sink_r, recent_c, recent_r,
                             left_padding, length, capacity, scaling, out, **launch)
    if backend == "strided":
        return _strided_static(q_lat, q_rot, content_planes, rope_planes, fmt, sink_c, sink_r, recent_c, recent_r,
                               left_padding, length, capacity, scaling, out, **launch)
    cfg = default_launch(B, M, capacity, fmt, q_lat.device)
    cfg.update({k: v for k, v in launch.items() if v is not None})
    BLOCK_M, BLOCK_T = int(cfg["block_m"]), int(cfg["block_t"])
    head_blocks = triton.cdiv(M, BLOCK_M)
    sms = _num_sms(q_lat.device.index or 0) if q_lat.is_cuda and not _interpreting() else 8
    target, NS = split_plan(B, head_blocks, capacity, fmt.sink_tokens, fmt, sms, BLOCK_T, cfg["waves"],
                            cfg.get("num_splits"))
    NSP = NS + 1

    q = q_lat.reshape(B, M, D_C).contiguous()
    qr = q_rot.reshape(B, M, D_R).contiguous()
    dev = q.device
    o_part = torch.empty((B, M, NSP, D_C), dtype=torch.float32, device=dev)
    lse_part = torch.empty((B, M, NSP), dtype=torch.float32, device=dev)
    cp, rp = content_planes, rope_planes
    lp = left_padding if left_padding.dtype == torch.int64 else left_padding.to(torch.int64)
    q_split = q_lat.dtype == torch.float32 or q_rot.dtype == torch.float32
    mla_decode_fast_kernel[(NSP, head_blocks, B)](
        q, qr, cp["codes"], cp["scale"], cp["zero"], rp["codes"], rp["scale"], rp["zero"],
        sink_c, sink_r, recent_c, recent_r, lp, length, o_part, lse_part,
        M, Tq, target, NS, scaling * LOG2E,
        q.stride(0), qr.stride(0), cp["codes"].stride(0), cp["codes"].stride(1), cp["scale"].stride(0),
        cp["scale"].stride(1), rp["codes"].stride(0), rp["codes"].stride(1), rp["scale"].stride(0),
        rp["scale"].stride(1),
        sink_c.stride(0), sink_c.stride(1), sink_r.stride(0), sink_r.stride(1),
        recent_c.stride(0), recent_c.stride(1), recent_r.stride(0), recent_r.stride(1),
        D_C=D_C, GC=fmt.content.n_groups, GROUP_C=fmt.content.group, C_BITS=fmt.content.bits,
        D_R=D_R, R_BITS=fmt.rope.bits, S=fmt.sink_tokens, R=fmt.recent_tokens, BLOCK_M=BLOCK_M, BLOCK_T=BLOCK_T,
        Q_SPLIT=q_split, num_warps=int(cfg["num_warps"]), num_stages=int(cfg["num_stages"]),
    )
    return _combine(o_part, lse_part, B, H, Tq, D_C, NSP, out)


def _combine(o_part, lse_part, B, H, Tq, D_C, NSP, out, n_tail=1):
    """Merge the split partials `[B, M, NSP, d_c]`, `[B, M, NSP]` (the last `n_tail` slots: the sink/recent
    copies) into `(o [B, H, Tq, d_c], lse [B, H, Tq])`."""
    dev, M = o_part.device, H * Tq
    if out is None:
        o = torch.empty((B, H, Tq, D_C), dtype=torch.float32, device=dev)
        lse = torch.empty((B, H, Tq), dtype=torch.float32, device=dev)
    else:
        o, lse = out
        if o.shape != (B, H, Tq, D_C) or lse.shape != (B, H, Tq) or not (o.is_contiguous() and lse.is_contiguous()):
            raise ValueError(f"out must be contiguous ([B, H, Tq, d_c], [B, H, Tq]) = ({(B, H, Tq, D_C)}, "
                             f"{(B, H, Tq)}), got {tuple(o.shape)} and {tuple(lse.shape)}")
    BLOCK_D = min(triton.next_power_of_2(D_C), COMBINE_BLOCK_D)
    # BLOCK_S is fixed (not derived from NSP): the chunks, hence the summation order, are the same for any grid.
    mla_decode_fast_combine_kernel[(B * M, triton.cdiv(D_C, BLOCK_D))](
        o_part, lse_part, o, lse, NSP, D_C=D_C, BLOCK_S=COMBINE_CHUNK, BLOCK_D=BLOCK_D, N_TAIL=n_tail,
    )
    return o, lse


def gluon_measured_faster(content_bits: int, rope_bits: int, rows: int, batch: int | None = None) -> bool:
    """Whether the Gluon kernel was measured faster than the alternative for this format, number of query rows per
    batch row (`rows = H * Tq`) and batch size, on the H200 in one run (docs/BENCHMARKS.md "Gluon kernel" and
    "Gluon launch sweep", do_bench medians, same process):

    - C8R8 (the alternatives are the fallback and the strided-plane kernel): 16 heads B32 32K 0.647 vs 0.988 and
      0.694 ms, B8 128K 0.643 vs 0.992 and 0.691 ms; 128 heads B32 32K 2.86 vs 4.84 ms: Gluon everywhere measured.
    - C4R4 (the alternative is the Triton fast kernel): 128 heads B32 32K 2.64 vs 3.90 ms; 16 heads (32-token-wide
      launch sweep winner: 8 programs per SM, `async_mma`) B32 32K 0.581 vs 0.589 ms and B8 128K 0.578 vs 0.591 ms.
      Elsewhere the Triton fast kernel stays: at batch 1 (or an unknown batch) its CUDA-graph replay was timed
      (0.040 ms at 4K) and the Gluon one was not; at B64 32K only the earlier Gluon launch was timed (1.254 vs
      1.214 ms, slower).
    - C2R4: 128 heads 2.57 vs 3.95 ms (Gluon); 16 heads B32 32K 0.598 vs 0.569 ms (Triton fast).
    """
    if (content_bits, rope_bits) == (8, 8):
        return True
    if (content_bits, rope_bits) == (4, 4):
        return rows > 16 or (batch is not None and 8 <= batch <= 32)
    if (content_bits, rope_bits) == (2, 4):
        return rows > 16
    return False


def gluon_scaled_measured_faster(content_bits: int, rope_bits: int, rows: int, batch: int | None = None) -> bool:
    """Whether the scaled-tile Gluon kernel (`mla_decode_gluon_scaled.py`) was measured faster than every other
    kernel for this format, number of query rows (`H * Tq`) and batch size (H200, same process, do_bench medians;
    docs/BENCHMARKS.md "Gluon kernel on scaled tiles"):

    - C4R4, 16 heads: B32 32K 0.320 ms (exact Gluon 0.590, Triton fast 0.593), B8 128K 0.307 (0.582, 0.595), B64
      32K 0.692 (1.162, 1.229); B1 4K replayed from a CUDA graph 0.0201 ms (Triton fast 0.0395); 128 heads B32 32K
      1.486 (exact Gluon 2.654).
    - C2R4, 16 heads: B32 32K 0.330 ms (Triton fast 0.569), B8 128K 0.321, B64 32K 0.683; 128 heads 1.505.
      C2R4 at batch < 8 was not timed on its own: the Triton fast kernel stays there."""
    if (content_bits, rope_bits) == (4, 4):
        return True
    if (content_bits, rope_bits) == (2, 4):
        return rows > 16 or (batch is not None and batch >= 8)
    return False


def gluon_regs_measured_faster(content_bits: int, rope_bits: int, rows: int, batch: int | None = None) -> bool:
    """Whether the register-operand Gluon kernel (`mla_decode_gluon_regs.py`, 16-row blocks) was measured faster
    than every other kernel for this format, number of query rows (`H * Tq`) and batch size (H200, same process,
    CUDA-graph replay, do_bench medians; docs/BENCHMARKS.md "Gluon kernel with register operands" and "Unit-pair
    loads"):

    - C4R4, 16 heads: B32 32K 0.266-0.267 ms (scaled-tile kernel 0.321), B8 128K 0.254-0.255 (0.306), B64 32K
      0.493-0.494 (0.639).
    - C2R4, 16 heads: B32 32K 0.270, B8 128K 0.256, B64 32K 0.492 (scaled 0.333 / 0.323 / 0.652 last session).
    - C8R8, 16 heads: B32 32K 0.460 (exact-integer Gluon kernel 0.649), B8 128K 0.450 (0.640), B64 32K 0.929
      (1.269), and batch 1, 4K 0.0251 against the exact kernel's 0.0301: the default at every batch (batches 2-7
      not timed; faster at both ends).
    - C4R4 and C2R4 at batch 1, 4K: a tie with the scaled kernel (0.0219 against 0.0214 today; 0.0219-0.0223
      against 0.0212-0.0223 last session), which stays the default below batch 8 (batches 2-7 not timed).
    - Above 16 rows (128 heads: 1.75 ms against the scaled kernel's 1.48, each token unpacked once per 16 heads)
      the scaled kernel stays."""
    if rows > 16:
        return False
    if (content_bits, rope_bits) == (8, 8):
        return True
    if batch is None or batch < 8:
        return False
    return (content_bits, rope_bits) in ((4, 4), (2, 4))


def gluon_wide_measured_faster(content_bits: int, rope_bits: int, rows: int, batch: int | None = None) -> bool:
    """Whether the two-warpgroup register kernel (`mla_decode_gluon_wide.py`, 32-row blocks) was measured faster
    than the scaled-tile kernel for this format, number of query rows (`H * Tq`) and batch size (H200, same process,
    CUDA-graph replay, do_bench medians; docs/BENCHMARKS.md "Two-warpgroup register kernel for many heads"):

    - 128 heads, C4R4: B16 32K 0.785 ms (scaled-tile kernel 0.824), B32 32K 1.349 (1.499), B64 32K 2.629 (2.685);
      C2R4 0.795 (0.839), 1.367 (1.515), 2.675 (2.711).
    - 128 heads, B8 32K: 0.417-0.447 against 0.409-0.411 (C4R4): the scaled kernel stays below batch 16 (batches
      9-15 not timed).
    - Up to 32 rows (16 heads) the one-warpgroup register kernel stays (16 heads B32 32K: 0.401 ms with 32-row
      blocks against 0.263); between 33 and 127 rows nothing was timed, so the scaled kernel stays there."""
    if rows < 128 or batch is None or batch < 16:
        return False
    return (content_bits, rope_bits) in ((4, 4), (2, 4))


def strided_measured_faster(content_bits: int, rope_bits: int, rows: int) -> bool:
    """Whether the strided-plane kernel (`mla_decode_strided.py`) was measured faster than every other kernel for
    this format and number of query rows: nowhere so far (docs/BENCHMARKS.md "Strided-plane kernel", same process,
    16 heads B32 32K: C8R8 0.694 ms against Gluon's 0.647, C4R4 0.81 against the Triton fast kernel's 0.59, C2R4
    3.8-7.8 against 0.57; 128 heads C4R4 8.4 against Gluon's 2.6). It stays selectable (`backend="strided"`) as the
    measured alternative; this gate is where a faster version would be switched on."""
    return False


def default_backend(fmt: CacheFormat, q_lat: torch.Tensor, content_planes: dict, rope_planes: dict,
                    sink_c: torch.Tensor) -> str:
    """The kernel `mla_decode_static` runs by default: the one measured fastest for this format and number of query
    rows (`strided_measured_faster`, `gluon_measured_faster`) among those that handle the case on this device;
    the Triton fast kernel otherwise."""
    rows = q_lat.shape[1] * q_lat.shape[2]
    if (not _interpreting() and q_lat.is_cuda and strided_measured_faster(fmt.content.bits, fmt.rope.bits, rows)
            and strided_kernel.strided_handles(fmt, q_lat.dtype, q_lat.device, sink_c.dtype)):
        return "strided"
    return "gluon" if use_gluon(fmt, q_lat, content_planes, rope_planes, sink_c) else "triton"


def use_gluon(fmt: CacheFormat, q_lat: torch.Tensor, content_planes: dict, rope_planes: dict,
              sink_c: torch.Tensor) -> bool:
    """Default backend of `mla_decode_static`: a Gluon kernel where it handles the case on this device, the planes
    are laid out contiguously, and it was measured faster: the scaled-tile one (`gluon_scaled_measured_faster`,
    `_gluon_static` picks it by the same rule) or the exact one (`gluon_measured_faster`)."""
    rows = q_lat.shape[1] * q_lat.shape[2]
    cb, rb, batch = fmt.content.bits, fmt.rope.bits, q_lat.shape[0]
    if _interpreting() or not q_lat.is_cuda:
        return False
    if (gluon_regs_measured_faster(cb, rb, rows, batch)
            and regs_kernel.regs_handles(fmt, q_lat.dtype, q_lat.device, sink_c.dtype)
            and gluon_kernel.planes_contiguous(fmt, content_planes, rope_planes)):
        return True
    if (gluon_scaled_measured_faster(cb, rb, rows, batch)
            and scaled_kernel.scaled_handles(fmt, q_lat.dtype, q_lat.device, sink_c.dtype)
            and gluon_kernel.planes_contiguous(fmt, content_planes, rope_planes)):
        return True
    if not gluon_measured_faster(cb, rb, rows, batch):
        return False
    return (gluon_kernel.gluon_handles(fmt, q_lat.dtype, q_lat.device, sink_c.dtype)
            and gluon_kernel.planes_contiguous(fmt, content_planes, rope_planes))


def gluon_default_launch(M: int, scaled: bool = False) -> dict:
    """Launch of the Gluon kernel from static sizes.

    Exact-integer tiles (`mla_decode_gluon.py`): up to 16 rows 16-row blocks, one warpgroup, 3 cp.async stages
    (~166 KB of shared memory, one program per SM), splits for about 8 programs per multiprocessor and the
    `async_mma` issue order (H200 sweep, 16 heads B32 32K: 0.581 ms against 0.700 with 4 programs per SM and a
    `wgmma` wait per group; docs/BENCHMARKS.md "Gluon launch sweep"); more rows (128 heads, several query tokens)
    32-row blocks over two warpgroups (4 warps spill 1.4 KB there, 8 warps 36 B), 2 stages (~182 KB), about 4
    programs per multiprocessor (2, 4 and 8 measured within 1%).

    Scaled tiles (`mla_decode_gluon_scaled.py`, `scaled=True`; H200 sweep, docs/BENCHMARKS.md "Gluon kernel on
    scaled tiles"): up to 16 rows 16-row blocks, one warpgroup, one cp.async slot (~113 KB: two programs per SM),
    about 8 programs per SM (16 heads B32 32K: 0.343 ms; 4 and 16 programs per SM 0.413 and 0.379, two stages with
    one program per SM 0.465, two warpgroups 0.47-0.56); more than 32 rows (128 heads): 64-row blocks over two
    warpgroups, about 4 programs per SM (1.540 ms against 2.20 with 32-row blocks and 2.38 with 16); 17 to 32
    rows: 32-row blocks over two warpgroups (not timed at that row count)."""
    if scaled:
        if M > 32:
            return dict(block_m=64, num_warps=8, stages=1, waves=4, scaled=True)
        if M > 16:
            return dict(block_m=32, num_warps=8, stages=1, waves=4, scaled=True)
        return dict(block_m=16, num_warps=4, stages=1, waves=8, scaled=True)
    if M > 16:
        return dict(block_m=32, num_warps=8, stages=2, waves=4)
    return dict(block_m=16, num_warps=4, stages=3, waves=8, async_mma=True)


def _gluon_static(q_lat, q_rot, content_planes, rope_planes, fmt, sink_c, sink_r, recent_c, recent_r, left_padding,
                  length, capacity, scaling, out, **launch):
    """`mla_decode_static` through a Gluon kernel (same partials and combine as the Triton fast kernel): the
    scaled-tile kernel when `launch["scaled"]` says so (default: `gluon_scaled_measured_faster`), the exact one
    otherwise."""
    B, H, Tq, D_C = q_lat.shape
    D_R = q_rot.shape[-1]
    M = H * Tq
    if not gluon_kernel.gluon_handles(fmt, q_lat.dtype, q_lat.device, sink_c.dtype):
        raise ValueError(f"the Gluon decode kernel does not handle {fmt.name} with {q_lat.dtype} queries on "
                         f"{q_lat.device} (needs sm_90, groups of 64, one RoPE group): use backend='triton'")
    if not gluon_kernel.planes_contiguous(fmt, content_planes, rope_planes):
        raise ValueError("the Gluon decode kernel needs plane rows laid out contiguously (docs/CACHE_FORMAT.md): "
                         "use backend='triton' for strided planes")
    wide = launch.get("wide")
    if wide is None:
        wide = (launch.get("scaled") is None and launch.get("regs") is None
                and gluon_wide_measured_faster(fmt.content.bits, fmt.rope.bits, M, B)
                and wide_kernel.wide_handles(fmt, q_lat.dtype, q_lat.device, sink_c.dtype))
    if wide:
        return _gluon_wide_static(q_lat, q_rot, content_planes, rope_planes, fmt, sink_c, sink_r, recent_c, recent_r,
                                  left_padding, length, capacity, scaling, out, **launch)
    regs = launch.get("regs")
    if regs is None:
        regs = (launch.get("scaled") is None and gluon_regs_measured_faster(fmt.content.bits, fmt.rope.bits, M, B)
                and regs_kernel.regs_handles(fmt, q_lat.dtype, q_lat.device, sink_c.dtype))
    if regs:
        return _gluon_regs_static(q_lat, q_rot, content_planes, rope_planes, fmt, sink_c, sink_r, recent_c, recent_r,
                                  left_padding, length, capacity, scaling, out, **launch)
    scaled = launch.get("scaled")
    if scaled is None:
        scaled = (gluon_scaled_measured_faster(fmt.content.bits, fmt.rope.bits, M, B)
                  and scaled_kernel.scaled_handles(fmt, q_lat.dtype, q_lat.device, sink_c.dtype))
    scaled = bool(scaled)
    if scaled and not scaled_kernel.scaled_handles(fmt, q_lat.dtype, q_lat.device, sink_c.dtype):
        raise ValueError(f"the scaled-tile Gluon kernel does not handle {fmt.name} (2- or 4-bit content and RoPE, "
                         "4 or 8 content groups): pass scaled=False for the exact-integer Gluon kernel")
    cfg = gluon_default_launch(M, scaled)
    cfg.update({k: v for k, v in launch.items() if v is not None and k not in ("scaled", "regs", "wide")})
    block_m = int(cfg["block_m"])
    q_split = q_lat.dtype == torch.float32 or q_rot.dtype == torch.float32
    if scaled and "block_m" not in launch:
        # fp32 queries stage a high and a low part: 64-row blocks would not fit shared memory, halve them
        while block_m > 16 and scaled_kernel.smem_bytes(fmt, block_m, int(cfg["stages"]), q_split) > \
                scaled_kernel.SMEM_LIMIT:
            block_m //= 2
        if block_m == 16:
            cfg["num_warps"] = 4
    head_blocks = triton.cdiv(M, block_m)
    sms = _num_sms(q_lat.device.index or 0)
    # splits cover positions [0, length - R), tile-aligned from 0; the kernel sizes them from the length
    target, NS = split_plan(B, head_blocks, capacity, 0, fmt, sms, gluon_kernel.BLOCK_T, cfg["waves"],
                            cfg.get("num_splits"))
    NSP = NS + (scaled_kernel.copy_programs(fmt) if scaled else 1)  # partial slots: packed splits + copied tokens
    q = q_lat.reshape(B, M, D_C).contiguous()
    qr = q_rot.reshape(B, M, D_R).contiguous()
    o_part = torch.empty((B, M, NSP, D_C), dtype=torch.float32, device=q.device)
    lse_part = torch.empty((B, M, NSP), dtype=torch.float32, device=q.device)
    lp = left_padding if left_padding.dtype == torch.int64 else left_padding.to(torch.int64)
    if scaled:
        scaled_kernel.launch_scaled(q, qr, content_planes, rope_planes, fmt, sink_c, sink_r, recent_c, recent_r, lp,
                                    length, o_part, lse_part, M, Tq, target, NS, scaling * LOG2E, block_m,
                                    int(cfg["num_warps"]), int(cfg["stages"]), cfg.get("maxnreg"))
    else:
        gluon_kernel.launch_gluon(q, qr, content_planes, rope_planes, fmt, sink_c, sink_r, recent_c, recent_r, lp,
                                  length, o_part, lse_part, M, Tq, target, NS, scaling * LOG2E, block_m,
                                  int(cfg["num_warps"]), int(cfg["stages"]), bool(cfg.get("async_mma", False)))
    return _combine(o_part, lse_part, B, H, Tq, D_C, NSP, out, NSP - NS)


def fill_splits(B: int, head_blocks: int, sms: int, programs_per_sm: int) -> int:
    """Packed splits per (batch row, head block) for about `programs_per_sm` programs per multiprocessor in all
    (the register kernel: its two resident program slots, filled once): `programs_per_sm * sms // (B *
    head_blocks)`, at least 1. Each program then runs about one slot's share of
    the tiles from start to end: no second, partly filled round of programs and no per-program set-up repeated
    for short splits (H200, register kernel, 16 heads: B32 32K 0.2517 ms with 8 splits against 0.2631 with the
    33 of about 8 programs per multiprocessor; B8 128K 0.2228 with 33 against 0.2497 with 132;
    docs/BENCHMARKS.md "Split count")."""
    return max(1, (programs_per_sm * sms) // max(1, B * head_blocks))


def _register_kernel_inputs(q_lat, q_rot, fmt, left_padding, capacity, block_m, waves, num_splits, fill_per_sm):
    """What the register kernels (one- and two-warpgroup) take besides the planes: `(q [B, M, d_c], qr [B, M, d_R],
    o_part [B, M, NSP, d_c] fp32, lse_part [B, M, NSP] fp32, lp int64, split_target, NS, NSP)` for `block_m`-row
    blocks: `num_splits` splits, or about `waves` programs per multiprocessor (`split_plan`), or by default
    `fill_splits(..., fill_per_sm)`."""
    B, H, Tq, D_C = q_lat.shape
    M = H * Tq
    sms = _num_sms(q_lat.device.index or 0)
    if num_splits is None and waves is None:
        num_splits = fill_splits(B, triton.cdiv(M, block_m), sms, fill_per_sm)
    target, NS = split_plan(B, triton.cdiv(M, block_m), capacity, 0, fmt, sms, gluon_kernel.BLOCK_T, waves or 1,
                            num_splits)
    NSP = NS + scaled_kernel.copy_programs(fmt)
    q = q_lat.reshape(B, M, D_C).contiguous()
    qr = q_rot.reshape(B, M, q_rot.shape[-1]).contiguous()
    o_part = torch.empty((B, M, NSP, D_C), dtype=torch.float32, device=q.device)
    lse_part = torch.empty((B, M, NSP), dtype=torch.float32, device=q.device)
    lp = left_padding if left_padding.dtype == torch.int64 else left_padding.to(torch.int64)
    return q, qr, o_part, lse_part, lp, target, NS, NSP


def _gluon_wide_static(q_lat, q_rot, content_planes, rope_planes, fmt, sink_c, sink_r, recent_c, recent_r,
                       left_padding, length, capacity, scaling, out, **launch):
    """`mla_decode_static` through the two-warpgroup register kernel (`mla_decode_gluon_wide.py`: 32- or 64-row
    blocks; launch keys `block_m`, `waves`, `num_splits`, `inflight`, `launch_regs`, `worker_regs`, `store_a`,
    `vote` (default on)), same partials and combine as the other Gluon kernels."""
    B, H, Tq, D_C = q_lat.shape
    M = H * Tq
    if not wide_kernel.wide_handles(fmt, q_lat.dtype, q_lat.device, sink_c.dtype):
        raise ValueError(f"the two-warpgroup Gluon kernel does not handle {fmt.name} with {q_lat.dtype} queries (2- or "
                         "4-bit content in 8 groups, 4-bit RoPE, sm_90): pass wide=False")
    q_split = q_lat.dtype == torch.float32 or q_rot.dtype == torch.float32
    block_m = int(launch.get("block_m") or wide_kernel.default_block_m(fmt, q_split))
    q, qr, o_part, lse_part, lp, target, NS, NSP = _register_kernel_inputs(
        q_lat, q_rot, fmt, left_padding, capacity, block_m, launch.get("waves"), launch.get("num_splits"),
        wide_kernel.FILL_PER_SM)
    inflight = launch.get("inflight")
    wide_kernel.launch_wide(q, qr, content_planes, rope_planes, fmt, sink_c, sink_r, recent_c, recent_r, lp, length,
                            o_part, lse_part, M, Tq, target, NS, scaling * LOG2E, block_m,
                            wide_kernel.INFLIGHT if inflight is None else inflight, launch.get("launch_regs"),
                            launch.get("worker_regs"), bool(launch.get("store_a")),
                            bool(launch.get("vote", True)))
    return _combine(o_part, lse_part, B, H, Tq, D_C, NSP, out, NSP - NS)


def _gluon_regs_static(q_lat, q_rot, content_planes, rope_planes, fmt, sink_c, sink_r, recent_c, recent_r,
                       left_padding, length, capacity, scaling, out, **launch):
    """`mla_decode_static` through the register-operand Gluon kernel (`mla_decode_gluon_regs.py`: 16-row blocks, one
    warpgroup; launch keys `waves`, `num_splits`, `inflight` (default `INFLIGHT` of the content width), `store_a`,
    `vote` (default on), `overlap`, `row_ptrs` (default on)), same partials and combine as the scaled-tile kernel."""
    B, H, Tq, D_C = q_lat.shape
    M = H * Tq
    if not regs_kernel.regs_handles(fmt, q_lat.dtype, q_lat.device, sink_c.dtype):
        raise ValueError(f"the register-operand Gluon kernel does not handle {fmt.name} with {q_lat.dtype} queries "
                         "(2- or 4-bit or 8-bit content and RoPE, 4 or 8 content groups, sm_90): pass regs=False")
    q, qr, o_part, lse_part, lp, target, NS, NSP = _register_kernel_inputs(
        q_lat, q_rot, fmt, left_padding, capacity, regs_kernel.BLOCK_M, launch.get("waves"), launch.get("num_splits"),
        regs_kernel.FILL_PER_SM)
    # inflight: 0 is a value (each unit's wgmmas waited for at once), None the kernel's default for the format
    regs_kernel.launch_regs(q, qr, content_planes, rope_planes, fmt, sink_c, sink_r, recent_c, recent_r, lp, length,
                            o_part, lse_part, M, Tq, target, NS, scaling * LOG2E, launch.get("inflight"),
                            bool(launch.get("store_a")), bool(launch.get("vote", True)), bool(launch.get("overlap")),
                            bool(launch.get("row_ptrs", True)))
    return _combine(o_part, lse_part, B, H, Tq, D_C, NSP, out, NSP - NS)


def _strided_static(q_lat, q_rot, content_planes, rope_planes, fmt, sink_c, sink_r, recent_c, recent_r, left_padding,
                    length, capacity, scaling, out, **launch):
    """`mla_decode_static` through the strided-plane kernel (`mla_decode_strided.py`; same partials and combine)."""
    B, H, Tq, D_C = q_lat.shape
    D_R = q_rot.shape[-1]
    M = H * Tq
    if not strided_kernel.strided_handles(fmt, q_lat.dtype, q_lat.device, sink_c.dtype):
        raise ValueError(f"the strided-plane decode kernel does not handle {fmt.name} with {q_lat.dtype} queries and "
                         f"{sink_c.dtype} copies on {q_lat.device} (needs packed 2/4/8-bit paths, content groups of "
                         "64, bf16/fp16 queries): use backend='triton'")
    cfg = strided_kernel.strided_default_launch(M)
    cfg.update({k: v for k, v in launch.items() if v is not None})
    block_m, block_t = int(cfg["block_m"]), int(cfg["block_t"])
    head_blocks = triton.cdiv(M, block_m)
    sms = _num_sms(q_lat.device.index or 0) if q_lat.is_cuda and not _interpreting() else 8
    target, NS = split_plan(B, head_blocks, capacity, fmt.sink_tokens, fmt, sms, block_t, cfg["waves"],
                            cfg.get("num_splits"))
    NSP = NS + 1
    q = q_lat.reshape(B, M, D_C).contiguous()
    qr = q_rot.reshape(B, M, D_R).contiguous()
    o_part = torch.empty((B, M, NSP, D_C), dtype=torch.float32, device=q.device)
    lse_part = torch.empty((B, M, NSP), dtype=torch.float32, device=q.device)
    lp = left_padding if left_padding.dtype == torch.int64 else left_padding.to(torch.int64)
    strided_kernel.launch_strided(q, qr, content_planes, rope_planes, fmt, sink_c, sink_r, recent_c, recent_r, lp,
                                  length, o_part, lse_part, M, Tq, target, NS, scaling * LOG2E, block_m, block_t,
                                  int(cfg["num_warps"]), int(cfg["num_stages"]))
    return _combine(o_part, lse_part, B, H, Tq, D_C, NSP, out)
