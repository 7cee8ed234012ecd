"""Hopper (sm_90) packed MLA decode in Gluon for many query rows (128 heads): the two-warpgroup program of the
register-operand kernel (`mla_decode_gluon_regs.mla_decode_gluon_kernel` with `WIDE`), 32 rows per program, so each
token is unpacked once per 32 rows instead of 16. Same function, splits, copy programs and partials as the
one-warpgroup program; shared pieces in `mla_decode_gluon_common.py`; design: docs/KERNELS.md.

A program is two warpgroups (`gl.warp_specialize`, one program per SM): the leader unpacks content units 0-3 and the
RoPE unit, the worker units 4-7, into their own score `wgmma`s (`m64n32k16`), each storing its content keys to its
half of `kbuf`; each runs the softmax of half the rows (`_exchange_pv`: partial scores through `sbuf`, rescale
factors through `abuf`) and the value `wgmma`s of its own four units over all rows; at the end the halves' `1 / l`
go through `ibuf`.

Ordering (each barrier counts one arrival per tile, phase `j & 1`): a warpgroup rewrites `sbuf[h]` only after
`p_bar[1 - h]` of the tile before (the other has read it), its P columns and factors only after `s_bar[1 - h]` of
the next tile (the other's value `wgmma`s of the tile before have finished). A column half of the `m64nBM`
accumulator is the `m64n(BM/2)` layout (`_row_halves`, `assert_trivial=True`).
"""

from __future__ import annotations

from quantmla_hf.format import CacheFormat

from .mla_decode_gluon_common import BLOCK_T, HAVE_GLUON, _jit, tile_smem, words_layout

if HAVE_GLUON:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

    from .mla_decode_gluon_common import (
        _batch_planes,
        _copy_rows,
        _copy_tile,
        _cta_barrier,
        _dense_scores,
        _finish,
        _lane_sums,
        _load_group,
        _load_unit,
        _packed_scores,
        _pair_meta,
        _program_rows,
        _references,
        _rescale,
        _row_ptrs,
        _row_steps,
        _split_range,
        _split_rows,
        _store_o,
        _tile_page,
        _tile_rows,
        _values,
    )

BLOCK_M = 32  # query rows per program (each token unpacked once per 32 rows)
# Registers per thread of both warpgroups (at launch, and the worker's after setmaxnreg), per content width. 8 bits:
# the whole register file (the launch asks ptxas for `MAX_REGS`, allocated as 256), where the worker's packed loop
# compiles to 1,060 instructions a tile against 1,107 at 240 (`benchmarks/sass_decode.py C8R8 --wide`, Triton 3.6).
REGS = {2: 240, 4: 240, 8: 256}
MAX_REGS = 255  # registers per thread ptxas takes at most (allocated in steps of 8)
INFLIGHT = 1  # score units whose wgmmas may be in flight while the next is unpacked
FILL_PER_SM = 1  # programs per multiprocessor the splits provide (`ops.backends.fill_splits`): the one resident


