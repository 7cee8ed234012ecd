"""Hopper (sm_90) packed MLA decode in Gluon, the keys unpacked into *registers* as the score `wgmma`'s A operand:
the kernel (`mla_decode_gluon_kernel`, one entry and one launch, `launch_gluon`) and its one-warpgroup program for up
to 16 query rows per program; with `WIDE` the kernel runs the two-warpgroup program of `mla_decode_gluon_wide.py`
(32 rows). Same function as `mla_decode_ref.mla_decode_static_ref` (the `PAGED` launch: `mla_decode_paged_ref`),
launched by `quantmla_hf/ops/backends.py`; shared pieces in `mla_decode_gluon_common.py`; design: docs/KERNELS.md.

Each thread loads the code words it unpacks straight from global memory into registers, one tile ahead; the fp16
keys `(code - z) * s` (one rounding, at every width) are the register A operand of the score `wgmma`s and are stored
once per unit to shared memory for the value `wgmma`s (`O^T = V^T P`); 8-bit RoPE is scored on its integer codes,
exactly (`_packed_scores`). Shared memory (C4R4, 16 rows, bf16 queries): 86 KB, two programs per SM.
"""


from __future__ import annotations

from quantmla_hf.format import CacheFormat

from . import mla_decode_gluon_wide as wide
from .mla_decode_gluon_common import HAVE_GLUON, _jit_dynamic, launch_flat, tile_smem, words_layout

if HAVE_GLUON:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

    from .mla_decode_gluon_common import (
        _alloc_tiles,
        _batch_planes,
        _copy_rows,
        _copy_tile,
        _cta_barrier,
        _dense_scores,
        _finish,
        _load_group,
        _load_meta_rows,
        _load_unit,
        _planes_from,
        _program_coords,
        _program_rows,
        _row_ptrs,
        _softmax_pv,
        _split_range,
        _stage_queries,
        _store_o,
        _tile_page,
        _tile_rows,
        _tile_scores,
    )
    from .mla_decode_gluon_wide import _half_program

BLOCK_M = 16  # query rows per program: one warpgroup, the acc and the 8 value accumulators fit the registers
INFLIGHT = {4: 0, 2: 1, 8: 1}  # score units whose wgmmas may be in flight while the next is unpacked, per C_BITS
FILL_PER_SM = 2  # programs per multiprocessor the splits provide (`ops.backends.fill_splits`): the two resident ones


