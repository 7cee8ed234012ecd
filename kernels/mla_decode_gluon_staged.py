"""Hopper (sm_90) packed MLA decode in Gluon for many query rows (128 heads), the keys staged in shared memory once
per tile for 64 rows: same function, splits, copy programs and partials as `mla_decode_gluon_regs` (reference:
`mla_decode_ref.mla_decode_static_ref`; the `PAGED` launch: `mla_decode_paged_ref`); shared pieces in
`mla_decode_gluon_common.py`; design: docs/KERNELS.md.

A program is three warpgroups (`gl.warp_specialize`, one program per SM) over 64 query rows:

- the producer (`_producer`, a worker at `P_REGS` registers) loads each tile's code words and metadata a tile
  ahead, unpacks the 8 content units and the RoPE unit (`half_asm`, keys `(code - z) * s` rounded once to fp16) and
  stores them to a two-stage ring of key tiles, `kbuf[u]: [2, 64, 64]` fp16 (`_v_view` column order), then arrives
  on `full[stage]`; a copy program stores its one tile of model-dtype copies the same way;
- two consumers (`_row_consumer`, the default warps and a worker at `C_REGS`), 32 rows each, wait on
  `full[stage]`, take the tile's scores `S^T: [64 tokens, 32]` (`m64n32k16`, keys as A, their rows' queries `qbuf`
  staged once in the key tile's column order as B), online softmax and values `O^T += K^T P` (P through their own
  `pbuf`) from shared memory, and arrive on `empty[stage]`; the producer waits on it before it rewrites the stage.
  Each issues the next tile's scores before it waits for this tile's values (software pipelining).

Every token is unpacked once per 64 rows, by warps that do nothing else. Shared memory: keys 2 x 9 x 8 KB, queries
2 x 9 x 4 KB and P 2 x 4 KB (224 KB).
"""

from __future__ import annotations

import torch

from quantmla_hf.format import CacheFormat

from .mla_decode_gluon_common import BLOCK_T, GROUP, HAVE_GLUON, _jit, _jit_dynamic, launch_flat, words_layout

if HAVE_GLUON:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from .mla_decode_gluon_common import (
        _batch_planes,
        _copy_slots,
        _copy_tile,
        _cta_barrier,
        _finish,
        _lane_sums,
        _load_dense,
        _load_meta_rows,
        _load_unit,
        _pair_meta,
        _program_rows,
        _row_ptrs,
        _softmax_pv,
        _split_range,
        _split_rows,
        _split_units,
        _stage_queries,
        _store_o,
        _tile_page,
        _tile_rows,
        _unit_buffers,
        _unpack_unit,
        _v_view,
    )

BLOCK_M = 64  # query rows per program: two consumers of 32
STAGES = 2  # key tiles in the ring
# Registers per thread of (the consumer worker, the producer), per content width; the default consumer gets what
# the register file has left for it (8 fewer than the worker).
REGS = {2: (216, 80), 4: (208, 96)}
LAUNCH_REGS = 168  # at launch, for all 12 warps (65,536 / 384 rounded down to 8)
FILL_PER_SM = 1  # programs per multiprocessor the splits provide (`ops.backends.fill_splits`)


# --------------------------------------------------------------------------------------------- the consumers
@_jit
def _consumer_tiles(i_s, num_splits, length, split_target, lp, i_c, snc_ptr, snr_ptr, rcc_ptr, rcr_ptr, s_sncb, s_snct,
                    s_snrb, s_snrt, s_rccb, s_rcct, s_rcrb, s_rcrt, S: gl.constexpr, R: gl.constexpr,
                    C_BITS: gl.constexpr):
    """The tiles a consumer attends, as int32: `(n_tiles, n_all, t_base, lo, hi, c_t0, c_lo, c_hi)`, the split's
    packed tiles from `t_base` valid in `[lo, hi)` (`_split_range`), then (a copy program, `n_all = n_tiles + 1`) the
    copy tile at `c_t0` valid in `[c_lo, c_hi)` (`_copy_rows`'s mask)."""
    BT: gl.constexpr = 64
    base, lo_valid, hi, n_tiles = _split_range(i_s, num_splits, length, split_target, lp, S, R, BT, C_BITS)
    lo_c, hi_c, sink, _, _, _, _ = _copy_tile(i_s, num_splits, length, i_c, snc_ptr, snr_ptr, rcc_ptr, rcr_ptr, s_sncb,
                                              s_snct, s_snrb, s_snrt, s_rccb, s_rcct, s_rcrb, s_rcrt, S, R, BT)
    shift = gl.where(sink, lp, 0)
    c_t0 = (lo_c + shift).to(gl.int32)
    c_lo = gl.maximum(gl.where(sink, lp, lp + S), lo_c + shift).to(gl.int32)
    c_hi = gl.minimum(hi_c + shift, length).to(gl.int32)
    n_all = n_tiles + (i_s >= num_splits).to(gl.int32)  # tiles in the ring: the packed ones, then a copy tile
    t_base = base.to(gl.int32)
    lo = lo_valid.to(gl.int32)
    hi = hi.to(gl.int32)
    return n_tiles, n_all, t_base, lo, hi, c_t0, c_lo, c_hi


