"""The portable Triton decode kernel: split-K absorbed MLA attention on the packed QuantMLA cache, for any CUDA GPU
of compute capability >= 8 and, in the tests, the Triton interpreter. It computes `mla_decode_ref.py`'s function
(which position comes from which copy: its module docstring) over rows m = (head h, query token t) flattened to
`M = H * Tq`; launched by `quantmla_hf/ops/backends.py` (splits, grid, combine); design and measurements: docs/KERNELS.md.

Queries are scaled per row by a power of two into fp16's range (fp32 queries: a high/low split); packed keys are
the exact fp16 integers `code - z` for the scores, `s += (q_g . (code - z)_g) * scale_g`, and `fp16((code - z) * s)`
(one rounding) for the values; the sink/recent copies go through the same tiles with unit scales. `NATIVE` keeps
every operand in the model dtype. Each split writes a normalised partial and its lse (`mla_decode_combine.py`).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from quantmla_hf.format import CacheFormat, PathFormat


@triton.jit
def _code_bytes(p_bytes, o_t, s_t, m_t, first_byte, GROUP: tl.constexpr, BITS: tl.constexpr):
    """The uint8 code bytes of one group of tokens `o_t: [BT]` (rows at stride `s_t`, the group from byte
    `first_byte`) that `_magic_codes` unpacks: `[BT, GROUP * BITS // 8]` for 2 and 4 bits in groups of 32 or more,
    else `[BT, GROUP]`, the byte of each element (a byte read once per element it holds)."""
    if BITS == 8 or GROUP < 32:
        o_b = tl.arange(0, GROUP) // (8 // BITS)
    else:
        o_b = tl.arange(0, GROUP * BITS // 8)
    return tl.load(p_bytes + (o_t * s_t)[:, None] + first_byte + o_b[None, :], mask=m_t[:, None], other=0)


@triton.jit
def _magic_codes(b_byte, GROUP: tl.constexpr, BITS: tl.constexpr):
    """`_code_bytes`' tile -> `[BT, GROUP]` fp16 `1024 + code` in element order (exact). Element e of a group sits in
    byte `e * BITS // 8` at bit `(e * BITS) % 8` (quantmla_hf/format.py). 2 and 4 bits in groups of 32 or more: the
    bytes split into elements by `tl.join` and `tl.reshape`; 8 bits, and groups of 16, each element's own byte
    shifted (Triton 3.6 compiles the join wrongly for 16-element groups; a byte per element is slower for wider)."""
    BT: tl.constexpr = b_byte.shape[0]
    x = b_byte.to(tl.int16)
    if b_byte.shape[1] == GROUP:  # a byte per element (`_code_bytes` chose)
        o_e = tl.arange(0, GROUP)
        x = (x >> ((o_e % (8 // BITS)) * BITS).to(tl.int16)[None, :]) & ((1 << BITS) - 1)
    elif BITS == 4:
        x = tl.reshape(tl.join(x & 15, x >> 4), (BT, GROUP))
    else:
        # join stacks on a new last axis: join(join(e0, e2), join(e1, e3))[..., k, j] = e(2k + j): flattened e0 e1 e2 e3
        x = tl.reshape(tl.join(tl.join(x & 3, (x >> 4) & 3), tl.join((x >> 2) & 3, x >> 6)), (BT, GROUP))
    return (x | 0x6400).to(tl.float16, bitcast=True)


@triton.jit
def _group_tile(p0, p1, p2, s_t, s_mt, o_t, m_t, g: tl.constexpr, GROUP: tl.constexpr, BITS: tl.constexpr,
                NATIVE: tl.constexpr):
    """Group `g` of tokens `o_t: [BT]` of one path (row-offset pointers): keys `[BT, GROUP]` (fp16; the model
    dtype when NATIVE, fp32 for packed codes) and scales `[BT]` fp32. Packed (`BITS` < 16): `p0, p1, p2` = codes,
    scale, zero planes, the keys the exact integers `(code | 0x6400) - (1024 + z)`. `BITS` == 16 (a 16-bit path or
    the copies): `p0` holds the values, unit scales. Masked tokens give zero scales (and zero keys for values)."""
    if BITS == 16:
        o_k = tl.arange(0, GROUP)
        b_v = tl.load(p0 + (o_t * s_t)[:, None] + g * GROUP + o_k[None, :], mask=m_t[:, None], other=0.0)
        b_k = b_v if NATIVE else b_v.to(tl.float16)
        b_s = tl.where(m_t, 1.0, 0.0)
    else:
        HALF: tl.constexpr = 1 << (BITS - 1)
        b_byte = _code_bytes(p0, o_t, s_t, m_t, g * (GROUP * BITS // 8), GROUP, BITS)
        b_s = tl.load(p1 + o_t * s_mt + g, mask=m_t, other=0.0).to(tl.float32)
        b_z = tl.load(p2 + o_t * s_mt + g, mask=m_t, other=0).to(tl.int32)
        z = (b_z + (1024 + HALF)).to(tl.float16)  # 1024 + z, exact
        b_k = _magic_codes(b_byte, GROUP, BITS) - z[:, None]
        if NATIVE:
            b_k = b_k.to(tl.float32)
    return b_k, b_s


@triton.jit
def _load_query_group(p_q, o_m, m_m, inv_f, g: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr,
                      NATIVE: tl.constexpr):
    """Columns of group `g` of rows `o_m` times the per-row power of two `inv_f`: `(hi, lo)` fp16 `[BM, GROUP]`
    (`lo` the rounding error of `hi`; `(q, q)` as stored when NATIVE)."""
    o_k = tl.arange(0, GROUP)
    q = tl.load(p_q + o_m[:, None] * D + g * GROUP + o_k[None, :], mask=m_m[:, None], other=0.0)
    if NATIVE:
        q_hi = q
        q_lo = q
    else:
        q = q.to(tl.float32) * inv_f[:, None]
        q_hi = q.to(tl.float16)
        q_lo = (q - q_hi.to(tl.float32)).to(tl.float16)
    return q_hi, q_lo


@triton.jit
def _row_scale(p_q, o_m, m_m, D: tl.constexpr, NATIVE: tl.constexpr):
    """Per-row power of two `f = 2**e` (`[BM]`) that keeps `|q| / f` below 2**14 (fp16 query operands neither
    overflow nor lose bf16 bits); returns `(f, 1 / f)` (ones when NATIVE)."""
    o_k = tl.arange(0, D)
    q = tl.load(p_q + o_m[:, None] * D + o_k[None, :], mask=m_m[:, None], other=0.0)
    amax = tl.max(tl.abs(q.to(tl.float32)), axis=1)
    e = tl.maximum(tl.ceil(tl.log2(tl.maximum(amax, 1.0) / 16384.0)), 0.0)
    if NATIVE:
        e = tl.zeros_like(amax)
    return tl.exp2(e), tl.exp2(-e)


@triton.jit
def _qk(q_hi, q_lo, b_k, Q_SPLIT: tl.constexpr, NATIVE: tl.constexpr):
    """`[BM, GROUP] x [BT, GROUP]^T -> [BM, BT]` fp32: fp16 operands (plus the low query part when Q_SPLIT), or
    the keys' dtype when NATIVE (an IEEE dot for fp32)."""
    k_t = tl.trans(b_k)
    if NATIVE:
        d = tl.dot(q_hi.to(b_k.dtype), k_t, input_precision="ieee")
    else:
        d = tl.dot(q_hi, k_t)
        if Q_SPLIT:
            d += tl.dot(q_lo, k_t)
    return d


