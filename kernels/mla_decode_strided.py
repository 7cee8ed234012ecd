"""Packed MLA decode with code planes as MMA operands (issue #11): strided query planes, no fp16 key tiles in memory.

Same function as `mla_decode_fast.py` (reference `mla_decode_ref.py`), same partial outputs `[B, M, NS + 1, d_c]` /
`[B, M, NS + 1]`, same combine, behind the same static launch (`mla_decode_fast.mla_decode_static(...,
backend="strided")`). Notes: docs/KERNELS.md "Strided-plane kernel".

The idea. A code byte of a `b`-bit path holds `P = 8 / b` elements: element `P * i + k` of a group in bits
`[k * b, (k + 1) * b)` of byte `i` (docs/CACHE_FORMAT.md). Instead of unpacking the bytes into elements in order
(an interleave, which Triton can only do in a blocked register layout and then has to move through shared memory,
as fp16, to reach the MMA operand layout), every bit field `k` is used as it lies: the *plane* `k` of a group is the
`[BT, 64 / P]` tile of elements `P * i + k`, and the query is split the same way, once per program
(`q_{g,k}[m, i] = q[m, 64 g + P i + k]`). Then

    q_g . key_g = sum_k q_{g,k} . plane_k(key_g)

and every step from the bytes to an MMA operand is element-wise and shape-preserving (shift, mask, or with the fp16
"magic number" 0x6400, minus `1024 + z`). Triton's pipeliner copies the code bytes of a tile into shared memory with
`cp.async` and loads them from there straight into the operand layouts of `mma` (for the scores transposed, for
the values as they lie); the unpack runs on the operand registers. The fp16 tile of the other kernels (unpacked in
registers, stored to shared memory, read back by `ldmatrix`, once per dot) never exists. Checked in the compiled
code (sm_90, Triton 3.6 and 3.9): `tests/test_mla_decode_strided.py`.

Per token tile (`BT` tokens) and block of `BM` query rows:

* scores: per group, `s += scale_g[t] * sum_k q_{g,k} . (plane_k - z)` (exact integer dots, scale on the partial);
* softmax step in base 2;
* values: per group and plane, `o_{g,k} = o_{g,k} * alpha + fp16(p * scale_g[t]) @ (plane_k - z)`: the scale goes on
  the `[BM, BT]` probabilities (one fp16 rounding), the zero point stays exact in the integer tile. The code bytes
  are loaded a second time for this (`TWO_LOADS`, an L2 hit: each load gets its own pipelined shared-memory buffer)
  or reused from the scores' load.

The accumulators are `G * P` tiles `[BM, 64 / P]` (output columns of plane `k` of group `g` at `64 g + P i + k`).
The sink and recent copies (last split) are read in the same planes (strided loads, unit scales).

Handles (`strided_handles`): both paths packed at 2, 4 or 8 bits, groups of 64 (content: 1-8 groups; RoPE: one group
of at most 64), bf16/fp16 queries (fp32 queries need the high/low split of the other kernels), bf16/fp16 copies.
Plain Triton: the interpreter runs the same code on CPU in the tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantmla_hf.format import CacheFormat


@triton.jit
def _plane(b, zf, k: tl.constexpr, BITS: tl.constexpr):
    """Plane `k` of code bytes `b: [BT, NB]` (int16, zero-extended): fp16 exact integers `code - z` of elements
    `P * i + k` (`zf: [BT]` fp16 `1024 + z`; `(code | 0x6400)` is the fp16 `1024 + code`)."""
    if BITS == 8:
        x = b
    else:
        x = (b >> (k * BITS)) & ((1 << BITS) - 1)
    return (x | 0x6400).to(tl.float16, bitcast=True) - zf[:, None]


@triton.jit
def _group_codes(p0, p1, p2, s_t, s_mt, o_t, m_t, g: tl.constexpr, NB: tl.constexpr, HALF: tl.constexpr,
                 EVICT: tl.constexpr):
    """Group `g` of tokens `o_t: [BT]`: code bytes `[BT, NB]` int16, scale `[BT]` fp32 (0 where masked) and
    `1024 + z` `[BT]` fp16."""
    o_b = tl.arange(0, NB)
    b = tl.load(p0 + (o_t * s_t)[:, None] + g * NB + o_b[None, :], mask=m_t[:, None], other=0,
                eviction_policy=EVICT).to(tl.int16)
    s = tl.load(p1 + o_t * s_mt + g, mask=m_t, other=0.0).to(tl.float32)
    z = tl.load(p2 + o_t * s_mt + g, mask=m_t, other=0).to(tl.int32)
    return b, s, (z + (1024 + HALF)).to(tl.float16)


@triton.jit
def _copy_plane(p, s_t, o_t, m_t, g: tl.constexpr, k: tl.constexpr, GROUP: tl.constexpr, P: tl.constexpr):
    """Plane `k` of group `g` of model-dtype copies (`p` row base, token stride `s_t`): `[BT, GROUP / P]` fp16."""
    o_i = tl.arange(0, GROUP // P)
    v = tl.load(p + (o_t * s_t)[:, None] + g * GROUP + P * o_i[None, :] + k, mask=m_t[:, None], other=0.0)
    return v.to(tl.float16)


@triton.jit
def _scores(qs, p0, p1, p2, s_t, s_mt, o_t, m_t, BM: tl.constexpr, BT: tl.constexpr, G: tl.constexpr,
            GROUP: tl.constexpr, BITS: tl.constexpr, CB: tl.constexpr, DENSE: tl.constexpr):
    """`[BM, BT]` fp32 `sum_g scale_g * sum_k q_{g,k} . (plane_k - z)_g` of one path (`qs`: tuple of the `G * P`
    query planes `[BM, GROUP / P]` fp16). `DENSE`: `p0` holds model-dtype copies (unit scales); `CB` the packed
    width that fixes the planes."""
    P: tl.constexpr = 8 // CB
    NB: tl.constexpr = GROUP * CB // 8
    acc = tl.zeros((BM, BT), tl.float32)
    for g in tl.static_range(G):
        d = tl.zeros((BM, BT), tl.float32)
        if DENSE:
            for k in tl.static_range(P):
                d = tl.dot(qs[g * P + k], tl.trans(_copy_plane(p0, s_t, o_t, m_t, g, k, GROUP, P)), d)
            acc += d
        else:
            b, s, zf = _group_codes(p0, p1, p2, s_t, s_mt, o_t, m_t, g, NB, 1 << (BITS - 1), "evict_last")
            for k in tl.static_range(P):
                d = tl.dot(qs[g * P + k], tl.trans(_plane(b, zf, k, BITS)), d)
            acc += d * s[None, :]
    return acc


@triton.jit
def _values(accs, b_p, alpha, p0, p1, p2, s_t, s_mt, o_t, m_t, G: tl.constexpr, GROUP: tl.constexpr,
            BITS: tl.constexpr, CB: tl.constexpr, DENSE: tl.constexpr):
    """`o_{g,k} = o_{g,k} * alpha + fp16(p * scale_g) @ (plane_k - z)_g` for the `G * P` accumulators `accs`
    (tuple of `[BM, GROUP / P]` fp32); `b_p: [BM, BT]` fp32 probabilities, `alpha: [BM]`."""
    P: tl.constexpr = 8 // CB
    NB: tl.constexpr = GROUP * CB // 8
    out = ()
    if DENSE:
        p16 = b_p.to(tl.float16)
        for g in tl.static_range(G):
            for k in tl.static_range(P):
                v = _copy_plane(p0, s_t, o_t, m_t, g, k, GROUP, P)
                out = out + (tl.dot(p16, v, accs[g * P + k] * alpha[:, None]),)
    else:
        for g in tl.static_range(G):
            b, s, zf = _group_codes(p0, p1, p2, s_t, s_mt, o_t, m_t, g, NB, 1 << (BITS - 1), "evict_first")
            pg = (b_p * s[None, :]).to(tl.float16)
            for k in tl.static_range(P):
                out = out + (tl.dot(pg, _plane(b, zf, k, BITS), accs[g * P + k] * alpha[:, None]),)
    return out


@triton.jit
def _tile(qc, qr, accs, m_i, l_i, c0, c1, c2, r0, r1, r2, s_ct, s_cmt, s_rt, s_rmt, o_t, m_t, m_valid, fc, fr,
          BM: tl.constexpr, BT: tl.constexpr, GC: tl.constexpr, D_R: tl.constexpr, C_BITS: tl.constexpr,
          R_BITS: tl.constexpr, CB: tl.constexpr, RB: tl.constexpr, DENSE: tl.constexpr):
    """One token tile: scores of both paths, an online-softmax step (base 2), values. Returns `(accs, m_i, l_i)`."""
    sc = _scores(qc, c0, c1, c2, s_ct, s_cmt, o_t, m_t, BM, BT, GC, 64, C_BITS, CB, DENSE)
    sr = _scores(qr, r0, r1, r2, s_rt, s_rmt, o_t, m_t, BM, BT, 1, D_R, R_BITS, RB, DENSE)
    b_s = tl.where(m_valid, sc * fc[:, None] + sr * fr[:, None], float("-inf"))
    m_new = tl.maximum(m_i, tl.max(b_s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    b_p = tl.exp2(b_s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(b_p, axis=1)
    accs = _values(accs, b_p, alpha, c0, c1, c2, s_ct, s_cmt, o_t, m_t, GC, 64, C_BITS, CB, DENSE)
    return accs, m_new, l_i


@triton.jit
def _query_planes(p_q, o_m, m_m, inv_f, D: tl.constexpr, G: tl.constexpr, GROUP: tl.constexpr, CB: tl.constexpr):
    """The `G * P` query planes `q_{g,k}[m, i] = q[m, GROUP g + P i + k] / f[m]` as fp16 `[BM, GROUP / P]`."""
    P: tl.constexpr = 8 // CB
    o_i = tl.arange(0, GROUP // P)
    out = ()
    for g in tl.static_range(G):
        for k in tl.static_range(P):
            q = tl.load(p_q + o_m[:, None] * D + g * GROUP + P * o_i[None, :] + k, mask=m_m[:, None], other=0.0)
            out = out + ((q.to(tl.float32) * inv_f[:, None]).to(tl.float16),)
    return out


@triton.jit
def _row_scale(p_q, o_m, m_m, D: tl.constexpr):
    """Per-row power of two `f = 2**e` (`[BM]`) that keeps `|q| / f` below 2**14; returns `(f, 1 / f)`."""
    o_k = tl.arange(0, D)
    q = tl.load(p_q + o_m[:, None] * D + o_k[None, :], mask=m_m[:, None], other=0.0)
    amax = tl.max(tl.abs(q.to(tl.float32)), axis=1)
    e = tl.maximum(tl.ceil(tl.log2(tl.maximum(amax, 1.0) / 16384.0)), 0.0)
    return tl.exp2(e), tl.exp2(-e)


@triton.jit(do_not_specialize=["M", "Tq", "split_target", "num_splits"])
def mla_decode_strided_kernel(
    q_ptr, qr_ptr,
    cc_ptr, cs_ptr, cz_ptr, rc_ptr, rs_ptr, rz_ptr,
    snc_ptr, snr_ptr, rcc_ptr, rcr_ptr, lp_ptr, len_ptr,
    o_ptr, lse_ptr,
    M, Tq, split_target, num_splits, qk_scale,
    s_qb, s_qrb, s_ccb, s_cct, s_csb, s_cst, s_rcb, s_rct, s_rsb, s_rst,
    s_sncb, s_snct, s_snrb, s_snrt, s_rccb, s_rcct, s_rcrb, s_rcrt,
    D_C: tl.constexpr, GC: tl.constexpr, C_BITS: tl.constexpr, D_R: tl.constexpr, R_BITS: tl.constexpr,
    S: tl.constexpr, R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """One program per (split, block of query rows, batch row); splits `0 .. num_splits-1` take `tokens_per_split =
    max(2 * BLOCK_T, round_up(cdiv(length - S - R, split_target), BLOCK_T))` packed positions each from `S` (sized from
    the device-side length, as the fast kernel: `mla_decode_fast.split_plan`), split `num_splits` the sink and recent
    copies. Writes the normalised partial
    `o: [B, M, num_splits + 1, D_C]` and `lse: [B, M, num_splits + 1]` (natural log, -inf when empty)."""
    i_s = tl.program_id(0).to(tl.int64)
    i_hb = tl.program_id(1).to(tl.int64)
    i_b = tl.program_id(2).to(tl.int64)

    length = tl.load(len_ptr).to(tl.int64)
    lp = tl.load(lp_ptr + i_b).to(tl.int64)
    o_m = (i_hb * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int32)
    m_m = o_m < M
    lim_m = length - Tq + (o_m % Tq) + 1  # query t of Tq sees positions < length - Tq + t + 1

    p_q = q_ptr + i_b * s_qb
    p_qr = qr_ptr + i_b * s_qrb
    fc, inv_fc = _row_scale(p_q, o_m, m_m, D_C)
    fr, inv_fr = _row_scale(p_qr, o_m, m_m, D_R)
    fc = fc * qk_scale  # scores in base 2, pre-multiplied by scaling * log2(e)
    fr = fr * qk_scale
    qc = _query_planes(p_q, o_m, m_m, inv_fc, D_C, GC, 64, C_BITS)
    qr = _query_planes(p_qr, o_m, m_m, inv_fr, D_R, 1, D_R, R_BITS)

    PC: tl.constexpr = 8 // C_BITS
    accs = ()
    for i in tl.static_range(GC * PC):
        accs = accs + (tl.zeros((BLOCK_M, 64 // PC), tl.float32),)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    is_dense = i_s == num_splits

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
        accs, m_i, l_i = _tile(qc, qr, accs, m_i, l_i, p_cc, p_cs, p_cz, p_rc, p_rs, p_rz, s_cct, s_cst, s_rct,
                               s_rst, o_t, m_t, m_m[:, None] & m_t[None, :], fc, fr, BLOCK_M, BLOCK_T, GC, D_R,
                               C_BITS, R_BITS, C_BITS, R_BITS, False)

    # The last split: the sink copies (slot j = position lp + j) and the recent ring (positions [length - R, length)
    # past the sink, slot p % R), causal per query row.
    n_sink = tl.where(is_dense, S, 0)
    p_snc = snc_ptr + i_b * s_sncb
    p_snr = snr_ptr + i_b * s_snrb
    for start in range(0, n_sink, BLOCK_T):
        o_j = start + o_bt
        o_t = lp + o_j
        m_t = (o_j < S) & (o_t < length)
        m_valid = m_m[:, None] & m_t[None, :] & (o_t[None, :] < lim_m[:, None])
        accs, m_i, l_i = _tile(qc, qr, accs, m_i, l_i, p_snc, p_snc, p_snc, p_snr, p_snr, p_snr, s_snct, s_snct,
                               s_snrt, s_snrt, o_j, m_t, m_valid, fc, fr, BLOCK_M, BLOCK_T, GC, D_R, 16, 16,
                               C_BITS, R_BITS, True)
    r_lo = tl.maximum(length - R, 0)
    r_hi = tl.where(is_dense, length, r_lo)
    p_rcc = rcc_ptr + i_b * s_rccb
    p_rcr = rcr_ptr + i_b * s_rcrb
    for start in range(r_lo, r_hi, BLOCK_T):
        o_t = start + o_bt
        m_t = (o_t < r_hi) & (o_t >= lo_valid)
        m_valid = m_m[:, None] & m_t[None, :] & (o_t[None, :] < lim_m[:, None])
        accs, m_i, l_i = _tile(qc, qr, accs, m_i, l_i, p_rcc, p_rcc, p_rcc, p_rcr, p_rcr, p_rcr, s_rcct, s_rcct,
                               s_rcrt, s_rcrt, o_t % R, m_t, m_valid, fc, fr, BLOCK_M, BLOCK_T, GC, D_R, 16, 16,
                               C_BITS, R_BITS, True)

    has = l_i > 0
    inv_l = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
    b_lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    o_row = (i_b * M + o_m) * (num_splits + 1) + i_s  # [BM] index of (b, m, split)
    o_i = tl.arange(0, 64 // PC)
    for g in tl.static_range(GC):
        for k in tl.static_range(PC):
            cols = g * 64 + PC * o_i + k
            tl.store(o_ptr + o_row[:, None] * D_C + cols[None, :], accs[g * PC + k] * inv_l[:, None],
                     mask=m_m[:, None])
    tl.store(lse_ptr + o_row, b_lse, mask=m_m)


def strided_handles(fmt: CacheFormat, q_dtype: torch.dtype, device, copy_dtype: torch.dtype | None = None) -> bool:
    """Whether this kernel computes the case: both paths packed at 2, 4 or 8 bits; content in 1-8 groups of 64;
    RoPE one group of 16-64 elements (a power of two) with at least 16 elements per plane; bf16/fp16 queries and
    copies; a CUDA device of compute capability >= 8 or the Triton interpreter."""
    c, r = fmt.content, fmt.rope
    if not (c.quantized and r.quantized) or c.bits not in (2, 4, 8) or r.bits not in (2, 4, 8):
        return False
    if c.group != 64 or c.dim % 64 or not 1 <= c.n_groups <= 8:
        return False
    if r.n_groups != 1 or r.dim not in (16, 32, 64) or r.dim * r.bits // 8 < 16:
        return False
    if q_dtype not in (torch.bfloat16, torch.float16):
        return False
    if copy_dtype is not None and copy_dtype not in (torch.bfloat16, torch.float16):
        return False
    device = torch.device(device)
    import os

    interpreting = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if device.type == "cuda":
        return interpreting or torch.cuda.get_device_capability(device)[0] >= 8
    return device.type == "cpu" and interpreting


def strided_default_launch(M: int) -> dict:
    """Launch from static sizes (not yet timed: the H200 sweep decides)."""
    return dict(block_m=16, block_t=32, num_warps=4, num_stages=2, waves=8)


def launch_strided(q, qr, cp, rp, fmt, sink_c, sink_r, recent_c, recent_r, lp, length, o_part, lse_part, M, Tq,
                   split_target, NS, qk_scale, block_m, block_t, num_warps, num_stages):
    """Launch the kernel on `q: [B, M, d_c]`, `qr: [B, M, d_R]` (contiguous) into the partials."""
    B = q.shape[0]
    grid = (NS + 1, triton.cdiv(M, block_m), B)
    mla_decode_strided_kernel[grid](
        q, qr, cp["codes"], cp["scale"], cp["zero"], rp["codes"], rp["scale"], rp["zero"],
        sink_c, sink_r, recent_c, recent_r, lp, length, o_part, lse_part,
        M, Tq, split_target, NS, qk_scale,
        q.stride(0), qr.stride(0), cp["codes"].stride(0), cp["codes"].stride(1), cp["scale"].stride(0),
        cp["scale"].stride(1), rp["codes"].stride(0), rp["codes"].stride(1), rp["scale"].stride(0),
        rp["scale"].stride(1),
        sink_c.stride(0), sink_c.stride(1), sink_r.stride(0), sink_r.stride(1),
        recent_c.stride(0), recent_c.stride(1), recent_r.stride(0), recent_r.stride(1),
        D_C=fmt.content.dim, GC=fmt.content.n_groups, C_BITS=fmt.content.bits, D_R=fmt.rope.dim,
        R_BITS=fmt.rope.bits, S=fmt.sink_tokens, R=fmt.recent_tokens, BLOCK_M=block_m, BLOCK_T=block_t,
        num_warps=num_warps, num_stages=num_stages,
    )
