"""Hopper (sm_90) MLA decode in Gluon for many query rows (128 heads) of C4R4, C2R4, C4R8, C2R8, C8R8 and C16R16, the
work split three ways: one warpgroup unpacks each key tile into registers as the A operand of the score `wgmma`s (as
`mla_decode_gluon_regs` does, here for 64 rows) and stores only the content keys to shared memory (16-bit planes:
copies them there); two others each own half the latent channels of the 64 rows' outputs. Same function, splits,
copy programs and partials as the other Gluon kernels (reference: `mla_decode_ref.mla_decode_static_ref`; the `PAGED`
launch: `mla_decode_paged_ref`); shared pieces in `mla_decode_gluon_common.py`; design and timings: docs/KERNELS.md.

- The scorer (`_scorer`, a worker at `S_REGS` registers) loads each tile's code words and metadata a tile ahead (the
  steps zeroed outside the valid positions a tile later, `_load_meta_rows` without `ZERO`, then `_valid_steps`: no
  load is waited for in the tile that issues it), unpacks unit by unit (`half_asm`, keys `(code - z) * s` rounded
  once to fp16) and issues `S^T += K_u Q_u^T` (`m64n64k16`: the keys from registers, the staged queries `qbuf[u]:
  [64 rows, 64]` from shared memory). 8-bit RoPE (C4R8, C2R8, C8R8) is scored as the register kernels score it: its
  integer codes `code - z` (exact in fp16) in an accumulator of their own, added times its tokens' steps once both
  are done. Content unit u goes to `vbuf[u][stage]: [64 tokens, 64]` as its A fragments are (`stmatrix`; columns in
  `_score_channel` order), after `V_EMPTY + stage`, then `V_FULL + stage`; the finished scores go to `sbuf: [64 rows,
  64 tokens]` fp32 (transposed; 4-word runs, swizzled by row) after `S_EMPTY`, then `S_FULL`. A copy program scores
  its one tile of model-dtype copies the same way, into stage 0.
- 8-bit content (C8R8): unpacked and scored as 2- and 4-bit content is (keys rounded once to fp16), with two pairs
  of units' words in flight, each loaded half a tile ahead (twice the words of a 4-bit tile).
- 16-bit planes (C16R16, planes or page pools; `_dense_scorer`): nothing to unpack, so the scorer copies each tile's
  content keys `[64 tokens, 512]` with `cp.async` straight into the value stage (channels in order; the next tile's as
  soon as the values release its stage, after this tile's scores are handed over) and scores them from there unit by
  unit as each lands (`S^T += K_u Q_u^T`, both operands in shared memory, one copy group per unit); only the RoPE unit's
  keys are loaded into registers, a tile ahead, and scored first. The queries, keys and P are the planes' 16-bit type
  (bf16 or fp16), the outputs leave in channel order.
- Two value warpgroups (`_values`, the default warps and a worker at `V_REGS`), half `h` each: the scores of rows `[32
  h, + 32)` from `sbuf` (four threads per row, 16 contiguous tokens each: four 16-byte loads; a row's maximum is two
  shuffles), their online softmax (lazy: a row's reference moves only by more than 8; no masks where every row sees the
  whole tile), those rows of `P: [64 rows, 64 tokens]` fp16 (bf16 beside bf16 planes; `pbuf`), their rescale factors
  (`abuf`) and a vote per warp on whether any moved (`mvbuf`). Once both halves are stored (`P_FULL`) each rescales its
  outputs `O_u: [64 rows, 64]` (units `4 h .. 4 h + 3`, fp32 accumulators) where a vote says so and issues `O_u += P
  V_u` (`m64n64k16`, both operands from shared memory). A value warpgroup waits for that product at the top of its next
  tile, then releases the key stage (`V_EMPTY`) and its use of P (`P_FREE`) before it takes the next scores, and
  rewrites P and the factors only after both have (`P_FREE`).

Every token is unpacked once per 64 rows; only its content keys are stored. Per 64-token tile and program the
multiprocessor's shared memory moves about 316 KiB: query operands 72 KiB, keys stored 64, scores 16 stored and 16
read, P 8 stored, value operands 128, row factors and votes. Shared memory: queries 9 x 8 KB, content keys 2 stages x
8 x 8 KB, scores 16 KB, P 8 KB, row factors and votes (225 KB).
"""

from __future__ import annotations

import torch

from quantmla_hf.format import CacheFormat

from .mla_decode_gluon_common import (BLOCK_T, GROUP, HAVE_GLUON, _constexpr_fn, _jit, _jit_dynamic, launch_flat,
                                      words_layout)

if HAVE_GLUON:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_init,
        warpgroup_mma_wait,
    )

    # a `cp.async` of global memory into shared memory: `async_load` from Triton 3.7 on, before it the older name
    _async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared

    from .mla_decode_gluon_common import (
        _a_view,
        _batch_planes,
        _copy_slots,
        _copy_tile,
        _cta_barrier,
        _finish,
        _load_dense,
        _load_meta_rows,
        _load_unit,
        _pair_meta,
        _program_coords,
        _program_rows,
        _references,
        _rope_steps,
        _row_ptrs,
        _split_range,
        _split_rows,
        _split_units,
        _stage_queries,
        _tile_page,
        _tile_rows,
        _unit_base,
        _unit_buffers,
        _unpack_codes8,
        _unpack_unit,
        _valid_steps,
    )

_const = gl.constexpr if HAVE_GLUON else int  # a module constant the kernels read

BLOCK_M = 64  # query rows per program: one score accumulator `[64 tokens, 64 rows]`, two output halves
# Registers per thread of (the value worker, the scorer), per (content width, RoPE width, paged launch); the default
# value warpgroup gets what the register file has left for it. The 4-bit scorer spilled in its loop at 152 when paged
# (page numbers besides its words) and with 8-bit RoPE (twice its words, the steps of its rows); the 8-bit scorer,
# whose pairs of units load half a tile ahead, does not at 152 (at 160/184 a value loop had 5 local accesses).
REGS = {(2, 4, False): (176, 152), (4, 4, False): (176, 152), (2, 4, True): (176, 152), (4, 4, True): (168, 168),
        (2, 8, False): (176, 152), (4, 8, False): (168, 168), (2, 8, True): (176, 152), (4, 8, True): (168, 168),
        (8, 8, False): (176, 152), (8, 8, True): (176, 152), (16, 16, False): (176, 152), (16, 16, True): (176, 152)}


