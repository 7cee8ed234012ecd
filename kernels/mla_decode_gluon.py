"""Hopper (sm_90) packed MLA decode in Gluon: one dequantization per token tile, shared by both dots (issue #11).

Same function as `mla_decode_fast.py` (reference `mla_decode_ref.py`), same partial outputs, same combine; it is
launched by `mla_decode_fast.mla_decode_static(..., backend="gluon")` for the cases `gluon_handles(...)` accepts
(sm_90, packed 2/4/8-bit content in groups of 64, one RoPE group of 64, contiguous plane rows), and by default only
where `mla_decode_fast.gluon_measured_faster` says it was timed faster on the H200. Design (docs/KERNELS.md "Gluon kernel"):

* One program per (split, block of `BM` query rows, batch row), one or two warpgroups (`NW` = 4 or 8 warps).
* The queries of the block are staged once in shared memory, per group of 64 columns, as fp16 `[BM, 64]`
  (times a per-row power of two; high and low parts for fp32 queries), NVMMA-swizzled: the B operand of the scores.
* The packed code bytes of a tile of `BT` = 64 tokens travel as 32-bit words by `cp.async` into a ring of `STAGES`
  shared-memory slots (`STAGES - 1` tiles in flight while one is computed); per-token group scales and zero points
  are prefetched one tile ahead in registers and staged in shared memory for the tile being computed.
* Each group of the tile is unpacked once into the exact fp16 integers `code - z` (fp16 magic number: `code | 0x6400`
  is `1024 + code`, minus `1024 + z`), stored in an NVMMA-swizzled fp16 tile `[BT, 64]` per group (9 of them: 8
  content groups and the RoPE group).
* Scores with tokens as M (swap AB): `S^T[BT, BM] = sum_g s_g[t] * (K_g[BT, 64] @ Q_g^T[64, BM])`, one
  `warpgroup_mma` per group reading both operands from shared memory (exact integer dots, scales applied to the
  `[BT, BM]` partials, as the Triton kernels do).
* Online softmax over the tokens (axis 0), then per content group `P_g = P * s_g[t]` (fp16) is written to shared
  memory and `O_g^T[64, BM] += K_g^T[64, BT] @ P_g[BT, BM]` reads the same unpacked tile, transposed through the
  shared-memory descriptor (MN-major A operand): no second unpack, no register transposes.
* The last split reads the model-dtype sink and recent copies into the same fp16 tiles (unit scales), causal per
  query row.

Gluon kernels do not run in the Triton interpreter; the CPU tests compile this one for sm_90
(tests/test_mla_decode_gluon.py) and check the code-word order it unpacks against the reference packing; on the
H200 `benchmarks/bench_decode.py --check --check-kernels gluon` runs `unpack_group_kernel` bit for bit against
`dequantize_ref` and the kernel against the fp64 reference. Gluon names used here exist in Triton 3.6 and 3.9 (the CTA barrier is
`thread_barrier` in 3.6 and `barrier` in 3.9, `_cta_barrier`; cp.async is `async_copy_global_to_shared` in 3.6 and
`async_load` in 3.9, `_async_load`).
"""

from __future__ import annotations

import torch

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, warpgroup_mma,
                                                                   warpgroup_mma_wait)

    HAVE_GLUON = True
    _cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier  # 3.9 / 3.6
    _async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared  # 3.9 / 3.6
except ImportError:  # a Triton without Gluon (< 3.5): the Triton kernels serve every case
    HAVE_GLUON = False

from quantmla_hf.format import CacheFormat

GROUP = 64  # elements per quantization group this kernel takes (content and RoPE)
BLOCK_T = 64  # tokens per tile: the M of one warpgroup's wgmma


def _identity(fn):
    return fn


_jit = gluon.jit if HAVE_GLUON else _identity


# --------------------------------------------------------------------------------------------- unpacking
@_jit
def _magic(w, SHIFT: gl.constexpr, MASK: gl.constexpr, zf):
    """Code at bit `SHIFT` of every 32-bit word of `w: [BT, W]` minus `zf = 1024 + z` (`[BT, 1]` fp16): the exact
    fp16 integer `code - z` (`code | 0x6400` is the fp16 `1024 + code`)."""
    return (((w >> SHIFT) & MASK) | 0x6400).to(gl.int16).to(gl.float16, bitcast=True) - zf


@_jit
def _order4(y0, y1, y2, y3):
    """`[..., 2, 2]` whose flattening is y0, y1, y2, y3 (join stacks on a new last axis)."""
    return gl.join(gl.join(y0, y2), gl.join(y1, y3))


@_jit
def _order8(x0, x1, x2, x3, x4, x5, x6, x7):
    return gl.join(_order4(x0, x2, x4, x6), _order4(x1, x3, x5, x7))