# --------------------------------------------------------------------------------------------- one half tile
@_jit
def _row_halves(x, acc_h: gl.constexpr):
    """`[64, BM]` accumulator -> its rows `[0, BM/2)` and `[BM/2, BM)` as two `[64, BM/2]` tensors in `acc_h` (the
    `m64n(BM/2)` accumulator layout: a column half of an `m64nBM` accumulator is a register subset, no data moves)."""
    BM: gl.constexpr = x.shape[1]
    x0, x1 = gl.split(gl.permute(gl.reshape(x, [64, 2, BM // 2]), (0, 2, 1)))
    return gl.convert_layout(x0, acc_h, assert_trivial=True), gl.convert_layout(x1, acc_h, assert_trivial=True)


@_jit
def _exchange_pv(acc, kbuf, pbuf, sbuf, abuf, s_bar, p_bar, ph, f_h, m_valid, m_i, l_p, outs, kz,
                 HF: gl.constexpr, U0: gl.constexpr, acc_l: gl.constexpr, acc_h: gl.constexpr, ibuf=None):
    """One tile's softmax step and value `wgmma`s for warpgroup `HF` (0: leader, 1: worker). `acc`: its partial
    scores `[64, BM]` (its units over all rows); `ph`: the tile's barrier phase. Each warpgroup runs the online
    softmax of its own half of the rows (`[HF * BM/2, + BM/2)`; `f_h`, `m_valid: [64, BM/2]`, `m_i`, `l_p` are that
    half's):

    1. stores its partial scores of the *other* half's rows to `sbuf[HF]`, arrives on `s_bar[HF]`, waits for
       `s_bar[1 - HF]` and adds the other's partial of its own rows;
    2. updates its rows' `m_i` (lazy and voted as `_softmax_pv`, each warp's vote in `ibuf[HF * BM/2 + w]`) and row
       sums, stores its columns of P (fp16, `pbuf`) and its rows' rescale factors (`abuf`, 1 where a row's
       reference did not move), arrives on `p_bar[HF]` and waits for `p_bar[1 - HF]`;
    3. rescales its value accumulators `outs` (all rows) where a factor is not 1, then `o_u^T += kbuf[u]^T P` for
       `u = U0 .. U0 + 3` (waited). Returns `(m_i, l_p, outs)`."""
    BM: gl.constexpr = acc.shape[1]
    HM: gl.constexpr = BM // 2
    col_l: gl.constexpr = gl.SliceLayout(0, acc_l)
    h0, h1 = _row_halves(acc, acc_h)
    if HF == 0:
        mine = h0
        sbuf.index(0).store(h1)
    else:
        mine = h1
        sbuf.index(1).store(h0)
    _cta_barrier()  # every warp of this warpgroup has stored its part
    mbarrier.arrive(s_bar.index(HF), count=1)
    mbarrier.wait(s_bar.index(1 - HF), ph)
    mine = mine + sbuf.index(1 - HF).load(acc_h)
    b_s = gl.where(m_valid, mine * f_h[None, :], float("-inf"))
    m_new = m_i
    p = gl.exp2(b_s - gl.where(m_i == float("-inf"), 0.0, m_i)[None, :])
    up = (b_s > (m_i + 8.0)[None, :]).to(gl.int32)  # an integer maximum per warp is one REDUX
    ibuf.slice(HF * HM, 4).store(gl.max(gl.reshape(up, [4, 16 * HM]), axis=1).to(gl.float32))  # warp w: 16 w..
    pbuf.index(kz).slice(HF * HM, HM, dim=1).store(p.to(gl.float16))
    abuf.slice(HF * HM, HM).store(gl.full([HM], 1.0, gl.float32, m_i.type.layout))
    fence_async_shared()  # P (and this warpgroup's kbuf half) visible to the wgmmas
    _cta_barrier()
    if gl.max(ibuf.slice(HF * HM, 4).load(gl.BlockedLayout([4], [32], [4], [0])), axis=0) > 0:
        move, m_new, m_use, p = _references(b_s, m_i)
        alpha_h = gl.where(move, gl.exp2(m_i - m_use), 1.0)
        l_p = l_p * gl.convert_layout(alpha_h, gl.SliceLayout(0, gl.SliceLayout(1, l_p.type.layout)))[None, None, :]
        pbuf.index(kz).slice(HF * HM, HM, dim=1).store(p.to(gl.float16))
        abuf.slice(HF * HM, HM).store(alpha_h)
        fence_async_shared()
        _cta_barrier()
    l_p = l_p + _lane_sums(p)
    mbarrier.arrive(p_bar.index(HF), count=1)
    mbarrier.wait(p_bar.index(1 - HF), ph)
    alpha = abuf.load(col_l)
    if gl.max((alpha != 1.0).to(gl.int32), axis=0) > 0:
        outs = _rescale(outs, alpha)
    return m_new, l_p, _values(kbuf, pbuf, outs, U0, kz)


# --------------------------------------------------------------------------------------------- one warpgroup
@_jit
def _half_program(LEAD: gl.constexpr, fbuf, qbuf, qlo, kbuf, pbuf, sbuf, abuf, ibuf, s_bar, p_bar,
                  cc_ptr, cs_ptr, cz_ptr, rc_ptr, rs_ptr, rz_ptr, snc_ptr, snr_ptr, rcc_ptr, rcr_ptr, lp_ptr,
                  len_ptr, o_ptr, lse_ptr, M, Tq, split_target, num_splits,
                  s_ccb, s_csb, s_rcb, s_rsb, s_sncb, s_snct, s_snrb, s_snrt, s_rccb, s_rcct, s_rcrb, s_rcrt,
                  pt_ptr, s_pt, GC: gl.constexpr, C_BITS: gl.constexpr, R_BITS: gl.constexpr, S: gl.constexpr,
                  R: gl.constexpr, BM: gl.constexpr, Q_SPLIT: gl.constexpr, INFLIGHT: gl.constexpr,
                  PAGED: gl.constexpr):
    """The leader's (`LEAD`: content units 0-3, the RoPE unit, the softmax of rows `[0, BM/2)`, outputs 0-3) or the
    worker's (content units 4-7, the softmax of rows `[BM/2, BM)`, outputs 4-7) share of every tile of the program
    (its split, row block and batch row); each stores the LSE of its rows. `fbuf: [BM]` the rows' score factors
    (staged once). `PAGED`: as in `mla_decode_gluon_kernel`."""
    BT: gl.constexpr = 64
    D_C: gl.constexpr = GC * 64
    U0: gl.constexpr = 0 if LEAD else 4
    WC_L: gl.constexpr = words_layout(C_BITS // 2)  # one content unit's words
    WP_L: gl.constexpr = words_layout(C_BITS)  # two units'
    WR_L: gl.constexpr = words_layout(R_BITS // 2)
    XL: gl.constexpr = words_layout(16)
    HF: gl.constexpr = 0 if LEAD else 1
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 16])
    dot_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=2)
    col_l: gl.constexpr = gl.SliceLayout(0, acc_l)
    HM: gl.constexpr = BM // 2  # the rows whose softmax this warpgroup runs: [HF * HM, + HM)
    acc_h: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HM, 16])
    col_h: gl.constexpr = gl.SliceLayout(0, acc_h)
    row_h: gl.constexpr = gl.SliceLayout(1, acc_h)
    ml: gl.constexpr = gl.SliceLayout(2, WC_L)
    RWC: gl.constexpr = GC * 2 * C_BITS  # code words per token row
    RWR: gl.constexpr = 2 * R_BITS

    ND: gl.constexpr = (S + BT - 1) // BT + (R + BT - 1) // BT
    i_s, i_hb, i_b, length, lp, i_c = _program_rows(num_splits, M, len_ptr, lp_ptr, BM, ND, PAGED)
    o_m = i_hb * BM + gl.arange(0, BM, layout=col_l)
    m_m = o_m < M
    o_mh = i_hb * BM + HF * HM + gl.arange(0, HM, layout=col_h)
    m_mh = o_mh < M
    lim_mh = length - Tq + (o_mh % Tq) + 1
    f_h = fbuf.slice(HF * HM, HM).load(col_h)
    base, lo_valid, hi, n_tiles = _split_range(i_s, num_splits, length, split_target, lp, S, R, BT, C_BITS)
    p_cc, p_rc, p_cs, p_cz, p_rs, p_rz = _batch_planes(cc_ptr, cs_ptr, cz_ptr, rc_ptr, rs_ptr, rz_ptr, i_b, s_ccb,
                                                       s_csb, s_rcb, s_rsb)

    m_i = gl.full([HM], float("-inf"), gl.float32, col_h)
    l_p = _lane_sums(gl.zeros([BT, HM], gl.float32, acc_h))
    outs = ()  # the value accumulators `o_u^T: [64, BM]` of units U0 .. U0 + 3
    for u in gl.static_range(4):
        outs = outs + (gl.zeros([64, BM], gl.float32, acc_l),)

    # ROWS (all but the contiguous 8-bit launch): the register kernel's loads (int32 positions relative to the split,
    # row pointers); else int64 positions and masked loads. Positions `[lo, hi)` are valid; word loads end at `last`.
    ROWS: gl.constexpr = PAGED or C_BITS != 8
    if ROWS:
        lo, hi, last, p_pt, p_cc, p_rc, p_cs, p_cz, p_rs, p_rz, row, shift = _split_rows(
            p_cc, p_rc, p_cs, p_cz, p_rs, p_rz, pt_ptr, s_pt, i_b, base, lo_valid, hi, n_tiles, GC, C_BITS, R_BITS, BT,
            PAGED)
        t_first = 0
        pw = _row_ptrs(p_cc, row, RWC, 2 * C_BITS, WP_L)
    else:
        lo = lo_valid
        last = hi
        t_first = base
        p_pt = pt_ptr
        shift = 0
        pw = p_cc
    ca = _load_unit(pw, t_first, lo, last, U0, RWC, C_BITS, GC, WP_L, 2, ROWS)
    cb = _load_unit(pw, t_first, lo, last, U0 + 2, RWC, C_BITS, GC, WP_L, 2, ROWS)
    s0, z0 = _load_group(p_cs, p_cz, t_first, lo, hi, 4 * HF, GC, ml, ROWS, last, shift)
    if LEAD:
        pr = _row_ptrs(p_rc, row, RWR, R_BITS // 2, WR_L) if ROWS else p_rc
        cr = _load_unit(pr, t_first, lo, last, GC, RWR, R_BITS, GC, WR_L, 1, ROWS)
        sr, zr = _load_group(p_rs, p_rz, t_first, lo, hi, 0, 0, ml, ROWS, last, shift)
    o_bt = gl.arange(0, BT, layout=row_h) if ROWS else gl.arange(0, BT, layout=row_h).to(gl.int64)
    if not LEAD:
        cr = ca
        sr = s0
        zr = z0
    ph = 0
    page_n = _tile_page(p_pt, BT, last, PAGED)  # tile 1's page (each later one is loaded a tile ahead)
    for it in range(n_tiles):
        t0 = t_first + it * BT
        tn = t0 + BT
        page_nn = _tile_page(p_pt, tn + BT, last, PAGED)
        zz, ss, zh = _pair_meta(s0, z0, C_BITS)
        zzr, ssr, zhr = _pair_meta(sr, zr, R_BITS)
        s_row = _row_steps(sr, acc_l, R_BITS if LEAD else 0)  # the leader scores the RoPE unit
        row, shift = _tile_rows(page_n, tn, last, PAGED)
        page_n = page_nn
        s0, z0 = _load_group(p_cs, p_cz, tn, lo, hi, 4 * HF, GC, ml, ROWS, last, shift)
        if LEAD:
            sr, zr = _load_group(p_rs, p_rz, tn, lo, hi, 0, 0, ml, ROWS, last, shift)
        pc = _row_ptrs(p_cc, row, RWC, 2 * C_BITS, WP_L) if ROWS else p_cc
        pr = _row_ptrs(p_rc, row, RWR, R_BITS // 2, WR_L) if ROWS else p_rc
        kz = it >> 30  # zero at run time, unknown to the compiler: keeps the descriptors in the loop
        acc, ca, cb, _, _, cr = _packed_scores(
            ca, cb, ca, cb, cr, zz, ss, zh, zz, ss, zh, zzr, ssr, zhr, s_row, qbuf, qlo, kbuf, kz, pc, pr, tn, lo, last,
            U0, 4, LEAD, GC, BM, Q_SPLIT, C_BITS, R_BITS, INFLIGHT, WC_L, WP_L, WR_L, acc_l, dot_a, ROWS)
        o_t = t0 + o_bt
        m_valid = ((o_t >= lo) & (o_t < hi))[:, None] & m_mh[None, :]
        m_i, l_p, outs = _exchange_pv(acc, kbuf, pbuf, sbuf, abuf, s_bar, p_bar, ph, f_h, m_valid, m_i, l_p, outs,
                                      kz, HF, U0, acc_l, acc_h, ibuf)
        ph = ph ^ 1

    o_bt = gl.arange(0, BT, layout=row_h).to(gl.int64)
    o_dt = gl.arange(0, BT, layout=gl.SliceLayout(1, gl.SliceLayout(2, XL))).to(gl.int64)
    if i_s >= num_splits:  # a copy program: its one tile
        lo_c, hi_c, sink, p_c, p_r, s_ct, s_rt = _copy_tile(i_s, num_splits, length, i_c, snc_ptr, snr_ptr,
                                                             rcc_ptr, rcr_ptr, s_sncb, s_snct, s_snrb, s_snrt, s_rccb,
                                                             s_rcct, s_rcrb, s_rcrt, S, R, BT)
        kz, slot, m_t, m_valid = _copy_rows(lo_c, hi_c, sink, lp, length, o_dt, o_bt, lim_mh, m_mh, S, R)
        acc = _dense_scores(p_c, p_r, slot, m_t, s_ct, s_rt, qbuf, qlo, kbuf, kz, U0, 4, LEAD, GC, BM, Q_SPLIT, C_BITS,
                            R_BITS, INFLIGHT, XL, acc_l, dot_a)
        m_i, l_p, outs = _exchange_pv(acc, kbuf, pbuf, sbuf, abuf, s_bar, p_bar, ph, f_h, m_valid, m_i, l_p, outs,
                                      kz, HF, U0, acc_l, acc_h, ibuf)
        ph = ph ^ 1

    o_row = (i_b * M + o_m) * (num_splits + ND) + i_s
    l_i = gl.convert_layout(gl.sum(gl.reshape(l_p, [32, HM]), axis=0), col_h)  # the lanes' sums (`_lane_sums`)
    inv_lh, b_lse = _finish(l_i, m_i, o_ptr)
    gl.store(lse_ptr + (i_b * M + o_mh) * (num_splits + ND) + i_s, b_lse, mask=m_mh)
    ibuf.slice(HF * HM, HM).store(inv_lh)
    _cta_barrier()
    mbarrier.arrive(p_bar.index(HF), count=1)
    mbarrier.wait(p_bar.index(1 - HF), ph)
    inv_l = ibuf.load(col_l)
    for u in gl.static_range(4):
        _store_o(o_ptr, o_row, m_m, outs[u], inv_l, U0 + u, GC, D_C, C_BITS)


# --------------------------------------------------------------------------------------------- host side
def smem_bytes(fmt: CacheFormat, q_split: bool) -> int:
    """Shared memory of one program: `tile_smem`, the partial scores `[64, BM]` fp32, the rescale factors and `1 / l`
    (`[BM]` fp32 each) and two mbarriers."""
    return tile_smem(fmt, q_split, BLOCK_M) + BLOCK_T * BLOCK_M * 4 + 2 * BLOCK_M * 4 + 16


def wide_handles(fmt: CacheFormat) -> bool:
    """Whether this kernel takes the format (besides `hopper_handles`): 8 content groups (the two warpgroups take
    four each), 2- or 4-bit content with 4- or 8-bit RoPE (C4R4, C2R4, C4R8, C2R8), or 8-bit content and RoPE
    (C8R8)."""
    c, r = fmt.content.bits, fmt.rope.bits
    return fmt.content.n_groups == 8 and ((c in (2, 4) and r in (4, 8)) or (c == 8 and r == 8))