def registers(fmt: CacheFormat, paged: bool) -> tuple[int, int]:
    """`(value worker, scorer)` registers of the launch for `fmt` (`REGS`; 2-bit RoPE as 4-bit)."""
    return REGS[fmt.content.bits, fmt.rope.bits if fmt.rope.bits in (8, 16) else 4, paged]
LAUNCH_REGS = 168  # at launch, for all 12 warps (65,536 / 384 rounded down to 8)
FILL_PER_SM = 1  # programs per multiprocessor the splits provide (`ops.backends.fill_splits`)
# the mbarriers (one allocation): per key stage full and empty, then the scores', P's and the end's
V_FULL, V_EMPTY, S_FULL, S_EMPTY, P_FULL, P_FREE, E_BAR = (_const(i) for i in (0, 2, 4, 5, 6, 7, 8))
N_BARS = _const(9)


# --------------------------------------------------------------------------------------------- the scorer
@_jit
def _score_key(x5, acc, prev, qu, dst, FIRST: gl.constexpr, STORE: gl.constexpr, dot_a: gl.constexpr):
    """Issue one unit's score `wgmma` on the A view of its keys `x5` against its staged queries `qu: [64, 64]`; with
    `STORE` store the keys to `dst: [64, 64]`; then wait for the unit before (A operand `prev`), so that at most this
    one is in flight. `FIRST`: the tile's first unit (starts the accumulator). Returns `(acc, a)`."""
    a = _a_view(x5, dot_a)
    acc = warpgroup_mma(a, qu.permute((1, 0)), acc, use_acc=not FIRST, is_async=True)
    if STORE:
        dst.store(a)  # the A fragments as they are (`stmatrix`): the tile's columns in `_score_channel` order
    if not FIRST:
        prev = warpgroup_mma_wait(1, deps=[prev])
    return acc, a