@_jit
def _unpack_words(w, z, BITS: gl.constexpr, HALF: gl.constexpr):
    """Words `w: [BT, W]` int32 of one group (element `32 / BITS * i + k` at bits `k * BITS` of word i, the byte
    layout of quantmla_hf/format.py read little-endian) and zero points `z: [BT]` (stored `z - HALF`) ->
    `[BT, W * 32 / BITS]` fp16 `code - z` in element order."""
    zf = ((z.to(gl.int32) + (1024 + HALF)).to(gl.float16))[:, None]
    if BITS == 8:
        x = _order4(_magic(w, 0, 255, zf), _magic(w, 8, 255, zf), _magic(w, 16, 255, zf), _magic(w, 24, 255, zf))
    elif BITS == 4:
        x = _order8(_magic(w, 0, 15, zf), _magic(w, 4, 15, zf), _magic(w, 8, 15, zf), _magic(w, 12, 15, zf),
                    _magic(w, 16, 15, zf), _magic(w, 20, 15, zf), _magic(w, 24, 15, zf), _magic(w, 28, 15, zf))
    else:
        x = gl.join(
            _order8(_magic(w, 0, 3, zf), _magic(w, 4, 3, zf), _magic(w, 8, 3, zf), _magic(w, 12, 3, zf),
                    _magic(w, 16, 3, zf), _magic(w, 20, 3, zf), _magic(w, 24, 3, zf), _magic(w, 28, 3, zf)),
            _order8(_magic(w, 2, 3, zf), _magic(w, 6, 3, zf), _magic(w, 10, 3, zf), _magic(w, 14, 3, zf),
                    _magic(w, 18, 3, zf), _magic(w, 22, 3, zf), _magic(w, 26, 3, zf), _magic(w, 30, 3, zf)))
    return gl.reshape(x, [w.shape[0], w.shape[1] * (32 // BITS)])


@_jit
def unpack_group_kernel(w_ptr, z_ptr, out_ptr, W: gl.constexpr, BITS: gl.constexpr, NW: gl.constexpr):
    """Test helper: `_unpack_words` of `[64, W]` words and `[64]` stored zero points -> `out [64, W * 32 / BITS]`
    fp16 (compiled for sm_90 on the CPU by the tests; on a GPU it checks the unpacking order against the
    reference dequantization)."""
    w_l: gl.constexpr = gl.BlockedLayout([1, 1], [32 // W, W], [NW, 1], [1, 0])
    o_t = gl.arange(0, 64, layout=gl.SliceLayout(1, w_l))
    o_w = gl.arange(0, W, layout=gl.SliceLayout(0, w_l))
    w = gl.load(w_ptr + o_t[:, None] * W + o_w[None, :])
    z = gl.load(z_ptr + o_t)
    x = _unpack_words(w, z, BITS, 1 << (BITS - 1))
    E: gl.constexpr = W * 32 // BITS
    x_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])
    x = gl.convert_layout(x, x_l)
    o_r = gl.arange(0, 64, layout=gl.SliceLayout(1, x_l))
    o_e = gl.arange(0, E, layout=gl.SliceLayout(0, x_l))
    gl.store(out_ptr + o_r[:, None] * E + o_e[None, :], x)


# --------------------------------------------------------------------------------------------- tile loads
@_jit
def _issue_tile(stage_c, stage_r, slot, p_cc, p_rc, t0, lo, hi, GC: gl.constexpr, WPG_C: gl.constexpr,
                WPG_R: gl.constexpr, BT: gl.constexpr, CPV_C: gl.constexpr, CPV_R: gl.constexpr, NW: gl.constexpr):
    """cp.async the code words of tokens `[t0, t0 + BT)` (zero-filled outside `[lo, hi)`) into ring slot `slot`,
    one copy per path: content row `g * BT + t` of `stage_c[slot]: [GC * BT, WPG_C]` holds group g of token t
    (group-major, so each group's `[BT, WPG_C]` block is contiguous and reads without bank conflicts), RoPE
    `stage_r[slot]: [BT, WPG_R]`."""
    cl: gl.constexpr = gl.BlockedLayout([1, CPV_C], [32 // (WPG_C // CPV_C), WPG_C // CPV_C], [NW, 1], [1, 0])
    rl: gl.constexpr = gl.BlockedLayout([1, CPV_R], [32 // (WPG_R // CPV_R), WPG_R // CPV_R], [NW, 1], [1, 0])
    rr = gl.arange(0, GC * BT, layout=gl.SliceLayout(1, cl))
    t_c = t0 + (rr % BT).to(gl.int64)
    w_c = gl.arange(0, WPG_C, layout=gl.SliceLayout(0, cl))
    m_c = ((t_c >= lo) & (t_c < hi))[:, None]
    ptr = p_cc + (t_c * (GC * WPG_C) + (rr // BT) * WPG_C)[:, None] + w_c[None, :]
    _async_load(stage_c.index(slot), ptr, mask=m_c)
    t_r = t0 + gl.arange(0, BT, layout=gl.SliceLayout(1, rl)).to(gl.int64)
    w_r = gl.arange(0, WPG_R, layout=gl.SliceLayout(0, rl))
    m_r = ((t_r >= lo) & (t_r < hi))[:, None]
    _async_load(stage_r.index(slot), p_rc + (t_r * WPG_R)[:, None] + w_r[None, :], mask=m_r)


@_jit
def _load_meta(p_cs, p_cz, p_rs, p_rz, t0, lo, hi, GC: gl.constexpr, BT: gl.constexpr, meta_l: gl.constexpr,
               row_l: gl.constexpr, zr_l: gl.constexpr):
    """Scales and zero points of tokens `[t0, t0 + BT)`: content `[GC, BT]` (fp16, int8), RoPE scale `[BT]` in the
    score rows' layout and RoPE zero `[BT]` in the unpacking layout (zeros outside `[lo, hi)`)."""
    o_g = gl.arange(0, GC, layout=gl.SliceLayout(1, meta_l))
    t_m = t0 + gl.arange(0, BT, layout=gl.SliceLayout(0, meta_l)).to(gl.int64)
    m_m = ((t_m >= lo) & (t_m < hi))[None, :]
    off = t_m[None, :] * GC + o_g[:, None]
    s_c = gl.load(p_cs + off, mask=m_m, other=0.0)
    z_c = gl.load(p_cz + off, mask=m_m, other=0)
    t_s = t0 + gl.arange(0, BT, layout=row_l).to(gl.int64)
    s_r = gl.load(p_rs + t_s, mask=(t_s >= lo) & (t_s < hi), other=0.0)
    t_z = t0 + gl.arange(0, BT, layout=zr_l).to(gl.int64)
    z_r = gl.load(p_rz + t_z, mask=(t_z >= lo) & (t_z < hi), other=0)
    return s_c, z_c, s_r, z_r


@_jit
def _dense_tile(kbuf, p_c, p_r, o_t, m_t, s_ct, s_rt, GC: gl.constexpr, d_l: gl.constexpr):
    """Model-dtype copies of tokens `o_t: [BT]` (row slots; `m_t` valid) -> the fp16 tiles `kbuf[g]: [BT, 64]`."""
    o_k = gl.arange(0, 64, layout=gl.SliceLayout(0, d_l))
    for g in gl.static_range(GC):
        x = gl.load(p_c + (o_t * s_ct)[:, None] + g * 64 + o_k[None, :], mask=m_t[:, None], other=0.0)
        kbuf.index(g).store(x.to(gl.float16))
    x = gl.load(p_r + (o_t * s_rt)[:, None] + o_k[None, :], mask=m_t[:, None], other=0.0)
    kbuf.index(GC).store(x.to(gl.float16))


# --------------------------------------------------------------------------------------------- one tile
@_jit
def _pv(kbuf, pbuf, o, alpha, g: gl.constexpr, kz, DENSE: gl.constexpr):
    """`o^T[64, BM] * alpha + K_g^T[64, BT] @ P_g[BT, BM]` (A: the unpacked tile through a transposed descriptor).
    `kz` is a run-time zero added to every buffer index (see `_attend`)."""
    if DENSE:
        b = pbuf.index(kz)
    else:
        b = pbuf.index(g + kz)
    return warpgroup_mma(kbuf.index(g + kz).permute((1, 0)), b, o * alpha[None, :])


@_jit
def _qk_async(kbuf, qbuf, qlo, g: gl.constexpr, kz, zero, Q_SPLIT: gl.constexpr):
    """Issue (without waiting) `K_g @ Q_g^T` (plus the low query part) into a fresh `[BT, BM]` accumulator."""
    a = warpgroup_mma(kbuf.index(g + kz), qbuf.index(g + kz).permute((1, 0)), zero, use_acc=False, is_async=True)
    if Q_SPLIT:
        a = warpgroup_mma(kbuf.index(g + kz), qlo.index(g + kz).permute((1, 0)), a, is_async=True)
    return a


@_jit
def _pv_async(kbuf, pbuf, o, alpha, g: gl.constexpr, kz, DENSE: gl.constexpr):
    """`_pv` issued without waiting."""
    if DENSE:
        b = pbuf.index(kz)
    else:
        b = pbuf.index(g + kz)
    return warpgroup_mma(kbuf.index(g + kz).permute((1, 0)), b, o * alpha[None, :], is_async=True)


@_jit
def _scores_sync(kbuf, qbuf, qlo, msc, kz, zero, GC: gl.constexpr, BT: gl.constexpr, Q_SPLIT: gl.constexpr,
                 DENSE: gl.constexpr, row_l: gl.constexpr):
    """`(sum_g s_g[t] * K_g @ Q_g^T, K_R @ Q_R^T)`, one waited MMA chain per group."""
    sc = gl.zeros_like(zero)
    for g in gl.static_range(GC):
        a = warpgroup_mma(kbuf.index(g + kz), qbuf.index(g + kz).permute((1, 0)), zero, use_acc=False)
        if Q_SPLIT:
            a = warpgroup_mma(kbuf.index(g + kz), qlo.index(g + kz).permute((1, 0)), a)
        if DENSE:
            sc += a
        else:
            sc += a * msc.slice(g * BT, BT).load(row_l).to(gl.float32)[:, None]
    ar = warpgroup_mma(kbuf.index(GC + kz), qbuf.index(GC + kz).permute((1, 0)), zero, use_acc=False)
    if Q_SPLIT:
        ar = warpgroup_mma(kbuf.index(GC + kz), qlo.index(GC + kz).permute((1, 0)), ar)
    return sc, ar


@_jit
def _finish_scores(sc, ar, s_r, fc, fr, DENSE: gl.constexpr):
    """Scores in base 2: content part times the per-row factor, plus the RoPE part times its per-token scale."""
    if DENSE:
        b_s = sc * fc[None, :] + ar * fr[None, :]
    else:
        b_s = sc * fc[None, :] + ar * (s_r.to(gl.float32)[:, None] * fr[None, :])
    return b_s


@_jit
def _attend(kbuf, qbuf, qlo, pbuf, msc, s_r, fc, fr, m_valid, m_i, l_i, o0, o1, o2, o3, o4, o5, o6, o7, kz,
            GC: gl.constexpr, BT: gl.constexpr, BM: gl.constexpr, Q_SPLIT: gl.constexpr, DENSE: gl.constexpr,
            acc_l: gl.constexpr, ASYNC: gl.constexpr):
    """Scores of the unpacked tile (`kbuf`), an online-softmax step over its tokens, and the values of every
    content group. Returns the new `(m_i, l_i, o0..o7)`.

    `kz` is zero at run time but not known to the compiler: added to every shared-memory buffer index, it keeps
    the 64-bit wgmma descriptors (about 140 of them) from being hoisted out of the token loop, where they took
    every register and spilled. It must be a shift of a 64-bit loop variable by less than 64 (a 32-bit value
    shifted by 40 is poison to LLVM: that read the sink tile from a garbage buffer index on the H200).

    With `ASYNC` (8 content groups only) the 9 score MMAs, and then the 8 value MMAs, are issued back to back with
    one wait each instead of one wait per MMA (a launch variant, not the default: not yet run on a GPU)."""
    row_l: gl.constexpr = gl.SliceLayout(1, acc_l)
    zero = gl.zeros([BT, BM], gl.float32, acc_l)
    if ASYNC and GC == 8:
        a0 = _qk_async(kbuf, qbuf, qlo, 0, kz, zero, Q_SPLIT)
        a1 = _qk_async(kbuf, qbuf, qlo, 1, kz, zero, Q_SPLIT)
        a2 = _qk_async(kbuf, qbuf, qlo, 2, kz, zero, Q_SPLIT)
        a3 = _qk_async(kbuf, qbuf, qlo, 3, kz, zero, Q_SPLIT)
        a4 = _qk_async(kbuf, qbuf, qlo, 4, kz, zero, Q_SPLIT)
        a5 = _qk_async(kbuf, qbuf, qlo, 5, kz, zero, Q_SPLIT)
        a6 = _qk_async(kbuf, qbuf, qlo, 6, kz, zero, Q_SPLIT)
        a7 = _qk_async(kbuf, qbuf, qlo, 7, kz, zero, Q_SPLIT)
        ar = _qk_async(kbuf, qbuf, qlo, GC, kz, zero, Q_SPLIT)
        a0, a1, a2, a3, a4, a5, a6, a7, ar = warpgroup_mma_wait(0, deps=[a0, a1, a2, a3, a4, a5, a6, a7, ar])
        if DENSE:
            sc = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7
        else:
            sc = a0 * msc.slice(0, BT).load(row_l).to(gl.float32)[:, None]
            sc += a1 * msc.slice(BT, BT).load(row_l).to(gl.float32)[:, None]
            sc += a2 * msc.slice(2 * BT, BT).load(row_l).to(gl.float32)[:, None]
            sc += a3 * msc.slice(3 * BT, BT).load(row_l).to(gl.float32)[:, None]
            sc += a4 * msc.slice(4 * BT, BT).load(row_l).to(gl.float32)[:, None]
            sc += a5 * msc.slice(5 * BT, BT).load(row_l).to(gl.float32)[:, None]
            sc += a6 * msc.slice(6 * BT, BT).load(row_l).to(gl.float32)[:, None]
            sc += a7 * msc.slice(7 * BT, BT).load(row_l).to(gl.float32)[:, None]
    else:
        sc, ar = _scores_sync(kbuf, qbuf, qlo, msc, kz, zero, GC, BT, Q_SPLIT, DENSE, row_l)
    b_s = _finish_scores(sc, ar, s_r, fc, fr, DENSE)
    b_s = gl.where(m_valid, b_s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(b_s, axis=0))
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_use)
    p = gl.exp2(b_s - m_use[None, :])
    l_i = l_i * alpha + gl.sum(p, axis=0)
    if DENSE:
        pbuf.index(kz).store(p.to(gl.float16))
    else:
        for g in gl.static_range(GC):
            pbuf.index(g + kz).store((p * msc.slice(g * BT, BT).load(row_l).to(gl.float32)[:, None]).to(gl.float16))
    fence_async_shared()
    _cta_barrier()
    if ASYNC and GC == 8:
        o0 = _pv_async(kbuf, pbuf, o0, alpha, 0, kz, DENSE)
        o1 = _pv_async(kbuf, pbuf, o1, alpha, 1, kz, DENSE)
        o2 = _pv_async(kbuf, pbuf, o2, alpha, 2, kz, DENSE)
        o3 = _pv_async(kbuf, pbuf, o3, alpha, 3, kz, DENSE)
        o4 = _pv_async(kbuf, pbuf, o4, alpha, 4, kz, DENSE)
        o5 = _pv_async(kbuf, pbuf, o5, alpha, 5, kz, DENSE)
        o6 = _pv_async(kbuf, pbuf, o6, alpha, 6, kz, DENSE)
        o7 = _pv_async(kbuf, pbuf, o7, alpha, 7, kz, DENSE)
        o0, o1, o2, o3, o4, o5, o6, o7 = warpgroup_mma_wait(0, deps=[o0, o1, o2, o3, o4, o5, o6, o7])
    else:
        o0 = _pv(kbuf, pbuf, o0, alpha, 0, kz, DENSE)
        if GC > 1:
            o1 = _pv(kbuf, pbuf, o1, alpha, 1, kz, DENSE)
        if GC > 2:
            o2 = _pv(kbuf, pbuf, o2, alpha, 2, kz, DENSE)
            o3 = _pv(kbuf, pbuf, o3, alpha, 3, kz, DENSE)
        if GC > 4:
            o4 = _pv(kbuf, pbuf, o4, alpha, 4, kz, DENSE)
            o5 = _pv(kbuf, pbuf, o5, alpha, 5, kz, DENSE)
            o6 = _pv(kbuf, pbuf, o6, alpha, 6, kz, DENSE)
            o7 = _pv(kbuf, pbuf, o7, alpha, 7, kz, DENSE)
    return m_new, l_i, o0, o1, o2, o3, o4, o5, o6, o7


@_jit
def _store_o(o_ptr, o_row, m_m, o, inv_l, g: gl.constexpr, GC: gl.constexpr, D_C: gl.constexpr, acc_l: gl.constexpr):
    """`o^T[64, BM]` of group g, normalised, to the partial output rows `o_row: [BM]`."""
    if g < GC:
        o_d = gl.arange(0, 64, layout=gl.SliceLayout(1, acc_l))
        gl.store(o_ptr + o_row[None, :] * D_C + g * 64 + o_d[:, None], o * inv_l[None, :], mask=m_m[None, :])


@_jit
def _stage_queries(qbuf, qlo, p_q, row0, M, D: gl.constexpr, G0: gl.constexpr, NG: gl.constexpr,
                   BM: gl.constexpr, Q_SPLIT: gl.constexpr, q_l: gl.constexpr):
    """Rows `row0 + [0, BM)` of `p_q: [M, D]` divided by a per-row power of two `f` (so `|q| / f < 2**14`), as fp16
    (high, and low for fp32 queries) in `qbuf[G0 + g]: [BM, 64]`, g < NG. Returns `f: [BM]` (layout of q_l rows)."""
    o_m = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, q_l))
    m_m = (o_m < M)[:, None]
    o_k = gl.arange(0, 64, layout=gl.SliceLayout(0, q_l))
    amax = gl.zeros([BM], gl.float32, gl.SliceLayout(1, q_l))
    for g in gl.static_range(NG):
        x = gl.load(p_q + o_m[:, None] * D + g * 64 + o_k[None, :], mask=m_m, other=0.0).to(gl.float32)
        amax = gl.maximum(amax, gl.max(gl.abs(x), axis=1))
    e = gl.maximum(gl.ceil(gl.log2(gl.maximum(amax, 1.0) / 16384.0)), 0.0)
    inv_f = gl.exp2(-e)
    for g in gl.static_range(NG):
        x = gl.load(p_q + o_m[:, None] * D + g * 64 + o_k[None, :], mask=m_m, other=0.0).to(gl.float32)
        x = x * inv_f[:, None]
        hi = x.to(gl.float16)
        qbuf.index(G0 + g).store(hi)
        if Q_SPLIT:
            qlo.index(G0 + g).store((x - hi.to(gl.float32)).to(gl.float16))
    return gl.exp2(e)


# --------------------------------------------------------------------------------------------- the kernel
def _jit_dynamic(fn):
    """`gluon.jit` without specialisation on the per-step counts (each new value would compile a new kernel)."""
    if not HAVE_GLUON:
        return fn
    return gluon.jit(fn, do_not_specialize=["M", "Tq", "split_target", "num_splits"])


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
    BM: gl.constexpr, Q_SPLIT: gl.constexpr, STAGES: gl.constexpr, CPV_C: gl.constexpr, CPV_R: gl.constexpr,
    NW: gl.constexpr, ASYNC: gl.constexpr,
):
    """One program per (split, block of BM rows, batch row). Splits `0 .. num_splits-1` take the packed positions
    `[i * tokens_per_split, (i + 1) * tokens_per_split)` (tile-aligned) intersected with `[S, length - R)` and
    `[lp + S, ...)`, where `tokens_per_split = max(2 * 64, round_up(cdiv(length - R, split_target), 64))` comes from
    the device-side length (`mla_decode_fast.split_plan`: the same boundaries whatever the capacity); split
    `num_splits` takes the sink and recent copies. Planes are passed as 32-bit words for the
    codes (`cc_ptr`, `rc_ptr`), rows contiguous. Writes normalised partials `o: [B, M, num_splits + 1, D_C]` and
    `lse: [B, M, num_splits + 1]` (natural log, -inf when empty)."""
    BT: gl.constexpr = 64
    D_C: gl.constexpr = GC * 64
    D_R: gl.constexpr = 64
    WPG_C: gl.constexpr = 2 * C_BITS  # 32-bit words per group of 64 codes
    WPG_R: gl.constexpr = 2 * R_BITS
    WG_N: gl.constexpr = NW // 4
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WG_N],
                                                    instr_shape=[16, BM // WG_N, 16])
    row_l: gl.constexpr = gl.SliceLayout(1, acc_l)  # per token
    col_l: gl.constexpr = gl.SliceLayout(0, acc_l)  # per query row
    k_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    p_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=2 * BM if BM < 64 else 128, element_bitwidth=16,
                                              rank=2)
    plain: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    plain1: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    q_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])
    d_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])
    wc_l: gl.constexpr = gl.BlockedLayout([1, 1], [32 // WPG_C, WPG_C], [NW, 1], [1, 0])
    wr_l: gl.constexpr = gl.BlockedLayout([1, 1], [32 // WPG_R, WPG_R], [NW, 1], [1, 0])
    meta_l: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [NW, 1], [1, 0])
    HALF_C: gl.constexpr = 1 << (C_BITS - 1)
    HALF_R: gl.constexpr = 1 << (R_BITS - 1)

    i_s = gl.program_id(0).to(gl.int64)
    i_hb = gl.program_id(1)
    i_b = gl.program_id(2).to(gl.int64)
    length = gl.load(len_ptr).to(gl.int64)
    lp = gl.load(lp_ptr + i_b).to(gl.int64)
    o_m = i_hb * BM + gl.arange(0, BM, layout=col_l)
    m_m = o_m < M
    lim_m = length - Tq + (o_m % Tq) + 1  # query t of Tq sees positions < length - Tq + t + 1

    # Shared memory: unpacked tiles (8 content groups + RoPE), queries, per-group P, metadata, the cp.async ring.
    kbuf = gl.allocate_shared_memory(gl.float16, [GC + 1, BT, 64], k_sl)
    qbuf = gl.allocate_shared_memory(gl.float16, [GC + 1, BM, 64], k_sl)
    if Q_SPLIT:
        qlo = gl.allocate_shared_memory(gl.float16, [GC + 1, BM, 64], k_sl)
    else:
        qlo = qbuf
    pbuf = gl.allocate_shared_memory(gl.float16, [GC, BT, BM], p_sl)
    msc = gl.allocate_shared_memory(gl.float16, [GC * BT], plain1)
    mzc = gl.allocate_shared_memory(gl.int8, [GC * BT], plain1)
    stage_c = gl.allocate_shared_memory(gl.int32, [STAGES, GC * BT, WPG_C], plain)
    stage_r = gl.allocate_shared_memory(gl.int32, [STAGES, BT, WPG_R], plain)

    fc = _stage_queries(qbuf, qlo, q_ptr + i_b * s_qb, i_hb * BM, M, D_C, 0, GC, BM, Q_SPLIT, q_l)
    fr = _stage_queries(qbuf, qlo, qr_ptr + i_b * s_qrb, i_hb * BM, M, D_R, GC, 1, BM, Q_SPLIT, q_l)
    fc = gl.convert_layout(fc, col_l) * qk_scale  # scores in base 2, pre-multiplied by scaling * log2(e)
    fr = gl.convert_layout(fr, col_l) * qk_scale

    m_i = gl.full([BM], float("-inf"), gl.float32, col_l)
    l_i = gl.zeros([BM], gl.float32, col_l)
    o0 = gl.zeros([64, BM], gl.float32, acc_l)
    o1 = gl.zeros([64, BM], gl.float32, acc_l)
    o2 = gl.zeros([64, BM], gl.float32, acc_l)
    o3 = gl.zeros([64, BM], gl.float32, acc_l)
    o4 = gl.zeros([64, BM], gl.float32, acc_l)
    o5 = gl.zeros([64, BM], gl.float32, acc_l)
    o6 = gl.zeros([64, BM], gl.float32, acc_l)
    o7 = gl.zeros([64, BM], gl.float32, acc_l)
    is_dense = i_s == num_splits

    # Packed positions of this split: tiles aligned to BT from position i_s * tokens_per_split, the share of
    # [0, length - R) sized from the length (not the capacity: `split_plan`).
    covered = gl.maximum(length - R, 0)
    tokens_per_split = (covered + split_target - 1) // split_target
    tokens_per_split = gl.maximum((tokens_per_split + BT - 1) // BT * BT, 2 * BT)
    base = i_s * tokens_per_split
    lo = gl.maximum(base, S)
    hi = gl.where(is_dense, lo, gl.minimum(base + tokens_per_split, length - R))
    lo_valid = gl.maximum(lo, lp + S)
    n_tiles = gl.where(hi > lo, (hi - base + BT - 1) // BT, 0).to(gl.int32)
    p_cc = cc_ptr + i_b * s_ccb
    p_rc = rc_ptr + i_b * s_rcb
    p_cs = cs_ptr + i_b * s_csb
    p_cz = cz_ptr + i_b * s_csb
    p_rs = rs_ptr + i_b * s_rsb
    p_rz = rz_ptr + i_b * s_rsb
    for st in gl.static_range(STAGES - 1):
        _issue_tile(stage_c, stage_r, st, p_cc, p_rc, base + st * BT, lo_valid, hi, GC, WPG_C, WPG_R, BT, CPV_C,
                    CPV_R, NW)
        async_copy.commit_group()
    s_c, z_c, s_r, z_r = _load_meta(p_cs, p_cz, p_rs, p_rz, base, lo_valid, hi, GC, BT, meta_l, row_l,
                                    gl.SliceLayout(1, wr_l))
    o_bt = gl.arange(0, BT, layout=row_l).to(gl.int64)
    for it in range(n_tiles):
        t0 = base + it * BT
        _cta_barrier()  # the slot refilled below and the tiles of the previous step are no longer read
        _issue_tile(stage_c, stage_r, (it + STAGES - 1) % STAGES, p_cc, p_rc, t0 + (STAGES - 1) * BT, lo_valid, hi,
                    GC, WPG_C, WPG_R, BT, CPV_C, CPV_R, NW)
        async_copy.commit_group()
        msc.store(gl.reshape(s_c, [GC * BT]))
        mzc.store(gl.reshape(z_c, [GC * BT]))
        s_rt = s_r
        z_rt = z_r
        s_c, z_c, s_r, z_r = _load_meta(p_cs, p_cz, p_rs, p_rz, t0 + BT, lo_valid, hi, GC, BT, meta_l, row_l,
                                        gl.SliceLayout(1, wr_l))
        async_copy.wait_group(STAGES - 1)
        _cta_barrier()
        slot = it % STAGES
        for g in gl.static_range(GC):
            w = stage_c.index(slot).slice(g * BT, BT).load(wc_l)
            kbuf.index(g).store(_unpack_words(w, mzc.slice(g * BT, BT).load(gl.SliceLayout(1, wc_l)), C_BITS, HALF_C))
        w = stage_r.index(slot).load(wr_l)
        kbuf.index(GC).store(_unpack_words(w, z_rt, R_BITS, HALF_R))
        fence_async_shared()
        _cta_barrier()
        o_t = t0 + o_bt
        m_valid = ((o_t >= lo_valid) & (o_t < hi))[:, None] & m_m[None, :]
        m_i, l_i, o0, o1, o2, o3, o4, o5, o6, o7 = _attend(
            kbuf, qbuf, qlo, pbuf, msc, s_rt, fc, fr, m_valid, m_i, l_i, o0, o1, o2, o3, o4, o5, o6, o7,
            (it >> 30), GC, BT, BM, Q_SPLIT, False, acc_l, ASYNC)
    async_copy.wait_group(0)

    # The last split: model-dtype sink copies (slot j = position lp + j) and the recent ring (slot p % R).
    o_dt = gl.arange(0, BT, layout=gl.SliceLayout(1, d_l)).to(gl.int64)
    n_sink = gl.where(is_dense, S, 0)
    p_snc = snc_ptr + i_b * s_sncb
    p_snr = snr_ptr + i_b * s_snrb
    for start in range(0, n_sink, BT):
        _cta_barrier()
        o_j = start + o_dt
        _dense_tile(kbuf, p_snc, p_snr, o_j, (o_j < S) & (lp + o_j < length), s_snct, s_snrt, GC, d_l)
        fence_async_shared()
        _cta_barrier()
        o_jr = start + o_bt
        o_t = lp + o_jr
        m_valid = ((o_jr < S) & (o_t < length))[:, None] & m_m[None, :] & (o_t[:, None] < lim_m[None, :])
        m_i, l_i, o0, o1, o2, o3, o4, o5, o6, o7 = _attend(
            kbuf, qbuf, qlo, pbuf, msc, s_r, fc, fr, m_valid, m_i, l_i, o0, o1, o2, o3, o4, o5, o6, o7,
            (start.to(gl.int64) >> 40).to(gl.int32), GC, BT, BM, Q_SPLIT, True, acc_l, ASYNC)
    r_lo = gl.maximum(length - R, 0)
    r_hi = gl.where(is_dense, length, r_lo)
    lo_dense = lp + S
    p_rcc = rcc_ptr + i_b * s_rccb
    p_rcr = rcr_ptr + i_b * s_rcrb
    for start in range(r_lo, r_hi, BT):
        _cta_barrier()
        o_p = start + o_dt
        _dense_tile(kbuf, p_rcc, p_rcr, o_p % R, (o_p < r_hi) & (o_p >= lo_dense), s_rcct, s_rcrt, GC, d_l)
        fence_async_shared()
        _cta_barrier()
        o_t = start + o_bt
        m_valid = ((o_t < r_hi) & (o_t >= lo_dense))[:, None] & m_m[None, :] & (o_t[:, None] < lim_m[None, :])
        m_i, l_i, o0, o1, o2, o3, o4, o5, o6, o7 = _attend(
            kbuf, qbuf, qlo, pbuf, msc, s_r, fc, fr, m_valid, m_i, l_i, o0, o1, o2, o3, o4, o5, o6, o7,
            (start.to(gl.int64) >> 40).to(gl.int32), GC, BT, BM, Q_SPLIT, True, acc_l, ASYNC)

    has = l_i > 0
    inv_l = gl.where(has, 1.0 / gl.where(has, l_i, 1.0), 0.0)
    b_lse = gl.where(has, (m_i + gl.log2(gl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    o_row = (i_b * M + o_m) * (num_splits + 1) + i_s
    _store_o(o_ptr, o_row, m_m, o0, inv_l, 0, GC, D_C, acc_l)
    _store_o(o_ptr, o_row, m_m, o1, inv_l, 1, GC, D_C, acc_l)
    _store_o(o_ptr, o_row, m_m, o2, inv_l, 2, GC, D_C, acc_l)
    _store_o(o_ptr, o_row, m_m, o3, inv_l, 3, GC, D_C, acc_l)
    _store_o(o_ptr, o_row, m_m, o4, inv_l, 4, GC, D_C, acc_l)
    _store_o(o_ptr, o_row, m_m, o5, inv_l, 5, GC, D_C, acc_l)
    _store_o(o_ptr, o_row, m_m, o6, inv_l, 6, GC, D_C, acc_l)
    _store_o(o_ptr, o_row, m_m, o7, inv_l, 7, GC, D_C, acc_l)
    gl.store(lse_ptr + o_row, b_lse, mask=m_m)


# --------------------------------------------------------------------------------------------- host side
def codes_from_words(words: torch.Tensor, bits: int) -> torch.Tensor:
    """What `_unpack_words` reads from `words: [..., W]` int32 (a `codes.view(torch.int32)`): `[..., W * 32 / bits]`
    codes, element `32 / bits * i + k` at bits `[k * bits, (k + 1) * bits)` of word i (PyTorch, for the tests: the
    kernel relies on this matching the byte layout of quantmla_hf/format.py on a little-endian machine)."""
    per = 32 // bits
    shifts = torch.arange(per, device=words.device, dtype=torch.int64) * bits
    w = words.to(torch.int64) & 0xFFFFFFFF
    return ((w.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).reshape(*words.shape[:-1], words.shape[-1] * per)


def cp_vec(words_per_group: int, num_warps: int) -> int:
    """32-bit words per cp.async of a `[64, words_per_group]` block (16 bytes at most, at most one thread per
    element of the block: the copy layout must not wrap)."""
    return max(1, min(4, BLOCK_T * words_per_group // (32 * num_warps)))


SMEM_LIMIT = 232448  # bytes of shared memory one sm_90 block may use (227 KB)


def smem_bytes(fmt: CacheFormat, block_m: int, stages: int, q_split: bool) -> int:
    """Shared memory of one program: unpacked tiles, queries (twice for fp32), P tiles, metadata and the cp.async
    ring, plus 1 KB for the compiler's scratch (within 512 B of ptxas for the launches compiled so far)."""
    gc = fmt.content.n_groups
    tiles = (gc + 1) * BLOCK_T * GROUP * 2
    queries = (gc + 1) * block_m * GROUP * 2 * (2 if q_split else 1)
    probs = gc * BLOCK_T * block_m * 2
    meta = gc * BLOCK_T * 3
    ring = stages * BLOCK_T * (fmt.content.code_bytes + fmt.rope.code_bytes)
    return tiles + queries + probs + meta + ring + 1024


def fit_stages(fmt: CacheFormat, block_m: int, stages: int, q_split: bool) -> int:
    """The most cp.async stages, at most `stages`, whose program fits in `SMEM_LIMIT` (0 if none does)."""
    while stages > 0 and smem_bytes(fmt, block_m, stages, q_split) > SMEM_LIMIT:
        stages -= 1
    return stages


def gluon_handles(fmt: CacheFormat, q_dtype: torch.dtype, device, copy_dtype: torch.dtype | None = None) -> bool:
    """Whether this kernel computes the case: Gluon available, a CUDA device of compute capability 9.0 (wgmma),
    both paths packed at 2/4/8 bits in groups of 64 (content: 1..8 groups, a power of two; RoPE: one group), bf16/
    fp16/fp32 queries, bf16/fp16 copies. (The plane rows must also be contiguous: checked at launch.)"""
    if not HAVE_GLUON:
        return False
    c, r = fmt.content, fmt.rope
    if not (c.quantized and r.quantized and c.bits in (2, 4, 8) and r.bits in (2, 4, 8)):
        return False
    if c.group != GROUP or r.group != GROUP or r.n_groups != 1 or c.n_groups not in (1, 2, 4, 8):
        return False
    if q_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    if copy_dtype is not None and copy_dtype not in (torch.bfloat16, torch.float16):
        return False
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


def planes_contiguous(fmt: CacheFormat, content_planes: dict, rope_planes: dict) -> bool:
    """Plane rows laid out as docs/CACHE_FORMAT.md says with nothing between tokens (what the word view and the
    compile-time token strides assume)."""
    for f, planes in ((fmt.content, content_planes), (fmt.rope, rope_planes)):
        codes, scale, zero = planes["codes"], planes["scale"], planes["zero"]
        if codes.stride(2) != 1 or codes.stride(1) != f.code_bytes or codes.storage_offset() % 4:
            return False
        if codes.data_ptr() % 16 or codes.stride(0) % 4:
            return False
        for m in (scale, zero):
            if m.stride(2) != 1 or m.stride(1) != f.n_groups:
                return False
        if scale.stride() != zero.stride():
            return False
    return True


def launch_gluon(q, qr, cp, rp, fmt, sink_c, sink_r, recent_c, recent_r, lp, length, o_part, lse_part, M, Tq,
                 split_target, NS, qk_scale, block_m, num_warps, stages, async_mma=False):
    """Launch `mla_decode_gluon_kernel` on the grid `(NS + 1, cdiv(M, block_m), B)`; the kernel sizes the splits
    from the device-side length and `split_target` (`mla_decode_fast.split_plan`), `NS` must cover them.
    `stages` is lowered until the program fits in shared memory (`fit_stages`)."""
    B = q.shape[0]
    q_split = q.dtype == torch.float32 or qr.dtype == torch.float32
    fitted = fit_stages(fmt, block_m, stages, q_split)
    if fitted < 1:
        raise ValueError(f"the Gluon decode kernel with {block_m}-row blocks needs "
                         f"{smem_bytes(fmt, block_m, 1, q_split)} bytes of shared memory for {fmt.name}, more than "
                         f"{SMEM_LIMIT}: use a smaller block_m or backend='triton'")
    cw, rw = cp["codes"].view(torch.int32), rp["codes"].view(torch.int32)
    wpg_c, wpg_r = 2 * fmt.content.bits, 2 * fmt.rope.bits
    grid = (NS + 1, -(-M // block_m), B)
    mla_decode_gluon_kernel[grid](
        q, qr, cw, cp["scale"], cp["zero"], rw, rp["scale"], rp["zero"],
        sink_c, sink_r, recent_c, recent_r, lp, length, o_part, lse_part,
        M, Tq, split_target, NS, qk_scale,
        q.stride(0), qr.stride(0), cw.stride(0), cp["scale"].stride(0), rw.stride(0), rp["scale"].stride(0),
        sink_c.stride(0), sink_c.stride(1), sink_r.stride(0), sink_r.stride(1),
        recent_c.stride(0), recent_c.stride(1), recent_r.stride(0), recent_r.stride(1),
        GC=fmt.content.n_groups, C_BITS=fmt.content.bits, R_BITS=fmt.rope.bits, S=fmt.sink_tokens,
        R=fmt.recent_tokens, BM=block_m, Q_SPLIT=q_split, STAGES=fitted, CPV_C=cp_vec(wpg_c, num_warps),
        CPV_R=cp_vec(wpg_r, num_warps), NW=num_warps, ASYNC=bool(async_mma),
        num_warps=num_warps,
    )