@triton.jit
def _pv(acc, alpha, b_p, b_k, b_s, NATIVE: tl.constexpr):
    """`acc * alpha + p @ (k * s)`: values `fp16(k * s)` (one rounding) with fp16 `p`; when NATIVE `p @ k` in the
    keys' dtype (16-bit values carry unit scales; fp32 an IEEE dot with the scales)."""
    if NATIVE and b_k.dtype == tl.float32:
        pv = tl.dot(b_p, b_k * b_s[:, None], input_precision="ieee")
    elif NATIVE:
        pv = tl.dot(b_p.to(b_k.dtype), b_k)
    else:
        pv = tl.dot(b_p.to(tl.float16), b_k * b_s.to(tl.float16)[:, None])
    return acc * alpha[:, None] + pv


@triton.jit
def _tile(c0, c1, c2, r0, r1, r2, s_ct, s_cmt, s_rt, s_rmt, o_t, m_t, m_valid, fc, fr, qh, ql, qrh, qrl, m_i, l_i,
          acc, GC: tl.constexpr, GROUP_C: tl.constexpr, C_BITS: tl.constexpr, GROUP_R: tl.constexpr,
          R_BITS: tl.constexpr, Q_SPLIT: tl.constexpr, NATIVE: tl.constexpr):
    """One token tile: scores `sum_g s_g * (q_g . k_g)` over the content groups plus the RoPE group (keys as exact
    integers), an online-softmax step in base 2, and per group `a_g = a_g * alpha + p @ fp16(k_g * s_g)` (the
    group re-read, an L1 hit, and re-unpacked, scaled: one fp16 rounding). Queries: tuples `qh, ql` of `GC`
    `[BM, GROUP_C]` groups (content) and `qrh, qrl: [BM, GROUP_R]`; accumulators: the tuple `acc` of `GC`
    `[BM, GROUP_C]` fp32; `m_valid: [BM, BT]`. Returns `(m_i, l_i, acc)`."""
    k, s = _group_tile(c0, c1, c2, s_ct, s_cmt, o_t, m_t, 0, GROUP_C, C_BITS, NATIVE)
    sc = _qk(qh[0], ql[0], k, Q_SPLIT, NATIVE) * s[None, :]
    for g in tl.static_range(1, GC):
        k, s = _group_tile(c0, c1, c2, s_ct, s_cmt, o_t, m_t, g, GROUP_C, C_BITS, NATIVE)
        sc += _qk(qh[g], ql[g], k, Q_SPLIT, NATIVE) * s[None, :]
    k, s = _group_tile(r0, r1, r2, s_rt, s_rmt, o_t, m_t, 0, GROUP_R, R_BITS, NATIVE)
    b_s = sc * fc[:, None] + _qk(qrh, qrl, k, Q_SPLIT, NATIVE) * (s[None, :] * fr[:, None])

    # the online-softmax step in base 2
    b_s = tl.where(m_valid, b_s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(b_s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    b_p = tl.exp2(b_s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(b_p, axis=1)

    out = ()
    for g in tl.static_range(GC):
        k, s = _group_tile(c0, c1, c2, s_ct, s_cmt, o_t, m_t, g, GROUP_C, C_BITS, NATIVE)
        out = out + (_pv(acc[g], alpha, b_p, k, s, NATIVE),)
    return m_new, l_i, out


@triton.jit
def _stage_queries(p_q, p_qr, o_m, m_m, qk_scale, D_C: tl.constexpr, GC: tl.constexpr, GROUP_C: tl.constexpr,
                   D_R: tl.constexpr, NATIVE: tl.constexpr):
    """Rows `o_m` of the queries `p_q: [., D_C]`, `p_qr: [., D_R]`, staged once per program: the score factors
    `fc, fr` (per-row powers of two times `qk_scale` = scaling * log2(e)) and the high/low parts `qh, ql` (content:
    tuples of the `GC` groups), `qrh, qrl` (RoPE) of `_load_query_group`."""
    fc, inv_fc = _row_scale(p_q, o_m, m_m, D_C, NATIVE)
    fr, inv_fr = _row_scale(p_qr, o_m, m_m, D_R, NATIVE)
    qh = ()
    ql = ()
    for g in tl.static_range(GC):
        hi, lo = _load_query_group(p_q, o_m, m_m, inv_fc, g, GROUP_C, D_C, NATIVE)
        qh = qh + (hi,)
        ql = ql + (lo,)
    qrh, qrl = _load_query_group(p_qr, o_m, m_m, inv_fr, 0, D_R, D_R, NATIVE)
    return fc * qk_scale, fr * qk_scale, qh, ql, qrh, qrl


@triton.jit
def _empty_state(BLOCK_M: tl.constexpr, GROUP_C: tl.constexpr, GC: tl.constexpr):
    """Online-softmax state before any token: running maximum, sum and the `GC` `[BLOCK_M, GROUP_C]`
    accumulators."""
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = ()
    for g in tl.static_range(GC):
        acc = acc + (tl.zeros((BLOCK_M, GROUP_C), tl.float32),)
    return m_i, l_i, acc


@triton.jit
def _store_partial(o_ptr, lse_ptr, o_row, m_m, m_i, l_i, acc, GROUP_C: tl.constexpr, D_C: tl.constexpr,
                   GC: tl.constexpr):
    """Rows `o_row` of the partials: `o` normalised by this split's sum, `lse` in natural log (-inf when empty)."""
    has = l_i > 0
    inv_l = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
    b_lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    o_k = tl.arange(0, GROUP_C)
    for g in tl.static_range(GC):
        tl.store(o_ptr + o_row[:, None] * D_C + g * GROUP_C + o_k[None, :], acc[g] * inv_l[:, None],
                 mask=m_m[:, None])
    tl.store(lse_ptr + o_row, b_lse, mask=m_m)


@triton.jit
def _partial_rows(i_p, M, o_m, num_splits, i_s):
    """`[BM]` partial rows of rows `o_m` of sequence program `i_p`, split `i_s`: `(i_p * M + o_m) * (num_splits + 1) +
    i_s`."""
    return (i_p * M + o_m) * (num_splits + 1) + i_s


@triton.jit
def _program(len_ptr, lp_ptr, rows_ptr, cu_q_ptr, tok_req_ptr, M, Tq, PAGE: tl.constexpr, BLOCK_M: tl.constexpr):
    """What a program of the grid `(split, row block, sequence program)` works on: `(i_s, i_p, i_req, row, length, lp,
    limit0, o_m, m_m, lim_m)` = its split, sequence program, request (its planes), copy row, the request's length,
    left padding, the causal limit of its first query token, its rows `o_m: [BLOCK_M]` (mask `m_m`) and each row's
    causal limit `lim_m` (query t of Tq sees positions `< length - Tq + t + 1`). Contiguous (`PAGE` 0) and paged
    launches as `mla_decode_triton_kernel` describes them."""
    i_s = tl.program_id(0).to(tl.int64)
    i_hb = tl.program_id(1).to(tl.int64)
    i_p = tl.program_id(2).to(tl.int64)
    if PAGE:
        i_req = tl.load(tok_req_ptr + i_p).to(tl.int64)
        q_start = tl.load(cu_q_ptr + i_req).to(tl.int64)
        q_len = tl.load(cu_q_ptr + i_req + 1).to(tl.int64) - q_start
        length = tl.load(len_ptr + i_req).to(tl.int64)
        row = tl.load(rows_ptr + i_req).to(tl.int64)
        lp = 0
        limit0 = length - q_len + (i_p - q_start) + 1
    else:
        i_req = i_p
        row = i_p
        length = tl.load(len_ptr).to(tl.int64)
        lp = tl.load(lp_ptr + i_p).to(tl.int64)
        limit0 = length - Tq + 1
    o_m = (i_hb * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int32)
    return i_s, i_p, i_req, row, length, lp, limit0, o_m, o_m < M, limit0 + (o_m % Tq)


@triton.jit
def _split_range(length, limit0, i_s, is_dense, split_target, S: tl.constexpr, R: tl.constexpr,
                 BLOCK_T: tl.constexpr):
    """`[lo, hi)`: split `i_s`'s share of the packed positions `[S, length - R)`, cut below the causal limit
    `limit0`, in `tokens_per_split = max(2 BT, round_up(cdiv(n, split_target), BT))` (`ops.backends.split_plan`);
    empty for the copies' program (`is_dense`)."""
    packed_len = tl.maximum(length - R - S, 0)
    tokens_per_split = (packed_len + split_target - 1) // split_target
    tokens_per_split = tl.maximum((tokens_per_split + BLOCK_T - 1) // BLOCK_T * BLOCK_T, 2 * BLOCK_T)
    lo_s = S + i_s * tokens_per_split
    return lo_s, tl.where(is_dense, lo_s, tl.minimum(lo_s + tokens_per_split, tl.minimum(length - R, limit0)))


# Lengths, counts and the page-table width change every step: no specialisation on them.
@triton.jit(do_not_specialize=["M", "Tq", "s_pt", "split_target", "num_splits"])
def mla_decode_triton_kernel(
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
    """One program per (split, head block, sequence program `i_p`): splits `0 .. num_splits-1` take
    `tokens_per_split` packed positions each from `S`, sized from the device-side length (`ops.backends.split_plan`);
    split `num_splits` takes the sink and recent copies. Writes the normalised partial `o: [P, M, num_splits + 1,
    D_C]` and `lse: [P, M, num_splits + 1]` (natural log, -inf when empty) for the `P` sequence programs.

    `PAGE = 0` (contiguous planes): `i_p` is batch row b with `M = H * Tq` query rows, the shared length
    `len_ptr[0]`, left padding `lp_ptr[b]`, planes and copies at batch strides `s_*b`.
    `PAGE > 0` (page pools `[P * PAGE, width]`, batch strides 0): `i_p` is query token n of request
    `tok_req_ptr[n]` (`M = H`, `Tq = 1`), its length `len_ptr[req]`, copy row `rows_ptr[req]`, causal limit from
    `cu_q_ptr`, position p read from pool row `pt_ptr[req * s_pt + p // PAGE] * PAGE + p % PAGE`."""
    i_s, i_p, i_req, row, length, lp, limit0, o_m, m_m, lim_m = _program(
        len_ptr, lp_ptr, rows_ptr, cu_q_ptr, tok_req_ptr, M, Tq, PAGE, BLOCK_M)

    fc, fr, qh, ql, qrh, qrl = _stage_queries(q_ptr + i_p * s_qb, qr_ptr + i_p * s_qrb, o_m, m_m, qk_scale, D_C, GC,
                                              GROUP_C, D_R, NATIVE)
    m_i, l_i, acc = _empty_state(BLOCK_M, GROUP_C, GC)
    is_dense = i_s == num_splits

    # Packed positions: this split's share of [S, length - R), intersected with [lp + S, limit0). Every one of them
    # lies before each query row's causal limit: Tq <= R (the limit only cuts where R = 0: a paged C16R16 chunk).
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
        m_i, l_i, acc = _tile(
            p_cc, p_cs, p_cz, p_rc, p_rs, p_rz, s_cct, s_cst, s_rct, s_rst, slot, m_t, m_m[:, None] & m_t[None, :],
            fc, fr, qh, ql, qrh, qrl, m_i, l_i, acc, GC, GROUP_C, C_BITS, D_R, R_BITS, Q_SPLIT, NATIVE)

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
        m_i, l_i, acc = _tile(
            p_snc, p_snc, p_snc, p_snr, p_snr, p_snr, s_snct, s_snct, s_snrt, s_snrt, o_j, m_t, m_valid,
            fc, fr, qh, ql, qrh, qrl, m_i, l_i, acc, GC, GROUP_C, 16, D_R, 16, Q_SPLIT, NATIVE)
    r_lo = tl.maximum(length - R, 0)
    r_hi = tl.where(is_dense, length, r_lo)
    p_rcc = rcc_ptr + row * s_rccb
    p_rcr = rcr_ptr + row * s_rcrb
    RING: tl.constexpr = R if R > 0 else 1
    for start in range(r_lo, r_hi, BLOCK_T):
        o_t = start + o_bt
        m_t = (o_t < r_hi) & (o_t >= lo_valid)
        m_valid = m_m[:, None] & m_t[None, :] & (o_t[None, :] < lim_m[:, None])
        m_i, l_i, acc = _tile(
            p_rcc, p_rcc, p_rcc, p_rcr, p_rcr, p_rcr, s_rcct, s_rcct, s_rcrt, s_rcrt, o_t % RING, m_t, m_valid,
            fc, fr, qh, ql, qrh, qrl, m_i, l_i, acc, GC, GROUP_C, 16, D_R, 16, Q_SPLIT, NATIVE)

    o_row = _partial_rows(i_p, M, o_m, num_splits, i_s)
    _store_partial(o_ptr, lse_ptr, o_row, m_m, m_i, l_i, acc, GROUP_C, D_C, GC)


def path_tiling(path: PathFormat, max_groups: int) -> tuple[int, int] | None:
    """`(groups, group width)` the kernel takes a path in, or None: a packed path in its own groups (powers of two,
    at least 16 elements, at most `max_groups`); a 16-bit path in the fewest power-of-two groups of at most 64
    elements that `max_groups` allows."""
    if path.dim < 16 or path.dim & (path.dim - 1):
        return None
    if path.quantized:
        g, w = path.n_groups, path.group
    else:
        w = max(16, min(64, path.dim), path.dim // max_groups)
        g = path.dim // w
    # g and w divide the power-of-two width (`max_groups` is a power of two too), so are powers of two.
    return (g, w) if w >= 16 and g <= max_groups else None


def triton_handles(fmt: CacheFormat, copy_dtype: torch.dtype) -> bool:
    """Whether the kernel computes this format: power-of-two widths of at least 16, content in at most 8 groups and
    RoPE in one (`path_tiling`), model-dtype values in bf16, fp16 or fp32."""
    return (path_tiling(fmt.content, 8) is not None and path_tiling(fmt.rope, 1) is not None
            and copy_dtype in (torch.bfloat16, torch.float16, torch.float32))


def interpreting() -> bool:
    """Whether Triton runs in its CPU interpreter (`TRITON_INTERPRET=1`, the tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def native_operands(fmt: CacheFormat, q_dtype: torch.dtype, qr_dtype: torch.dtype, copy_dtype: torch.dtype) -> bool:
    """Whether a launch keeps every operand in the model dtype (`NATIVE`): fp32 copies, or both paths 16-bit with
    queries in the copies' dtype, except bf16 in the interpreter, whose `tl.dot` multiplies the bit patterns of bf16
    operands (there bf16 launches take the fp16 operands of the packed path)."""
    both16 = not fmt.content.quantized and not fmt.rope.quantized
    if copy_dtype == torch.bfloat16 and interpreting():
        return False
    return copy_dtype == torch.float32 or (both16 and q_dtype == qr_dtype == copy_dtype)


def launch_shape(fmt: CacheFormat, M: int) -> tuple[int, int, int]:
    """`(tokens per tile, warps, pipeline stages)` of a launch over `M` rows (the fastest measured): 16-bit content
    64-token tiles, 4 warps and 2 stages; packed content 32-token tiles, 4 warps, 1 stage up to 32 rows and 2 above.
    The tile depends on the format alone: `split_plan` sizes the grid with it."""
    if not fmt.content.quantized:
        return 64, 4, 2
    return 32, 4, 1 if M <= 32 else 2


def programs_per_sm(rows: int) -> int:
    """Programs per multiprocessor the splits aim at, from the `rows` (batch row or query token, head block) pairs
    of a launch: the power of two at or above `rows / 4`, between 1 and 8 (few rows: few splits, whose partials the
    combine reads back; many rows: more programs to hide the loads)."""
    return min(8, 1 << max(0, -(-rows // 4) - 1).bit_length())


def split_target(rows: int, sms: int) -> int:
    """Packed splits per row of a launch of `rows` (row, head block) pairs on `sms` multiprocessors:
    `programs_per_sm(rows)` programs per multiprocessor in all."""
    rows = max(1, rows)
    return -(-programs_per_sm(rows) * sms // rows)


def block_rows(M: int) -> int:
    """Query rows per program: 16 up to 32 rows, else 32 (each token tile unpacked once per block)."""
    return 16 if M <= 32 else 32


def _plane3(planes: dict, path: PathFormat, requests: int):
    """A path's `(p0, p1, p2)` planes `[B, capacity, width]` (`_group_tile`); given `requests` (> 0), page planes
    `[P, page_size, width]` as one pool `[requests, P * page_size, width]` of batch stride 0."""
    if requests:
        for name, plane in planes.items():
            if not plane.is_contiguous():
                raise ValueError(f"page plane {name!r} must be contiguous [P, page_size, width]")
        planes = {k: v.view(1, -1, v.shape[-1]).expand(requests, -1, -1) for k, v in planes.items()}
    if path.quantized:
        return planes["codes"], planes["scale"], planes["zero"]
    v = planes["values"]
    return v, v, v


def launch_triton(q, qr, cp, rp, fmt, sink_c, sink_r, recent_c, recent_r, lp, length, o_part, lse_part, M, Tq,
                  split_target, NS, qk_scale, native=None, pages=None, block_t=None):
    """Launch `mla_decode_triton_kernel` on the grid `(NS + 1, cdiv(M, block_rows(M)), B)`: `q: [B, M, d_c]`,
    `qr: [B, M, d_R]`, partials `o_part: [B, M, NS + 1, d_c]`, `lse_part: [B, M, NS + 1]` fp32, in the launch
    measured on the H200 (`block_rows`, `launch_shape`; `block_t` overrides the tile). `native`: `NATIVE`, default
    from the copies' dtype. `pages` (the kernel's `PAGE` launch, B the query tokens): `(page_table, rows,
    cu_seqlens_q, token_request)` int32 of the requests, whose page planes `cp`, `rp` are `[P, page_size, width]`."""
    B, _, D_C = q.shape
    D_R = qr.shape[-1]
    if native is None:
        native = native_operands(fmt, q.dtype, qr.dtype, sink_c.dtype)
    GC, GROUP_C = path_tiling(fmt.content, 8)
    block_m, (tile, warps, stages) = block_rows(M), launch_shape(fmt, M)
    n_req = pages[0].shape[0] if pages else 0
    c0, c1, c2 = _plane3(cp, fmt.content, n_req)
    r0, r1, r2 = _plane3(rp, fmt.rope, n_req)
    page_size = next(iter(cp.values())).shape[1] if pages else 0
    pt, rows, cu_q, tok_req = pages if pages else (lp,) * 4
    mla_decode_triton_kernel[(NS + 1, triton.cdiv(M, block_m), B)](
        q, qr, c0, c1, c2, r0, r1, r2, sink_c, sink_r, recent_c, recent_r, length, lp, pt, rows, cu_q, tok_req,
        o_part, lse_part, M, Tq, pt.stride(0) if pages else 0, split_target, NS, qk_scale,
        q.stride(0), qr.stride(0),
        *(t.stride(i) for t in (c0, c1, r0, r1, sink_c, sink_r, recent_c, recent_r) for i in (0, 1)),
        D_C=D_C, GC=GC, GROUP_C=GROUP_C, C_BITS=fmt.content.bits, D_R=D_R, R_BITS=fmt.rope.bits,
        S=fmt.sink_tokens, R=fmt.recent_tokens, PAGE=page_size, BLOCK_M=block_m, BLOCK_T=block_t or tile,
        Q_SPLIT=q.dtype == torch.float32 or qr.dtype == torch.float32, NATIVE=native, num_warps=warps,
        num_stages=stages,
    )