@_jit
def _score_pair(cp, u: gl.constexpr, zz, ss, zh, acc, prev, qbuf, kz, vbuf, st, p_c, tn, lo, last, GC: gl.constexpr,
                C_BITS: gl.constexpr, wc_l: gl.constexpr, wp_l: gl.constexpr, dot_a: gl.constexpr, LU: gl.constexpr):
    """Content units u and u + 1 (words `cp: [64, 4, 2 WU]`) unpacked, scored and stored to `vbuf[u][st]`,
    `vbuf[u + 1][st]`; `cp` replaced by the words of units `LU, LU + 1` of the tile at `tn` (row pointers `p_c`) once
    both are unpacked. Returns `(acc, prev, cp)`."""
    c0, c1 = _split_units(cp, C_BITS // 2, wc_l)
    x5 = _unpack_unit(c0, zz, ss, zh, C_BITS, wc_l)
    acc, prev = _score_key(x5, acc, prev, qbuf[u].index(kz), vbuf[u].index(st), u == 0, True, dot_a)
    x5 = _unpack_unit(c1, zz, ss, zh, C_BITS, wc_l)
    cp = _load_unit(p_c, tn, lo, last, LU, GC * 2 * C_BITS, C_BITS, GC, wp_l, 2, True)
    acc, prev = _score_key(x5, acc, prev, qbuf[u + 1].index(kz), vbuf[u + 1].index(st), False, True, dot_a)
    return acc, prev, cp


@_jit
def _hand_over(acc, sbuf, bars, st, it):
    """The tile's keys (stage `st`) and then its scores `acc` (after the values took the last ones) to the value
    warpgroups."""
    fence_async_shared()  # this warpgroup's key stores visible to the value wgmmas
    _cta_barrier()
    mbarrier.arrive(bars.index(V_FULL + st), count=1)
    mbarrier.wait(bars.index(S_EMPTY), (it + 1) & 1, pred=it >= 1)
    sbuf.store(gl.permute(acc, (1, 0)))  # [rows, tokens]: each row's tokens contiguous for the values' loads
    _cta_barrier()
    mbarrier.arrive(bars.index(S_FULL), count=1)


@_jit
def _scorer(qbuf, vbuf, sbuf, bars, cc_ptr, cs_ptr, cz_ptr, rc_ptr, rs_ptr, rz_ptr, snc_ptr, snr_ptr, rcc_ptr,
            rcr_ptr, lp_ptr, len_ptr, M, split_target, num_splits, s_ccb, s_csb, s_rcb, s_rsb, s_sncb, s_snct, s_snrb,
            s_snrt, s_rccb, s_rcct, s_rcrb, s_rcrt, pt_ptr, s_pt, GC: gl.constexpr, C_BITS: gl.constexpr,
            R_BITS: gl.constexpr, S: gl.constexpr, R: gl.constexpr, BM: gl.constexpr, PAGED: gl.constexpr):
    """The scorer warpgroup: `_dense_scorer` for 16-bit planes, else `_packed_scorer`."""
    if C_BITS == 16:
        _dense_scorer(qbuf, vbuf, sbuf, bars, cc_ptr, rc_ptr, snc_ptr, snr_ptr, rcc_ptr, rcr_ptr, lp_ptr, len_ptr, M,
                      split_target, num_splits, s_ccb, s_rcb, s_sncb, s_snct, s_snrb, s_snrt, s_rccb, s_rcct, s_rcrb,
                      s_rcrt, pt_ptr, s_pt, GC, S, R, BM, PAGED)
    else:
        _packed_scorer(qbuf, vbuf, sbuf, bars, cc_ptr, cs_ptr, cz_ptr, rc_ptr, rs_ptr, rz_ptr, snc_ptr, snr_ptr,
                       rcc_ptr, rcr_ptr, lp_ptr, len_ptr, M, split_target, num_splits, s_ccb, s_csb, s_rcb, s_rsb,
                       s_sncb, s_snct, s_snrb, s_snrt, s_rccb, s_rcct, s_rcrb, s_rcrt, pt_ptr, s_pt, GC, C_BITS, R_BITS,
                       S, R, BM, PAGED)


@_jit
def _packed_scorer(qbuf, vbuf, sbuf, bars, cc_ptr, cs_ptr, cz_ptr, rc_ptr, rs_ptr, rz_ptr, snc_ptr, snr_ptr, rcc_ptr,
                   rcr_ptr, lp_ptr, len_ptr, M, split_target, num_splits, s_ccb, s_csb, s_rcb, s_rsb, s_sncb, s_snct,
                   s_snrb, s_snrt, s_rccb, s_rcct, s_rcrb, s_rcrt, pt_ptr, s_pt, GC: gl.constexpr,
                   C_BITS: gl.constexpr, R_BITS: gl.constexpr, S: gl.constexpr, R: gl.constexpr, BM: gl.constexpr,
                   PAGED: gl.constexpr):
    """Every tile of the program's split (row pointers, the next tile's words and metadata loaded while this one is
    unpacked; `PAGED`: through the page numbers, a tile ahead), or its copy tile: scores and content keys to the
    value warpgroups (module docstring)."""
    BT: gl.constexpr = 64
    ND: gl.constexpr = (S + BT - 1) // BT + (R + BT - 1) // BT
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 16])
    dot_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=2)
    WC_L: gl.constexpr = words_layout(C_BITS // 2)  # one content unit's words
    WP_L: gl.constexpr = words_layout(C_BITS)  # two units'
    WR_L: gl.constexpr = words_layout(R_BITS // 2)  # the RoPE unit's
    XL: gl.constexpr = words_layout(16)  # the copies' 16 channels per quad slot
    ml: gl.constexpr = gl.SliceLayout(2, WC_L)
    RWC: gl.constexpr = GC * 2 * C_BITS  # code words per token row
    RWR: gl.constexpr = 2 * R_BITS
    R_INT: gl.constexpr = R_BITS == 8  # 8-bit RoPE: its integer codes scored exactly, times the steps after

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
    HALF: gl.constexpr = C_BITS == 8  # 8-bit words: two pairs in flight, each half a tile ahead (registers)
    if HALF:
        p_here = pw  # the row pointers of the tile being scored
    else:  # every pair's words a tile ahead
        c45 = _load_unit(pw, 0, lo, last, 4, RWC, C_BITS, GC, WP_L, 2, True)
        c67 = _load_unit(pw, 0, lo, last, 6, RWC, C_BITS, GC, WP_L, 2, True)
    cr = _load_unit(_row_ptrs(p_rc, row, RWR, R_BITS // 2, WR_L), 0, lo, last, GC, RWR, R_BITS, GC, WR_L, 1, True)
    s0, z0, s1, z1, sr, zr = _load_meta_rows(p_cs, p_cz, p_rs, p_rz, 0, 0, 0, last, shift, GC, ml, False)
    page_n = _tile_page(p_pt, BT, last, PAGED)  # tile 1's page (each later one is loaded a tile ahead)
    for it in range(n_tiles):
        st = it % 2
        kz = it >> 30  # zero at run time, unknown to the compiler: the query descriptors are made where used
        tn = it * BT + BT
        page_nn = _tile_page(p_pt, tn + BT, last, PAGED)
        s0, s1, sr = _valid_steps(s0, s1, sr, it * BT, lo, hi, ml)
        zz0, ss0, zh0 = _pair_meta(s0, z0, C_BITS)
        zz1, ss1, zh1 = _pair_meta(s1, z1, C_BITS)
        zzr, ssr, zhr = _pair_meta(sr, zr, R_BITS)
        if R_INT:
            s_row = _rope_steps(sr, acc_l)
        row, shift = _tile_rows(page_n, tn, last, PAGED)
        page_n = page_nn
        s0, z0, s1, z1, sr, zr = _load_meta_rows(p_cs, p_cz, p_rs, p_rz, tn, 0, 0, last, shift, GC, ml, False)
        pc = _row_ptrs(p_cc, row, RWC, 2 * C_BITS, WP_L)
        pr = _row_ptrs(p_rc, row, RWR, R_BITS // 2, WR_L)
        # both value warpgroups have finished reading this stage's keys of two tiles ago
        mbarrier.wait(bars.index(V_EMPTY + st), ((it // 2) + 1) & 1, pred=it >= 2)
        acc = gl.zeros([64, BM], gl.float32, acc_l)
        if HALF:  # units 4-7 of this tile load while 0-3 are scored (into their slots), 0-3 of the next meanwhile
            p_a = p_here
            t_a = it * BT
        else:  # each pair's words of the next tile
            p_a = pc
            t_a = tn
        acc, prev, c01 = _score_pair(c01, 0, zz0, ss0, zh0, acc, acc, qbuf, kz, vbuf, st, p_a, t_a, lo, last, GC,
                                     C_BITS, WC_L, WP_L, dot_a, 4 if HALF else 0)
        acc, prev, c23 = _score_pair(c23, 2, zz0, ss0, zh0, acc, prev, qbuf, kz, vbuf, st, p_a, t_a, lo, last, GC,
                                     C_BITS, WC_L, WP_L, dot_a, 6 if HALF else 2)
        if HALF:  # the pairs just loaded are units 4-7 of this tile
            c45 = c01
            c67 = c23
        acc, prev, c45 = _score_pair(c45, 4, zz1, ss1, zh1, acc, prev, qbuf, kz, vbuf, st, pc, tn, lo, last, GC,
                                     C_BITS, WC_L, WP_L, dot_a, 0 if HALF else 4)
        acc, prev, c67 = _score_pair(c67, 6, zz1, ss1, zh1, acc, prev, qbuf, kz, vbuf, st, pc, tn, lo, last, GC,
                                     C_BITS, WC_L, WP_L, dot_a, 2 if HALF else 6)
        if HALF:
            c01 = c45
            c23 = c67
            p_here = pc
        if R_INT:  # the RoPE unit's integer codes in an accumulator of their own, times their steps when added
            x5 = _unpack_codes8(cr, zzr, WR_L)
            cr = _load_unit(pr, tn, lo, last, GC, RWR, R_BITS, GC, WR_L, 1, True)
            acc_r = warpgroup_mma(_a_view(x5, dot_a), qbuf[GC].index(kz).permute((1, 0)), acc, use_acc=False,
                                  is_async=True)
            acc, prev, acc_r = warpgroup_mma_wait(0, deps=[acc, prev, acc_r])
            acc = acc + acc_r * s_row[:, None]
        else:
            x5 = _unpack_unit(cr, zzr, ssr, zhr, R_BITS, WR_L)
            cr = _load_unit(pr, tn, lo, last, GC, RWR, R_BITS, GC, WR_L, 1, True)
            acc, prev = _score_key(x5, acc, prev, qbuf[GC].index(kz), qbuf[GC].index(kz), False, False, dot_a)
            acc, prev = warpgroup_mma_wait(0, deps=[acc, prev])
        _hand_over(acc, sbuf, bars, st, it)

    if i_s >= num_splits:  # a copy program: its one tile of model-dtype copies, into stage 0
        lo_c, hi_c, sink, p_c, p_r, s_ct, s_rt = _copy_tile(i_s, num_splits, length, i_c, snc_ptr, snr_ptr,
                                                             rcc_ptr, rcr_ptr, s_sncb, s_snct, s_snrb, s_snrt, s_rccb,
                                                             s_rcct, s_rcrb, s_rcrt, S, R, BT)
        o_dt = gl.arange(0, BT, layout=gl.SliceLayout(1, gl.SliceLayout(2, XL))).to(gl.int64)
        slot, m_t = _copy_slots(lo_c, hi_c, sink, lp, length, o_dt, S, R)
        acc = gl.zeros([64, BM], gl.float32, acc_l)
        prev = acc
        for u in gl.static_range(GC):
            x5 = _load_dense(p_c, slot, m_t, s_ct, u, GC, C_BITS, XL)
            acc, prev = _score_key(x5, acc, prev, qbuf[u].index(0), vbuf[u].index(0), u == 0, True, dot_a)
        x5 = _load_dense(p_r, slot, m_t, s_rt, GC, GC, R_BITS, XL)
        acc, prev = _score_key(x5, acc, prev, qbuf[GC].index(0), qbuf[GC].index(0), False, False, dot_a)
        acc, prev = warpgroup_mma_wait(0, deps=[acc, prev])
        _hand_over(acc, sbuf, bars, 0, 0)


# --------------------------------------------------------------------------------------------- the 16-bit scorer
@_jit
def _dense_keys(vbuf, st, p_c, rows, valid, stride, GC: gl.constexpr, ld_l: gl.constexpr):
    """Copy a tile's content keys, rows `rows: [64]` (stride `stride` elements) of `p_c`, into `vbuf[u][st]: [64
    tokens, 64]` for every unit u (channels `64 u + [0, 64)`, in order), 16 bytes a `cp.async`, zeros where not
    `valid`; one commit group per unit."""
    o_c = gl.arange(0, 64, layout=gl.SliceLayout(0, ld_l))
    off = (rows * stride)[:, None] + o_c[None, :]
    m = valid[:, None] & (o_c >= 0)[None, :]
    for u in gl.static_range(GC):
        _async_load(vbuf[u].index(st), p_c + off + u * 64, mask=m)
        async_copy.commit_group()  # one group per unit: its scores start as soon as it lands


@_jit
def _dense_scores(vbuf, st, xr, qbuf, kz, GC: gl.constexpr, BM: gl.constexpr, acc_l: gl.constexpr,
                  dot_a: gl.constexpr):
    """`S^T: [64 tokens, BM rows]` of a 16-bit tile whose content keys are being copied into `vbuf[.][st]` (one copy
    group per unit, `_dense_keys`): the RoPE unit's `wgmma`s first, its keys `xr` from registers, then each content
    unit's, both operands in shared memory, as soon as that unit's copies have landed (waited for and published here
    unit by unit); waited."""
    a = _a_view(xr, dot_a)
    acc = warpgroup_mma(a, qbuf[GC].index(kz).permute((1, 0)), gl.zeros([64, BM], gl.float32, acc_l), use_acc=False,
                        is_async=True)
    for u in gl.static_range(GC):
        async_copy.wait_group(GC - 1 - u)  # this unit's copies (the tile's only outstanding groups)
        fence_async_shared()  # the copies (generic proxy) visible to the wgmmas (async proxy) of every scorer warp
        _cta_barrier()
        acc = warpgroup_mma(vbuf[u].index(st), qbuf[u].index(kz).permute((1, 0)), acc, is_async=True)
    acc, a = warpgroup_mma_wait(0, deps=[acc, a])
    return acc


@_jit
def _dense_scorer(qbuf, vbuf, sbuf, bars, cc_ptr, rc_ptr, snc_ptr, snr_ptr, rcc_ptr, rcr_ptr, lp_ptr, len_ptr, M,
                  split_target, num_splits, s_ccb, s_rcb, s_sncb, s_snct, s_snrb, s_snrt, s_rccb, s_rcct, s_rcrb,
                  s_rcrt, pt_ptr, s_pt, GC: gl.constexpr, S: gl.constexpr, R: gl.constexpr, BM: gl.constexpr,
                  PAGED: gl.constexpr):
    """The scorer of 16-bit planes (C16R16): each tile's content keys copied by `cp.async` straight into the value
    stage (`_dense_keys`: the next tile's once the values have released its stage, right after this tile's scores
    are handed over), its RoPE keys loaded into registers a tile ahead; no unpacking and no key stores. A copy program
    copies its one tile of model-dtype copies into stage 0 the same way. `PAGED`: the planes are page pools read
    through the request's page numbers (`_tile_page`, a tile ahead; the paged 16-bit cache keeps no copies: S = R =
    0)."""
    BT: gl.constexpr = 64
    D_C: gl.constexpr = GC * 64
    ND: gl.constexpr = (S + BT - 1) // BT + (R + BT - 1) // BT
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 16])
    dot_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=2)
    ld_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # [64 tokens, 64]: 16-byte runs
    XL: gl.constexpr = words_layout(16)  # the RoPE unit's 16 channels per quad slot
    KD: gl.constexpr = cc_ptr.dtype.element_ty  # the planes' 16-bit type
    t_c: gl.constexpr = gl.SliceLayout(1, ld_l)
    t_r: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, XL))

    i_s, i_hb, i_b, length, lp, i_c = _program_rows(num_splits, M, len_ptr, lp_ptr, BM, ND, PAGED)
    base, lo_valid, hi, n_tiles = _split_range(i_s, num_splits, length, split_target, lp, S, R, BT, 16)
    first = gl.where(n_tiles > 0, base, 0)  # int32 positions relative to the split's first tile
    if PAGED:  # the pools from their first row, through the request's page numbers from the split's first tile on
        p_pt = pt_ptr + i_b * s_pt + first // BT
        p_cc = cc_ptr
        p_rc = rc_ptr
    else:  # the planes from the split's first tile on
        p_pt = pt_ptr
        p_cc = cc_ptr + i_b.to(gl.int64) * s_ccb + first * D_C
        p_rc = rc_ptr + i_b.to(gl.int64) * s_rcb + first * 64
    lo = (lo_valid - base).to(gl.int32)
    hi = (hi - base).to(gl.int32)
    last = gl.maximum(hi - 1, 0)
    o_c = gl.arange(0, BT, layout=t_c)
    o_r = gl.arange(0, BT, layout=t_r)
    row, _ = _tile_rows(_tile_page(p_pt, 0, last, PAGED), 0, last, PAGED)  # the plane row of a tile's first token
    page_n = _tile_page(p_pt, BT, last, PAGED)  # tile 1's page (each later one is loaded a tile ahead)
    if n_tiles > 0:
        _dense_keys(vbuf, 0, p_cc, row + o_c, (o_c >= lo) & (o_c < hi), D_C, GC, ld_l)
    xr = _load_dense(p_rc, row + o_r, (o_r >= lo) & (o_r < hi), 64, GC, GC, 16, XL, KD)
    for it in range(n_tiles):
        st = it % 2
        kz = it >> 30  # zero at run time, unknown to the compiler: the query descriptors are made where used
        tn = it * BT + BT
        page_nn = _tile_page(p_pt, tn + BT, last, PAGED)
        row, _ = _tile_rows(page_n, tn, last, PAGED)
        page_n = page_nn
        acc = _dense_scores(vbuf, st, xr, qbuf, kz, GC, BM, acc_l, dot_a)
        xr = _load_dense(p_rc, row + o_r, ((tn + o_r) >= lo) & ((tn + o_r) < hi), 64, GC, GC, 16, XL, KD)
        _hand_over(acc, sbuf, bars, st, it)
        if it + 1 < n_tiles:  # the next tile into the other stage, once both value warpgroups are done with it
            mbarrier.wait(bars.index(V_EMPTY + 1 - st), (((it + 1) // 2) + 1) & 1, pred=it >= 1)
            _dense_keys(vbuf, 1 - st, p_cc, row + o_c, ((tn + o_c) >= lo) & ((tn + o_c) < hi), D_C, GC, ld_l)

    if i_s >= num_splits:  # a copy program: its one tile of model-dtype copies, into stage 0
        lo_c, hi_c, sink, p_c, p_r, s_ct, s_rt = _copy_tile(i_s, num_splits, length, i_c, snc_ptr, snr_ptr,
                                                             rcc_ptr, rcr_ptr, s_sncb, s_snct, s_snrb, s_snrt, s_rccb,
                                                             s_rcct, s_rcrb, s_rcrt, S, R, BT)
        slot, m_t = _copy_slots(lo_c, hi_c, sink, lp, length, o_c.to(gl.int64), S, R)
        _dense_keys(vbuf, 0, p_c, slot, m_t, s_ct, GC, ld_l)
        slot, m_t = _copy_slots(lo_c, hi_c, sink, lp, length, o_r.to(gl.int64), S, R)
        acc = _dense_scores(vbuf, 0, _load_dense(p_r, slot, m_t, s_rt, GC, GC, 16, XL, KD), qbuf, 0, GC, BM, acc_l,
                             dot_a)
        _hand_over(acc, sbuf, bars, 0, 0)


# --------------------------------------------------------------------------------------------- the values
@_jit
def _value_tiles(i_s, num_splits, length, split_target, lp, i_c, snc_ptr, snr_ptr, rcc_ptr, rcr_ptr, s_sncb, s_snct,
                 s_snrb, s_snrt, s_rccb, s_rcct, s_rcrb, s_rcrt, S: gl.constexpr, R: gl.constexpr,
                 C_BITS: gl.constexpr):
    """The tiles a value warpgroup attends, as int32: `(n_tiles, n_all, t_base, lo, hi, c_t0, c_lo, c_hi)`, the
    split's packed tiles from `t_base` valid in `[lo, hi)` (`_split_range`), then (a copy program, `n_all = n_tiles +
    1`) the copy tile at `c_t0` valid in `[c_lo, c_hi)` (`_copy_rows`'s mask)."""
    BT: gl.constexpr = 64
    base, lo_valid, hi, n_tiles = _split_range(i_s, num_splits, length, split_target, lp, S, R, BT, C_BITS)
    lo_c, hi_c, sink, _, _, _, _ = _copy_tile(i_s, num_splits, length, i_c, snc_ptr, snr_ptr, rcc_ptr, rcr_ptr, s_sncb,
                                              s_snct, s_snrb, s_snrt, s_rccb, s_rcct, s_rcrb, s_rcrt, S, R, BT)
    shift = gl.where(sink, lp, 0)
    c_t0 = (lo_c + shift).to(gl.int32)
    c_lo = gl.maximum(gl.where(sink, lp, lp + S), lo_c + shift).to(gl.int32)
    c_hi = gl.minimum(hi_c + shift, length).to(gl.int32)
    n_all = n_tiles + (i_s >= num_splits).to(gl.int32)  # tiles in the ring: the packed ones, then a copy tile
    return n_tiles, n_all, base.to(gl.int32), lo_valid.to(gl.int32), hi.to(gl.int32), c_t0, c_lo, c_hi


@_constexpr_fn
def _run_layout(store: bool):
    """The `m64n64k16` accumulator `[64 rows, 64]` of a unit, viewed as `[64 rows, 4 q, 16]` (`_store_unit`): thread
    q of a quad holds 16 contiguous channels of its two rows. `store`: those 16 in consecutive registers (the store's
    order; else the accumulator's, 4-bit keys)."""
    regs = ([[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [8, 0, 0]] if store
            else [[0, 0, 4], [8, 0, 0], [0, 0, 1], [0, 0, 2], [0, 0, 8]])
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0],
                                                                  [4, 0, 0]],
                                      warp_bases=[[16, 0, 0], [32, 0, 0]], block_bases=[], shape=[64, 4, 16])


@_jit
def _store_unit(o_ptr, o, u: gl.constexpr, row0, n_rows, n_slots, i_s, C_BITS: gl.constexpr, GC: gl.constexpr):
    """Unit u's normalised output `o: [64 rows, 64]` (columns in `_score_channel` order: column `2 q + e + 8 j` is
    channel `_unit_base(u, q) + (j // N) 2N + j % N + N e`, `N = 16 / bits`) to rows `row0 + [0, min(64,
    n_rows))` of the partials (`n_slots` a row, this split's `i_s`): thread q's 16 channels of a row contiguous,
    four 16-byte stores of fp32 partials, four 8-byte ones of fp16 (`backends.partial_dtype`)."""
    N: gl.constexpr = 16 // C_BITS
    x = gl.reshape(o, [64, 8 // N, N, 4, 2])  # [row, j // N, j % N, q, e]
    x = gl.permute(x, (0, 3, 1, 4, 2))  # [row, q, j // N, e, j % N]: channel (j // N) 2N + N e + j % N
    x = gl.reshape(x, [64, 4, 16])
    if C_BITS == 4:
        x = gl.convert_layout(x, _run_layout(False), assert_trivial=True)
    x = gl.convert_layout(x, _run_layout(True))
    sl: gl.constexpr = _run_layout(True)
    o_r = gl.arange(0, 64, layout=gl.SliceLayout(1, gl.SliceLayout(2, sl)))
    o_q = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, sl)))
    o_c = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, sl)))
    off = ((row0 + o_r).to(gl.int64) * n_slots + i_s) * (GC * 64)
    ch = _unit_base(u, o_q, GC)
    ptr = o_ptr + (off[:, None] + ch[None, :])[:, :, None] + o_c[None, None, :]
    gl.store(ptr, x, mask=(o_r < n_rows)[:, None, None])