@_jit
def _row_scores(kbuf, qbuf, st, kz, GC: gl.constexpr, HM: gl.constexpr, acc_l: gl.constexpr):
    """Issue the scores `S^T: [64, HM]` of key stage `st` against the staged queries, `sum_u kbuf[u][st] @
    qbuf[u]^T` (both operands in shared memory), without waiting. `kz`: a run-time zero (the queries' descriptors
    are made where they are used instead of being held in registers across the loop)."""
    acc = gl.zeros([64, HM], gl.float32, acc_l)
    for u in gl.static_range(GC + 1):
        acc = warpgroup_mma(kbuf[u].index(st), qbuf[u].index(kz).permute((1, 0)), acc, use_acc=u > 0, is_async=True)
    return acc


@_jit
def _row_consumer(HF: gl.constexpr, kbuf, qbuf, pbuf, vbuf, full, empty, q_ptr, qr_ptr, snc_ptr, snr_ptr, rcc_ptr,
                  rcr_ptr, lp_ptr, len_ptr, o_ptr, lse_ptr, M, Tq, split_target, num_splits, qk_scale, s_qb, s_qrb,
                  s_sncb, s_snct, s_snrb, s_snrt, s_rccb, s_rcct, s_rcrb, s_rcrt, GC: gl.constexpr,
                  C_BITS: gl.constexpr, R_BITS: gl.constexpr, S: gl.constexpr, R: gl.constexpr, BM: gl.constexpr,
                  PAGED: gl.constexpr):
    """Consumer `HF` (0: the default warps, 1: a worker): rows `[HF * BM/2, + BM/2)` of the program's block over
    the tiles of its split, then (a copy program) its copy tile, its partial outputs and LSE. Software-pipelined:
    the next tile's scores are issued while this tile's values run; the last tile issues its own scores again (an
    extra product of one tile, never read, instead of a branch)."""
    BT: gl.constexpr = 64
    NST: gl.constexpr = 2  # STAGES
    HM: gl.constexpr = BM // 2
    D_C: gl.constexpr = GC * 64
    ND: gl.constexpr = (S + BT - 1) // BT + (R + BT - 1) // BT
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HM, 16])
    col_l: gl.constexpr = gl.SliceLayout(0, acc_l)
    row_l: gl.constexpr = gl.SliceLayout(1, acc_l)
    q_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])

    i_s, i_hb, i_b, length, lp, i_c = _program_rows(num_splits, M, len_ptr, lp_ptr, BM, ND, PAGED)
    row0 = i_hb * BM + HF * HM
    f = _stage_queries(qbuf, qbuf, q_ptr + i_b * s_qb, qr_ptr + i_b * s_qrb, row0, M, D_C, GC, HM, False, C_BITS,
                       R_BITS, q_l, True)
    f = gl.convert_layout(f, col_l) * qk_scale  # scores in base 2, pre-multiplied by scaling * log2(e)
    fence_async_shared()
    _cta_barrier()  # the staged queries visible to this warpgroup's wgmmas

    o_m = row0 + gl.arange(0, HM, layout=col_l)
    m_m = o_m < M
    lim_m = (length - Tq + (o_m % Tq) + 1).to(gl.int32)  # query t of Tq sees positions < length - Tq + t + 1
    m_i = gl.full([HM], float("-inf"), gl.float32, col_l)
    l_p = _lane_sums(gl.zeros([BT, HM], gl.float32, acc_l))  # the row sums per thread (`_lane_sums`)
    outs = ()  # the value accumulators `o_u^T: [64, HM]` of the content units
    for u in gl.static_range(GC):
        outs = outs + (gl.zeros([64, HM], gl.float32, acc_l),)
    n_tiles, n_all, t_base, lo, hi, c_t0, c_lo, c_hi = _consumer_tiles(
        i_s, num_splits, length, split_target, lp, i_c, snc_ptr, snr_ptr, rcc_ptr, rcr_ptr, s_sncb, s_snct, s_snrb,
        s_snrt, s_rccb, s_rcct, s_rcrb, s_rcrt, S, R, C_BITS)
    o_bt = gl.arange(0, BT, layout=row_l)

    mbarrier.wait(full.index(0), 0)  # (an empty split's producer arrives on it with nothing stored)
    acc = _row_scores(kbuf, qbuf, 0, 0, GC, HM, acc_l)
    for it in range(n_all):
        st = it % NST
        kz = it >> 30  # zero at run time, unknown to the compiler
        acc = warpgroup_mma_wait(0, deps=[acc])
        packed = it < n_tiles
        p_t = gl.where(packed, t_base + it * BT, c_t0) + o_bt  # the tile's positions
        p_lo = gl.where(packed, lo, c_lo)
        p_hi = gl.where(packed, hi, c_hi)
        m_valid = (((p_t >= p_lo) & (p_t < p_hi))[:, None] & m_m[None, :]) & (p_t[:, None] < lim_m[None, :])
        m_i, l_p, pv = _softmax_pv(acc, kbuf, pbuf, f, m_valid, m_i, l_p, outs, kz, vbuf, st, True)
        nxt = gl.minimum(it + 1, n_all - 1)  # the next tile (the last one: itself, whose stage is still full)
        mbarrier.wait(full.index(nxt % NST), (nxt // NST) & 1)
        acc = _row_scores(kbuf, qbuf, nxt % NST, kz, GC, HM, acc_l)
        outs = warpgroup_mma_wait(1, deps=pv)
        mbarrier.arrive(empty.index(st), count=1)
    acc = warpgroup_mma_wait(0, deps=[acc])

    inv_l, b_lse = _finish(gl.convert_layout(gl.sum(gl.reshape(l_p, [32, HM]), axis=0), col_l), m_i)
    o_row = (i_b * M + o_m) * (num_splits + ND) + i_s
    for u in gl.static_range(GC):
        _store_o(o_ptr, o_row, m_m, outs[u], inv_l, u, GC, D_C, C_BITS)
    gl.store(lse_ptr + o_row, b_lse, mask=m_m)


# --------------------------------------------------------------------------------------------- the producer
@_jit
def _stage_pair(cp, u: gl.constexpr, zz, ss, zh, kbuf, st, p_c, tn, lo, last, GC: gl.constexpr,
                C_BITS: gl.constexpr, wc_l: gl.constexpr, wp_l: gl.constexpr):
    """Content units u and u + 1 (words `cp: [64, 4, 2 WU]`) unpacked into key stage `st`; returns the words of the
    tile at `tn` (row pointers `p_c`, rows up to `last`)."""
    c0, c1 = _split_units(cp, C_BITS // 2, wc_l)
    x5, _ = _unpack_unit(c0, zz, ss, zh, C_BITS, wc_l)
    kbuf[u].index(st).store(_v_view(x5))
    x5, _ = _unpack_unit(c1, zz, ss, zh, C_BITS, wc_l)
    kbuf[u + 1].index(st).store(_v_view(x5))
    return _load_unit(p_c, tn, lo, last, u, GC * 2 * C_BITS, C_BITS, GC, wp_l, 2, True)


@_jit
def _producer(kbuf, full, empty, cc_ptr, cs_ptr, cz_ptr, rc_ptr, rs_ptr, rz_ptr, snc_ptr, snr_ptr, rcc_ptr, rcr_ptr,
              lp_ptr, len_ptr, M, split_target, num_splits, s_ccb, s_csb, s_rcb, s_rsb, s_sncb, s_snct, s_snrb,
              s_snrt, s_rccb, s_rcct, s_rcrb, s_rcrt, pt_ptr, s_pt, GC: gl.constexpr, C_BITS: gl.constexpr,
              R_BITS: gl.constexpr, S: gl.constexpr, R: gl.constexpr, BM: gl.constexpr, PAGED: gl.constexpr):
    """Every tile of the program's split (int32 positions relative to its first tile, row pointers, the next tile's
    words and metadata loaded while this one is unpacked; `PAGED`: through the page numbers, a tile ahead), or its
    copy tile, into the key ring."""
    BT: gl.constexpr = 64
    NST: gl.constexpr = 2  # STAGES
    ND: gl.constexpr = (S + BT - 1) // BT + (R + BT - 1) // BT
    WC_L: gl.constexpr = words_layout(C_BITS // 2)  # one content unit's words
    WP_L: gl.constexpr = words_layout(C_BITS)  # two units'
    WR_L: gl.constexpr = words_layout(R_BITS // 2)  # the RoPE unit's
    XL: gl.constexpr = words_layout(16)  # the copies' 16 channels per quad slot
    ml: gl.constexpr = gl.SliceLayout(2, WC_L)
    RWC: gl.constexpr = GC * 2 * C_BITS  # code words per token row
    RWR: gl.constexpr = 2 * R_BITS

    i_s, i_hb, i_b, length, lp, i_c = _program_rows(num_splits, M, len_ptr, lp_ptr, BM, ND, PAGED)
    base, lo_valid, hi, n_tiles = _split_range(i_s, num_splits, length, split_target, lp, S, R, BT, C_BITS)
    p_cc, p_rc, p_cs, p_cz, p_rs, p_rz = _batch_planes(cc_ptr, cs_ptr, cz_ptr, rc_ptr, rs_ptr, rz_ptr, i_b, s_ccb,
                                                       s_csb, s_rcb, s_rsb)
    lo, hi, last, p_pt, p_cc, p_rc, p_cs, p_cz, p_rs, p_rz, row, shift = _split_rows(
        p_cc, p_rc, p_cs, p_cz, p_rs, p_rz, pt_ptr, s_pt, i_b, base, lo_valid, hi, n_tiles, GC, C_BITS, R_BITS, BT,
        PAGED)
    pw = _row_ptrs(p_cc, row, RWC, 2 * C_BITS, WP_L)
    c01 = _load_unit(pw, 0, lo, last, 0, RWC, C_BITS, GC, WP_L, 2, True)
    c23 = _load_unit(pw, 0, lo, last, 2, RWC, C_BITS, GC, WP_L, 2, True)
    c45 = _load_unit(pw, 0, lo, last, 4, RWC, C_BITS, GC, WP_L, 2, True)
    c67 = _load_unit(pw, 0, lo, last, 6, RWC, C_BITS, GC, WP_L, 2, True)
    cr = _load_unit(_row_ptrs(p_rc, row, RWR, R_BITS // 2, WR_L), 0, lo, last, GC, RWR, R_BITS, GC, WR_L, 1, True)
    s0, z0, s1, z1, sr, zr = _load_meta_rows(p_cs, p_cz, p_rs, p_rz, 0, lo, hi, last, shift, GC, ml)
    page_n = _tile_page(p_pt, BT, last, PAGED)  # tile 1's page (each later one is loaded a tile ahead)
    for it in range(n_tiles):
        st = it % NST
        tn = it * BT + BT
        page_nn = _tile_page(p_pt, tn + BT, last, PAGED)
        zz0, ss0, zh0 = _pair_meta(s0, z0, C_BITS)
        zz1, ss1, zh1 = _pair_meta(s1, z1, C_BITS)
        zzr, ssr, zhr = _pair_meta(sr, zr, R_BITS)
        row, shift = _tile_rows(page_n, tn, last, PAGED)
        page_n = page_nn
        s0, z0, s1, z1, sr, zr = _load_meta_rows(p_cs, p_cz, p_rs, p_rz, tn, lo, hi, last, shift, GC, ml)
        pc = _row_ptrs(p_cc, row, RWC, 2 * C_BITS, WP_L)
        pr = _row_ptrs(p_rc, row, RWR, R_BITS // 2, WR_L)
        # the consumers have finished reading this stage's tile of two tiles ago
        mbarrier.wait(empty.index(st), ((it // NST) + 1) & 1, pred=it >= NST)
        c01 = _stage_pair(c01, 0, zz0, ss0, zh0, kbuf, st, pc, tn, lo, last, GC, C_BITS, WC_L, WP_L)
        c23 = _stage_pair(c23, 2, zz0, ss0, zh0, kbuf, st, pc, tn, lo, last, GC, C_BITS, WC_L, WP_L)
        c45 = _stage_pair(c45, 4, zz1, ss1, zh1, kbuf, st, pc, tn, lo, last, GC, C_BITS, WC_L, WP_L)
        c67 = _stage_pair(c67, 6, zz1, ss1, zh1, kbuf, st, pc, tn, lo, last, GC, C_BITS, WC_L, WP_L)
        x5, _ = _unpack_unit(cr, zzr, ssr, zhr, R_BITS, WR_L)
        kbuf[GC].index(st).store(_v_view(x5))
        cr = _load_unit(pr, tn, lo, last, GC, RWR, R_BITS, GC, WR_L, 1, True)
        fence_async_shared()  # this warpgroup's stores visible to the consumers' wgmmas
        _cta_barrier()
        mbarrier.arrive(full.index(st), count=1)

    if n_tiles == 0 and i_s < num_splits:  # a split past the data: the consumers' first wait passes
        mbarrier.arrive(full.index(0), count=1)
    if i_s >= num_splits:  # a copy program: its one tile of model-dtype copies, into stage 0
        lo_c, hi_c, sink, p_c, p_r, s_ct, s_rt = _copy_tile(i_s, num_splits, length, i_c, snc_ptr, snr_ptr,
                                                             rcc_ptr, rcr_ptr, s_sncb, s_snct, s_snrb, s_snrt, s_rccb,
                                                             s_rcct, s_rcrb, s_rcrt, S, R, BT)
        o_dt = gl.arange(0, BT, layout=gl.SliceLayout(1, gl.SliceLayout(2, XL))).to(gl.int64)
        slot, m_t = _copy_slots(lo_c, hi_c, sink, lp, length, o_dt, S, R)
        for u in gl.static_range(GC):
            kbuf[u].index(0).store(_v_view(_load_dense(p_c, slot, m_t, s_ct, u, GC, C_BITS, XL)))
        kbuf[GC].index(0).store(_v_view(_load_dense(p_r, slot, m_t, s_rt, GC, GC, R_BITS, XL)))
        fence_async_shared()
        _cta_barrier()
        mbarrier.arrive(full.index(0), count=1)


# --------------------------------------------------------------------------------------------- the kernel
@_jit
def _ring_barriers(NST: gl.constexpr):
    """The key ring's mbarriers, initialised: `full[stage]` (the producer's one arrival) and `empty[stage]` (one
    arrival of each consumer)."""
    full = gl.allocate_shared_memory(gl.int64, [NST, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NST, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NST):
        mbarrier.init(full.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    return full, empty


@_jit_dynamic
def mla_decode_staged_kernel(
    q_ptr, qr_ptr,
    cc_ptr, cs_ptr, cz_ptr, rc_ptr, rs_ptr, rz_ptr,
    snc_ptr, snr_ptr, rcc_ptr, rcr_ptr, lp_ptr, len_ptr,
    o_ptr, lse_ptr,
    M, Tq, split_target, num_splits, qk_scale,
    s_qb, s_qrb, s_ccb, s_csb, s_rcb, s_rsb,
    s_sncb, s_snct, s_snrb, s_snrt, s_rccb, s_rcct, s_rcrb, s_rcrt,
    GC: gl.constexpr, C_BITS: gl.constexpr, R_BITS: gl.constexpr, S: gl.constexpr, R: gl.constexpr,
    BM: gl.constexpr, Q_SPLIT: gl.constexpr, pt_ptr, s_pt, PAGED: gl.constexpr, C_REGS: gl.constexpr,
    P_REGS: gl.constexpr,
):
    """One program per split, block of 64 rows and batch row (`_program_coords`; the last `ND` splits attend one
    copied tile each): the producer and two consumers of the module docstring over shared key stages. `PAGED`: as
    in `mla_decode_gluon_regs.mla_decode_gluon_kernel`. `C_REGS`, `P_REGS`: the consumer worker's and the producer's
    registers."""
    BT: gl.constexpr = 64
    NST: gl.constexpr = 2  # STAGES
    HM: gl.constexpr = BM // 2
    k_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    v_sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    kbuf = _unit_buffers(GC + 1, BT, k_sl, NST)
    p_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=2 * HM, element_bitwidth=16, rank=2)
    qbuf0 = _unit_buffers(GC + 1, HM, k_sl)
    qbuf1 = _unit_buffers(GC + 1, HM, k_sl)
    pbuf0 = gl.allocate_shared_memory(gl.float16, [1, BT, HM], p_sl)
    pbuf1 = gl.allocate_shared_memory(gl.float16, [1, BT, HM], p_sl)
    vbuf0 = gl.allocate_shared_memory(gl.int32, [4], v_sl)
    vbuf1 = gl.allocate_shared_memory(gl.int32, [4], v_sl)
    full, empty = _ring_barriers(NST)
    fence_async_shared()
    # (the argument tuples are written out: a tuple held in a variable would turn the constexprs into tensors)
    gl.warp_specialize([
        (_row_consumer, (0, kbuf, qbuf0, pbuf0, vbuf0, full, empty, q_ptr, qr_ptr, snc_ptr, snr_ptr, rcc_ptr,
                         rcr_ptr, lp_ptr, len_ptr, o_ptr, lse_ptr, M, Tq, split_target, num_splits, qk_scale, s_qb,
                         s_qrb, s_sncb, s_snct, s_snrb, s_snrt, s_rccb, s_rcct, s_rcrb, s_rcrt, GC, C_BITS, R_BITS,
                         S, R, BM, PAGED)),
        (_row_consumer, (1, kbuf, qbuf1, pbuf1, vbuf1, full, empty, q_ptr, qr_ptr, snc_ptr, snr_ptr, rcc_ptr,
                         rcr_ptr, lp_ptr, len_ptr, o_ptr, lse_ptr, M, Tq, split_target, num_splits, qk_scale, s_qb,
                         s_qrb, s_sncb, s_snct, s_snrb, s_snrt, s_rccb, s_rcct, s_rcrb, s_rcrt, GC, C_BITS, R_BITS,
                         S, R, BM, PAGED)),
        (_producer, (kbuf, full, empty, cc_ptr, cs_ptr, cz_ptr, rc_ptr, rs_ptr, rz_ptr, snc_ptr, snr_ptr, rcc_ptr,
                     rcr_ptr, lp_ptr, len_ptr, M, split_target, num_splits, s_ccb, s_csb, s_rcb, s_rsb, s_sncb,
                     s_snct, s_snrb, s_snrt, s_rccb, s_rcct, s_rcrb, s_rcrt, pt_ptr, s_pt, GC, C_BITS, R_BITS, S,
                     R, BM, PAGED)),
    ], [4, 4], [C_REGS, P_REGS])


# --------------------------------------------------------------------------------------------- host side
def smem_bytes(fmt: CacheFormat, q_split: bool) -> int:
    """Shared memory of one program: the key ring `[STAGES, GC + 1, 64, 64]` fp16 and its barriers, plus 1 KB of
    compiler scratch, and each consumer's queries `[GC + 1, 32, 64]` fp16, P `[64, 32]` fp16 and votes."""
    gc = fmt.content.n_groups
    ring = STAGES * (gc + 1) * BLOCK_T * GROUP * 2 + 2 * STAGES * 8 + 1024
    return ring + 2 * ((gc + 1) * (BLOCK_M // 2) * GROUP * 2 + BLOCK_T * (BLOCK_M // 2) * 2 + 16)


def staged_handles(fmt: CacheFormat) -> bool:
    """Whether this kernel takes the format (besides `hopper_handles`): 8 content groups at 2 or 4 bits with 2- or
    4-bit RoPE (keys rounded once to fp16: C4R4, C2R4)."""
    return fmt.content.n_groups == 8 and fmt.content.bits in (2, 4) and fmt.rope.bits in (2, 4)


def launch_staged(*args, page_table=None):
    """Launch `mla_decode_staged_kernel` with `launch_flat`'s arguments (after its `block_m`): `B * cdiv(M, 64) * (NS
    + copy_programs(fmt))` programs of three warpgroups. bf16/fp16 queries only (no low parts are staged)."""
    q, qr = args[0], args[1]
    if q.dtype == torch.float32 or qr.dtype == torch.float32:
        raise ValueError("the staged Gluon decode kernel takes bf16/fp16 queries: use backend='gluon_wide' for fp32")
    c_regs, p_regs = REGS[args[4].content.bits]
    launch_flat(mla_decode_staged_kernel, "staged Gluon decode kernel", smem_bytes, "gluon_wide", BLOCK_M, *args,
                page_table=page_table, C_REGS=c_regs, P_REGS=p_regs, num_warps=4, maxnreg=LAUNCH_REGS)