@_jit_dynamic
def mla_decode_gluon_kernel(
    q_ptr, qr_ptr,
    cc_ptr, cs_ptr, cz_ptr, rc_ptr, rs_ptr, rz_ptr,
    snc_ptr, snr_ptr, rcc_ptr, rcr_ptr, lp_ptr, len_ptr,
    o_ptr, lse_ptr,
    M, Tq, split_target, num_splits, qk_scale,
    s_qb, s_qrb, s_ccb, s_csb, s_rcb, s_rsb,
    s_sncb, s_snct, s_snrb, s_snrt, s_rccb, s_rcct, s_rcrb, s_rcrt,
    GC: gl.constexpr, C_BITS: gl.constexpr, R_BITS: gl.constexpr, S: gl.constexpr, R: gl.constexpr,
    BM: gl.constexpr, Q_SPLIT: gl.constexpr, INFLIGHT: gl.constexpr, WIDE: gl.constexpr, W_REGS: gl.constexpr,
    pt_ptr, s_pt, PAGED: gl.constexpr,
):
    """One program per split, block of BM rows and batch row (`_program_coords`; the last `ND` splits attend one
    copied tile each): one warpgroup, or with `WIDE` two (the queries and the rows' score factors, `fbuf`, staged by
    the default warps, then the leader and the worker, `W_REGS` registers, attend each tile together:
    `mla_decode_gluon_wide._half_program`). `INFLIGHT`: score units whose `wgmma`s may be in flight while the next
    is unpacked (0 or 1).

    `PAGED`: batch row b is request b of a decode step of the paged cache (one query token, `Tq = 1`): its length
    is `len_ptr[b]`, its copies are row `lp_ptr[b]` of the copy tensors, and its position p lives in row `page * 64
    + p % 64` of the page pools (batch strides 0), `page = pt_ptr[b * s_pt + p // 64]` (64-token pages, one per
    tile: `_tile_rows`). Otherwise `len_ptr[0]` is every row's length and `lp_ptr[b]` its left padding."""
    BT: gl.constexpr = 64
    D_C: gl.constexpr = GC * 64
    ND: gl.constexpr = (S + BT - 1) // BT + (R + BT - 1) // BT  # programs for the copied tokens
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 16])
    col_l: gl.constexpr = gl.SliceLayout(0, acc_l)  # per query row
    q_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    if WIDE:  # the queries staged here, the tiles attended by the two warpgroups (`_half_program`)
        plain2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        plain1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        _, i_hb, i_b = _program_coords(num_splits, M, BM, ND)
        kbuf, qbuf, qlo, pbuf = _alloc_tiles(GC, BT, BM, Q_SPLIT)
        sbuf = gl.allocate_shared_memory(gl.float32, [2, BT, BM // 2], plain2)  # [h]: scores of rows half 1 - h
        abuf = gl.allocate_shared_memory(gl.float32, [BM], plain1)
        ibuf = gl.allocate_shared_memory(gl.float32, [BM], plain1)
        fbuf = gl.allocate_shared_memory(gl.float32, [BM], plain1)
        s_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        p_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for h in gl.static_range(2):
            mbarrier.init(s_bar.index(h), count=1)
            mbarrier.init(p_bar.index(h), count=1)

        f = _stage_queries(qbuf, qlo, q_ptr + i_b * s_qb, qr_ptr + i_b * s_qrb, i_hb * BM, M, D_C, GC, BM, Q_SPLIT,
                           C_BITS, R_BITS, q_l)
        fbuf.store(gl.convert_layout(f, col_l) * qk_scale)
        fence_async_shared()
        _cta_barrier()

        # (the argument tuples are written out: a tuple held in a variable would turn the constexprs into tensors)
        gl.warp_specialize([
            (_half_program, (True, fbuf, qbuf, qlo, kbuf, pbuf, sbuf, abuf, ibuf, s_bar, p_bar, cc_ptr, cs_ptr,
                             cz_ptr, rc_ptr, rs_ptr, rz_ptr, snc_ptr, snr_ptr, rcc_ptr, rcr_ptr, lp_ptr, len_ptr,
                             o_ptr, lse_ptr, M, Tq, split_target, num_splits, s_ccb, s_csb, s_rcb, s_rsb, s_sncb,
                             s_snct, s_snrb, s_snrt, s_rccb, s_rcct, s_rcrb, s_rcrt, pt_ptr, s_pt, GC, C_BITS, R_BITS,
                             S, R, BM, Q_SPLIT, INFLIGHT, PAGED)),
            (_half_program, (False, fbuf, qbuf, qlo, kbuf, pbuf, sbuf, abuf, ibuf, s_bar, p_bar, cc_ptr, cs_ptr,
                             cz_ptr, rc_ptr, rs_ptr, rz_ptr, snc_ptr, snr_ptr, rcc_ptr, rcr_ptr, lp_ptr, len_ptr,
                             o_ptr, lse_ptr, M, Tq, split_target, num_splits, s_ccb, s_csb, s_rcb, s_rsb, s_sncb,
                             s_snct, s_snrb, s_snrt, s_rccb, s_rcct, s_rcrb, s_rcrt, pt_ptr, s_pt, GC, C_BITS, R_BITS,
                             S, R, BM, Q_SPLIT, INFLIGHT, PAGED)),
        ], [4], [W_REGS])
    else:  # one warpgroup
        dot_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=2)
        WC_L: gl.constexpr = words_layout(C_BITS // 2)  # one content unit's words
        WP_L: gl.constexpr = words_layout(C_BITS)  # two consecutive content units' words, loaded together
        WR_L: gl.constexpr = words_layout(R_BITS // 2)  # the RoPE unit's words
        XL: gl.constexpr = words_layout(16)  # the copies' 16 channels per quad slot
        row_l: gl.constexpr = gl.SliceLayout(1, acc_l)  # per token
        ml: gl.constexpr = gl.SliceLayout(2, WC_L)  # per (token, quad slot)
        RWC: gl.constexpr = GC * 2 * C_BITS  # code words per token row
        RWR: gl.constexpr = 2 * R_BITS

        i_s, i_hb, i_b, length, lp, i_c = _program_rows(num_splits, M, len_ptr, lp_ptr, BM, ND, PAGED)
        o_m = i_hb * BM + gl.arange(0, BM, layout=col_l)
        m_m = o_m < M
        lim_m = length - Tq + (o_m % Tq) + 1  # query t of Tq sees positions < length - Tq + t + 1

        kbuf, qbuf, qlo, pbuf = _alloc_tiles(GC, BT, BM, Q_SPLIT)
        vbuf = gl.allocate_shared_memory(gl.int32, [4], gl.SwizzledSharedLayout(1, 1, 1, [0]))

        f = _stage_queries(qbuf, qlo, q_ptr + i_b * s_qb, qr_ptr + i_b * s_qrb, i_hb * BM, M, D_C, GC, BM, Q_SPLIT,
                           C_BITS, R_BITS, q_l)
        f = gl.convert_layout(f, col_l) * qk_scale  # scores in base 2, pre-multiplied by scaling * log2(e)
        fence_async_shared()
        _cta_barrier()  # the staged queries visible to every warp's wgmma

        m_i = gl.full([BM], float("-inf"), gl.float32, col_l)
        l_p = gl.zeros([BT, BM], gl.float32, acc_l)
        outs = ()  # the value accumulators `o_u^T: [64, BM]` of the content units
        for u in gl.static_range(GC):
            outs = outs + (gl.zeros([64, BM], gl.float32, acc_l),)
        base, lo_valid, hi, n_tiles = _split_range(i_s, num_splits, length, split_target, lp, S, R, BT, C_BITS)
        p_cc, p_rc, p_cs, p_cz, p_rs, p_rz = _batch_planes(cc_ptr, cs_ptr, cz_ptr, rc_ptr, rs_ptr, rz_ptr, i_b, s_ccb,
                                                           s_csb, s_rcb, s_rsb)

        # int32 positions relative to the split's first tile (`_row_ptrs`, `_load_meta_rows`)
        lo_l = (lo_valid - base).to(gl.int32)
        hi_l = (hi - base).to(gl.int32)
        # tile 0's words and metadata (each later tile's are loaded while the one before is attended)
        if PAGED:  # the pools from their first row, through the request's page numbers from the split's first tile on
            last = gl.maximum(hi_l - 1, 0)
            p_pt = pt_ptr + i_b * s_pt + gl.where(n_tiles > 0, base // BT, 0)
            row, shift = _tile_rows(_tile_page(p_pt, 0, last, True), 0, last, True)
            pw, t_w, lo_w, end_w = _row_ptrs(p_cc, row, RWC, 2 * C_BITS, WP_L), 0, lo_l, last
        else:  # the planes from the split's first tile on, the first tile masked
            pw, t_w, lo_w, end_w = p_cc, base, lo_valid, hi
        c01 = _load_unit(pw, t_w, lo_w, end_w, 0, RWC, C_BITS, GC, WP_L, 2, PAGED)
        c23 = _load_unit(pw, t_w, lo_w, end_w, 2, RWC, C_BITS, GC, WP_L, 2, PAGED)
        if GC == 8:
            c45 = _load_unit(pw, t_w, lo_w, end_w, 4, RWC, C_BITS, GC, WP_L, 2, PAGED)
            c67 = _load_unit(pw, t_w, lo_w, end_w, 6, RWC, C_BITS, GC, WP_L, 2, PAGED)
            if not PAGED:
                s1, z1 = _load_group(p_cs, p_cz, base, lo_valid, hi, 4, GC, ml)
        else:
            c45 = c01
            c67 = c01
        pr = _row_ptrs(p_rc, row, RWR, R_BITS // 2, WR_L) if PAGED else p_rc
        cr = _load_unit(pr, t_w, lo_w, end_w, GC, RWR, R_BITS, GC, WR_L, 1, PAGED)
        if PAGED:
            s0, z0, s1, z1, sr, zr = _load_meta_rows(p_cs, p_cz, p_rs, p_rz, 0, lo_l, hi_l, last, shift, GC, ml)
            p_cc_s, p_rc_s, p_cs_s, p_cz_s, p_rs_s, p_rz_s = p_cc, p_rc, p_cs, p_cz, p_rs, p_rz
        else:
            s0, z0 = _load_group(p_cs, p_cz, base, lo_valid, hi, 0, GC, ml)
            if GC != 8:
                s1 = s0
                z1 = z0
            sr, zr = _load_group(p_rs, p_rz, base, lo_valid, hi, 0, 0, ml)
            last = hi_l - 1
            p_pt = pt_ptr
            p_cc_s, p_rc_s, p_cs_s, p_cz_s, p_rs_s, p_rz_s = _planes_from(p_cc, p_rc, p_cs, p_cz, p_rs, p_rz, base, GC,
                                                                          C_BITS, R_BITS)
        o_bt = gl.arange(0, BT, layout=row_l).to(gl.int64)
        o_bt32 = gl.arange(0, BT, layout=row_l)
        page_n = _tile_page(p_pt, BT, last, PAGED)  # tile 1's page (each later one is loaded a tile ahead)
        for it in range(n_tiles):
            t_l = it * BT
            kz = it >> 30  # zero at run time, unknown to the compiler: keeps the descriptors in the loop
            acc, c01, c23, c45, c67, cr, s0, z0, s1, z1, sr, zr, page_n = _tile_scores(
                c01, c23, c45, c67, cr, s0, z0, s1, z1, sr, zr, p_cs_s, p_cz_s, p_rs_s, p_rz_s, qbuf, qlo, kbuf, kz,
                p_cc_s, p_rc_s, t_l, lo_l, hi_l, GC, BM, Q_SPLIT, C_BITS, R_BITS, INFLIGHT, WC_L, WP_L, WR_L, acc_l,
                dot_a, ml, last, p_pt, page_n, PAGED)
            o_t = t_l + o_bt32
            m_valid = ((o_t >= lo_l) & (o_t < hi_l))[:, None] & m_m[None, :]
            m_i, l_p, outs = _softmax_pv(acc, kbuf, pbuf, f, m_valid, m_i, l_p, outs, kz, vbuf)

        # The copied tile of a copy program: model-dtype sink copies or the recent ring (`_copy_tile`).
        lo_c, hi_c, sink, p_c, p_r, s_ct, s_rt = _copy_tile(i_s, num_splits, length, i_c, snc_ptr, snr_ptr, rcc_ptr,
                                                             rcr_ptr, s_sncb, s_snct, s_snrb, s_snrt, s_rccb, s_rcct,
                                                             s_rcrb, s_rcrt, S, R, BT)
        o_dt = gl.arange(0, BT, layout=gl.SliceLayout(1, gl.SliceLayout(2, XL))).to(gl.int64)
        for start in range(lo_c, hi_c, BT):
            kz, slot, m_t, m_valid = _copy_rows(start, hi_c, sink, lp, length, o_dt, o_bt, lim_m, m_m, S, R)
            acc = _dense_scores(p_c, p_r, slot, m_t, s_ct, s_rt, qbuf, qlo, kbuf, kz, 0, GC, True, GC, BM, Q_SPLIT,
                                C_BITS, R_BITS, INFLIGHT, XL, acc_l, dot_a)
            m_i, l_p, outs = _softmax_pv(acc, kbuf, pbuf, f, m_valid, m_i, l_p, outs, kz, vbuf)

        inv_l, b_lse = _finish(gl.sum(l_p, axis=0), m_i, o_ptr)
        o_row = (i_b * M + o_m) * (num_splits + ND) + i_s
        for u in gl.static_range(GC):
            _store_o(o_ptr, o_row, m_m, outs[u], inv_l, u, GC, D_C, C_BITS)
        gl.store(lse_ptr + o_row, b_lse, mask=m_m)


# --------------------------------------------------------------------------------------------- host side


def smem_bytes(fmt: CacheFormat, q_split: bool) -> int:
    """Shared memory of one program (`tile_smem`)."""
    return tile_smem(fmt, q_split, BLOCK_M)


def regs_handles(fmt: CacheFormat) -> bool:
    """Whether this kernel takes the format (besides `hopper_handles`): 4 or 8 content groups and either 2- or
    4-bit content with 2-, 4- or 8-bit RoPE, or 8-bit content and RoPE (content keys rounded once to fp16)."""
    c, r = fmt.content.bits, fmt.rope.bits
    return fmt.content.n_groups in (4, 8) and ((c in (2, 4) and r in (2, 4, 8)) or (c == 8 and r == 8))


def launch_gluon(*args, wide_program: bool = False, page_table=None):
    """Launch `mla_decode_gluon_kernel` with `launch_flat`'s arguments (after its `block_m`): `B * cdiv(M, 16) * (NS +
    copy_programs(fmt))` programs of one warpgroup or, `wide_program`, `B * cdiv(M, 32) * (NS + copy_programs(fmt))`
    programs of two (8 warps at `wide.REGS[content bits]` registers, the worker's set again by `setmaxnreg`)."""
    c = args[4].content.bits  # the format's
    if wide_program:
        launch_flat(mla_decode_gluon_kernel, "two-warpgroup Gluon decode kernel", wide.smem_bytes, "gluon_regs",
                    wide.BLOCK_M, *args, page_table=page_table, INFLIGHT=wide.INFLIGHT, WIDE=True, W_REGS=wide.REGS[c],
                    num_warps=4, maxnreg=min(wide.REGS[c], wide.MAX_REGS))
    else:
        launch_flat(mla_decode_gluon_kernel, "register-operand Gluon decode kernel", smem_bytes, "triton", BLOCK_M,
                    *args, page_table=page_table, INFLIGHT=INFLIGHT[c], WIDE=False, W_REGS=0, num_warps=4)