@_jit
def _store_unit_in_order(o_ptr, o, u: gl.constexpr, row0, n_rows, n_slots, i_s, GC: gl.constexpr, o_l: gl.constexpr):
    """Unit u's normalised output `o: [64 rows, 64]` whose column c is channel `64 u + c` (16-bit keys) to rows
    `row0 + [0, min(64, n_rows))` of the partials, from the accumulator's own layout (8-byte stores)."""
    o_r = gl.arange(0, 64, layout=gl.SliceLayout(1, o_l))
    o_c = gl.arange(0, 64, layout=gl.SliceLayout(0, o_l))
    off = ((row0 + o_r).to(gl.int64) * n_slots + i_s) * (GC * 64) + u * 64
    gl.store(o_ptr + off[:, None] + o_c[None, :], o, mask=(o_r < n_rows)[:, None])


@_jit
def _values(HF: gl.constexpr, vbuf, pbuf, sbuf, abuf, mvbuf, fbuf, ibuf, bars, snc_ptr, snr_ptr, rcc_ptr, rcr_ptr,
            lp_ptr, len_ptr, o_ptr, lse_ptr, M, Tq, split_target, num_splits, s_sncb, s_snct, s_snrb, s_snrt, s_rccb,
            s_rcct, s_rcrb, s_rcrt, GC: gl.constexpr, C_BITS: gl.constexpr, R_BITS: gl.constexpr, S: gl.constexpr,
            R: gl.constexpr, BM: gl.constexpr, PAGED: gl.constexpr):
    """Value warpgroup `HF` (0: the default warps, 1: a worker): the softmax of rows `[HF * BM/2, + BM/2)` and the
    output channels of `vbuf[HF]` of all the program's rows over the tiles of its split (then, a copy program, its
    copy tile), its partial outputs and its rows' LSE."""
    BT: gl.constexpr = 64
    HM: gl.constexpr = BM // 2
    D_C: gl.constexpr = GC * 64
    ND: gl.constexpr = (S + BT - 1) // BT + (R + BT - 1) // BT
    sr_l: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])  # [HM rows, 64 tokens] as loaded
    s_l: gl.constexpr = gl.BlockedLayout([16, 1], [4, 8], [1, 4], [0, 1])  # its transpose, [64 tokens, HM rows]
    tok_l: gl.constexpr = gl.SliceLayout(1, s_l)
    row_l: gl.constexpr = gl.SliceLayout(0, s_l)
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    orow_l: gl.constexpr = gl.SliceLayout(1, o_l)

    i_s, i_hb, i_b, length, lp, i_c = _program_rows(num_splits, M, len_ptr, lp_ptr, BM, ND, PAGED)
    o_m = i_hb * BM + HF * HM + gl.arange(0, HM, layout=row_l)
    m_m = o_m < M
    lim_m = (length - Tq + (o_m % Tq) + 1).to(gl.int32)  # query t of Tq sees positions < length - Tq + t + 1
    lim_all = (length - Tq + 1).to(gl.int32)  # positions every query sees
    f = fbuf.slice(HF * HM, HM).load(row_l)
    n_tiles, n_all, t_base, lo, hi, c_t0, c_lo, c_hi = _value_tiles(
        i_s, num_splits, length, split_target, lp, i_c, snc_ptr, snr_ptr, rcc_ptr, rcr_ptr, s_sncb, s_snct, s_snrb,
        s_snrt, s_rccb, s_rcct, s_rcrb, s_rcrt, S, R, C_BITS)
    o_bt = gl.arange(0, BT, layout=tok_l)
    m_i = gl.full([HM], float("-inf"), gl.float32, row_l)
    l_i = gl.zeros([HM], gl.float32, row_l)
    outs = ()  # the output accumulators `O_u: [64 rows, 64]` of content units `4 HF + u` (as the loop leaves them)
    for u in gl.static_range(4):
        outs = outs + (warpgroup_mma_init(gl.zeros([BM, 64], gl.float32, o_l)),)
    for it in range(n_all):
        st = it % 2
        # this warpgroup's product of the tile before has finished: its key stage and (once the other's has too) P
        # and the factors are free
        outs = warpgroup_mma_wait(0, deps=outs)
        mbarrier.arrive(bars.index(V_EMPTY + 1 - st), count=1, pred=it > 0)
        mbarrier.arrive(bars.index(P_FREE), count=1, pred=it > 0)
        mbarrier.wait(bars.index(S_FULL), it & 1)
        s = gl.permute(sbuf.slice(HF * HM, HM, dim=0).load(sr_l), (1, 0))  # [64 tokens, HM rows]
        _cta_barrier()
        mbarrier.arrive(bars.index(S_EMPTY), count=1)
        packed = it < n_tiles
        t0 = gl.where(packed, t_base + it * BT, c_t0)  # the tile's first position
        p_lo = gl.where(packed, lo, c_lo)
        p_hi = gl.where(packed, hi, c_hi)
        if (t0 >= p_lo) & (t0 + BT <= gl.minimum(p_hi, lim_all)):  # every position visible to every row
            b_s = s * f[None, :]  # (rows past M: zero queries, finite scores, never stored)
        else:
            p_t = t0 + o_bt
            m_valid = (((p_t >= p_lo) & (p_t < p_hi))[:, None] & m_m[None, :]) & (p_t[:, None] < lim_m[None, :])
            b_s = gl.where(m_valid, s * f[None, :], float("-inf"))
        move, m_new, m_use, p = _references(b_s, m_i)  # lazy: a row's reference moves by more than 8 or not at all
        alpha = gl.exp2(m_i - m_use)  # 1 where it did not move
        l_i = l_i * alpha + gl.sum(p, axis=0)
        m_i = m_new
        mbarrier.wait(bars.index(P_FREE), (it + 1) & 1, pred=it > 0)
        pbuf.slice(HF * HM, HM, dim=0).store(gl.permute(p.to(pbuf.dtype), (1, 0)))
        abuf.slice(HF * HM, HM).store(alpha)
        mvbuf.slice(4 * HF, 4).store(gl.max(gl.reshape(move.to(gl.int32), [4, HM // 4]), axis=1))  # per warp
        fence_async_shared()  # P visible to the wgmmas
        _cta_barrier()
        mbarrier.arrive(bars.index(P_FULL), count=1)
        mbarrier.wait(bars.index(P_FULL), it & 1)
        if gl.max(mvbuf.load(gl.BlockedLayout([8], [32], [4], [0])), axis=0) > 0:  # some row's reference moved
            a = abuf.load(orow_l)[:, None]
            outs = (outs[0] * a, outs[1] * a, outs[2] * a, outs[3] * a)
        mbarrier.wait(bars.index(V_FULL + st), (it // 2) & 1)
        pv = ()
        for u in gl.static_range(4):
            pv = pv + (warpgroup_mma(pbuf, vbuf[4 * HF + u].index(st), outs[u], is_async=True),)
        outs = pv
    outs = warpgroup_mma_wait(0, deps=outs)

    inv_l, b_lse = _finish(l_i, m_i, o_ptr)
    gl.store(lse_ptr + (i_b * M + o_m) * (num_splits + ND) + i_s, b_lse, mask=m_m)
    ibuf.slice(HF * HM, HM).store(inv_l)
    _cta_barrier()
    mbarrier.arrive(bars.index(E_BAR), count=1)
    mbarrier.wait(bars.index(E_BAR), 0)
    inv = ibuf.load(orow_l)[:, None]
    for u in gl.static_range(4):
        if C_BITS == 16:  # the stage's columns in channel order
            _store_unit_in_order(o_ptr, outs[u] * inv, 4 * HF + u, i_b * M + i_hb * BM, M - i_hb * BM,
                                 num_splits + ND, i_s, GC, o_l)
        else:
            _store_unit(o_ptr, outs[u] * inv, 4 * HF + u, i_b * M + i_hb * BM, M - i_hb * BM, num_splits + ND, i_s,
                        C_BITS, GC)


# --------------------------------------------------------------------------------------------- the kernel
@_jit_dynamic
def mla_decode_split_kernel(
    q_ptr, qr_ptr,
    cc_ptr, cs_ptr, cz_ptr, rc_ptr, rs_ptr, rz_ptr,
    snc_ptr, snr_ptr, rcc_ptr, rcr_ptr, lp_ptr, len_ptr,
    o_ptr, lse_ptr,
    M, Tq, split_target, num_splits, qk_scale,
    s_qb, s_qrb, s_ccb, s_csb, s_rcb, s_rsb,
    s_sncb, s_snct, s_snrb, s_snrt, s_rccb, s_rcct, s_rcrb, s_rcrt,
    GC: gl.constexpr, C_BITS: gl.constexpr, R_BITS: gl.constexpr, S: gl.constexpr, R: gl.constexpr,
    BM: gl.constexpr, Q_SPLIT: gl.constexpr, pt_ptr, s_pt, PAGED: gl.constexpr, V_REGS: gl.constexpr,
    S_REGS: gl.constexpr,
):
    """One program per split, block of 64 rows and batch row (`_program_coords`; the last `ND` splits attend one
    copy tile each): the queries and the rows' score factors (`fbuf`) staged by the default warps, then the scorer
    and the two value warpgroups of the module docstring. `PAGED`: as in
    `mla_decode_gluon_regs.mla_decode_gluon_kernel`. `V_REGS`, `S_REGS`: the value worker's and the scorer's
    registers."""
    BT: gl.constexpr = 64
    D_C: gl.constexpr = GC * 64
    ND: gl.constexpr = (S + BT - 1) // BT + (R + BT - 1) // BT
    k_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    s_sl: gl.constexpr = gl.SwizzledSharedLayout(4, 1, 8, [1, 0])
    v_sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    q_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    KD: gl.constexpr = cc_ptr.dtype.element_ty if C_BITS == 16 else gl.float16  # the operands' 16-bit type
    qbuf = _unit_buffers(GC + 1, BM, k_sl, 1, KD)
    vbuf = _unit_buffers(GC, BT, k_sl, 2, KD)  # one allocation per unit: the scorer's stores are seen as disjoint
    sbuf = gl.allocate_shared_memory(gl.float32, [BM, BT], s_sl)
    pbuf = gl.allocate_shared_memory(KD, [BM, BT], k_sl)
    abuf = gl.allocate_shared_memory(gl.float32, [BM], v_sl)
    fbuf = gl.allocate_shared_memory(gl.float32, [BM], v_sl)
    ibuf = gl.allocate_shared_memory(gl.float32, [BM], v_sl)
    mvbuf = gl.allocate_shared_memory(gl.int32, [8], v_sl)  # per value warp: whether a row's reference moved
    bars = gl.allocate_shared_memory(gl.int64, [N_BARS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(N_BARS):  # the scorer's one arrival, or one of each value warpgroup
        mbarrier.init(bars.index(i), count=1 if (i < V_EMPTY or i == S_FULL) else 2)

    _, i_hb, i_b = _program_coords(num_splits, M, BM, ND)
    f = _stage_queries(qbuf, qbuf, q_ptr + i_b * s_qb, qr_ptr + i_b * s_qrb, i_hb * BM, M, D_C, GC, BM, False, C_BITS,
                       R_BITS, q_l)
    fbuf.store(f * qk_scale)  # scores in base 2, pre-multiplied by scaling * log2(e)
    fence_async_shared()
    _cta_barrier()
    # (the argument tuples are written out: a tuple held in a variable would turn the constexprs into tensors)
    gl.warp_specialize([
        (_values, (0, vbuf, pbuf, sbuf, abuf, mvbuf, fbuf, ibuf, bars, snc_ptr, snr_ptr, rcc_ptr, rcr_ptr, lp_ptr,
                   len_ptr, o_ptr, lse_ptr, M, Tq, split_target, num_splits, s_sncb, s_snct, s_snrb, s_snrt, s_rccb,
                   s_rcct, s_rcrb, s_rcrt, GC, C_BITS, R_BITS, S, R, BM, PAGED)),
        (_values, (1, vbuf, pbuf, sbuf, abuf, mvbuf, fbuf, ibuf, bars, snc_ptr, snr_ptr, rcc_ptr, rcr_ptr, lp_ptr,
                   len_ptr, o_ptr, lse_ptr, M, Tq, split_target, num_splits, s_sncb, s_snct, s_snrb, s_snrt, s_rccb,
                   s_rcct, s_rcrb, s_rcrt, GC, C_BITS, R_BITS, S, R, BM, PAGED)),
        (_scorer, (qbuf, vbuf, sbuf, bars, cc_ptr, cs_ptr, cz_ptr, rc_ptr, rs_ptr, rz_ptr, snc_ptr, snr_ptr,
                   rcc_ptr, rcr_ptr, lp_ptr, len_ptr, M, split_target, num_splits, s_ccb, s_csb, s_rcb, s_rsb, s_sncb,
                   s_snct, s_snrb, s_snrt, s_rccb, s_rcct, s_rcrb, s_rcrt, pt_ptr, s_pt, GC, C_BITS, R_BITS, S, R,
                   BM, PAGED)),
    ], [4, 4], [V_REGS, S_REGS])


# --------------------------------------------------------------------------------------------- host side
def smem_bytes(fmt: CacheFormat, q_split: bool) -> int:
    """Shared memory of one program: queries `[GC + 1, 64, 64]` fp16, two stages of content keys `[GC, 64, 64]`
    fp16, scores `[64, 64]` fp32, P `[64, 64]` fp16, three `[64]` fp32 row factors, 8 votes and the barriers, plus
    1 KB of compiler scratch."""
    gc = fmt.content.dim // GROUP  # content units (of 16-bit planes too)
    return ((gc + 1) * BLOCK_M * GROUP * 2 + 2 * gc * BLOCK_T * GROUP * 2 + BLOCK_T * BLOCK_M * (4 + 2)
            + 3 * BLOCK_M * 4 + 8 * 4 + N_BARS * 8 + 1024)


def split_handles(fmt: CacheFormat) -> bool:
    """Whether this kernel takes the format (besides `hopper_handles`): 8 content groups at 2 or 4 bits with 2-, 4- or
    8-bit RoPE (C4R4, C2R4, C4R8, C2R8), at 8 bits with 8-bit RoPE (C8R8), the content keys rounded once to fp16, or
    both paths at 16 bits at DeepSeek's widths (C16R16: 512 content channels, 64 RoPE)."""
    if dense(fmt):
        return fmt.content.dim == 8 * GROUP and fmt.rope.dim == GROUP
    c, r = fmt.content.bits, fmt.rope.bits
    return fmt.content.n_groups == 8 and ((c in (2, 4) and r in (2, 4, 8)) or (c == 8 and r == 8))


def dense(fmt: CacheFormat) -> bool:
    """Whether both paths are 16-bit planes (`_dense_scorer`)."""
    return not fmt.content.quantized and not fmt.rope.quantized


def launch_split(*args, page_table=None):
    """Launch `mla_decode_split_kernel` with `launch_flat`'s arguments (after its `block_m`): `B * cdiv(M, 64) * (NS
    + copy_programs(fmt))` programs of three warpgroups. bf16/fp16 queries only (no low parts are staged)."""
    q, qr, fmt = args[0], args[1], args[4]
    if q.dtype == torch.float32 or qr.dtype == torch.float32:
        raise ValueError("the split Gluon decode kernel takes bf16/fp16 queries: use backend='gluon_wide' for fp32")
    copies = args[5:9] if fmt.sink_tokens or fmt.recent_tokens else ()  # (the paged 16-bit cache keeps none)
    if dense(fmt) and len({args[2]["values"].dtype, args[3]["values"].dtype, *(t.dtype for t in copies)}) > 1:
        raise ValueError("the split Gluon decode kernel copies 16-bit planes and the sink/recent copies into one "
                         "buffer: they must share one dtype (the model's); use backend='triton'")
    v_regs, s_regs = registers(args[4], page_table is not None)
    launch_flat(mla_decode_split_kernel, "split Gluon decode kernel", smem_bytes, "gluon_wide", BLOCK_M, *args,
                page_table=page_table, V_REGS=v_regs, S_REGS=s_regs, num_warps=4, maxnreg=LAUNCH_REGS)
