"""Hopper (sm_90) packed MLA decode in Gluon on *scaled* fp16 tiles: two programs per SM (issue #11).

Same function, partial outputs and combine as `mla_decode_gluon.py` (reference `mla_decode_ref.py`), launched by
`mla_decode_fast.mla_decode_static(..., backend="gluon", scaled=True)`; by default where
`mla_decode_fast.gluon_scaled_measured_faster` says it was timed faster on the H200. What differs from the
exact-integer Gluon kernel (docs/KERNELS.md "Gluon kernel on scaled tiles"):

* Each group of a 64-token tile is unpacked once into fp16 `(code - z) * s` (the exact integer `code - z` by the
  fp16 magic number, then one rounding by the group's fp16 step `s`), for content and RoPE alike, two elements per
  register by inline PTX (`pair_asm`: `lop3`, `sub.f16x2`, `mul.f16x2`), in the tile column order that needs no
  reordering (`column_order`; the queries are staged and the outputs stored in it). The tile in shared memory then
  holds the dequantized keys, so
  - the scores are ONE `warpgroup_mma` chain over all 9 groups into one `[BT, BM]` accumulator (the exact kernel
    keeps a partial per group and scales it: 9 accumulators live, 255 registers with spills),
  - the probabilities are stored once, `P: [BT, BM]` fp16 (the exact kernel stores `P * s_g` per group: 8 tiles),
  - the sink and recent copies fill the same tiles (unit scale): one attention step for packed and copied tokens.
* Shared memory per program (C4R4, 16 rows): unpacked tiles 72 KB + queries 18 KB + P 2 KB + one 18 KB cp.async
  slot + 1.5 KB metadata = 112 KB: two programs fit one SM (228 KB), so one program's unpacking (ALU) overlaps the
  other's `wgmma` and softmax. The exact kernel needs 166 KB: one program, one warpgroup per SM, every step in
  series.
* The cp.async of tile `i + STAGES` is issued as soon as tile i has been unpacked (its slot is free), so with one
  slot one tile is in flight per program while a tile is attended.
* The queries of the block share one per-row power of two for content and RoPE (one accumulator).
* The row sums of the online softmax stay per (token lane, row) until the end: one cross-warp reduction per tile
  (the maximum) instead of two.
* The sink and recent copies take one program per 64-token tile (`copy_programs`: 3 for 4 + 128 tokens) instead of
  one program for all: at batch 1 that program was the longest. The combine merges them as its last `N_TAIL` slots.

Accuracy: the one extra rounding per key element (relative 2**-12) is far below the 2- and 4-bit quantization
step; the LSE stays within 1e-4 of the fp64 reference (`bench_decode.py --check`). At 8 bits it would not (keys
up to 255 steps: 4.5e-3 in a simulation), so 8-bit content stays on the exact kernel (`scaled_handles`).

Gluon kernels do not run in the Triton interpreter; tests/test_mla_decode_gluon.py compiles this one for sm_90 on
the CPU (shared memory within two programs per SM, the wgmma count) and the H200 runs it against the fp64
reference.
"""

from __future__ import annotations

import torch

from quantmla_hf.format import CacheFormat

from . import mla_decode_gluon as exact
from .mla_decode_gluon import BLOCK_T, GROUP, HAVE_GLUON, SMEM_LIMIT, _jit

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, warpgroup_mma,
                                                                   warpgroup_mma_wait)

    from .mla_decode_gluon import _cta_barrier, _issue_tile, _order4, _order8

SMEM_PER_SM = 233472  # bytes of shared memory of one sm_90 multiprocessor (228 KB); each block also reserves 1 KB


# --------------------------------------------------------------------------------------------- unpacking
def pair_asm(bits: int) -> str:
    """PTX that turns one 32-bit code word into `16 / bits` registers of two fp16 `(code - z) * s` each.

    Operands: outputs `$0 .. $(n-1)` (n = 16 / bits), then the word `$n`, `$(n+1)` = fp16x2 `(1024 + z, 1024 + z)`
    and `$(n+2)` = fp16x2 `(s, s)`. Output k holds elements k (low half) and k + n (high half) of the word's
    `2n = 32 / bits` elements: one `lop3` puts both codes under the fp16 magic number `0x6400` (`1024 + code`),
    one `sub.f16x2` (exact) and one `mul.f16x2` (one rounding) finish two elements, plus a shift per output
    after the first."""
    n = 16 // bits
    mask = (1 << bits) - 1
    mask2 = mask | (mask << 16)
    lines = ["{", ".reg .b32 t;"]
    for k in range(n):
        if k:
            lines.append(f"shr.u32 t, ${n}, {bits * k};")
            lines.append(f"lop3.b32 t, t, {mask2:#010x}, 0x64006400, 0xEA;")
        else:
            lines.append(f"lop3.b32 t, ${n}, {mask2:#010x}, 0x64006400, 0xEA;")
        lines.append(f"sub.f16x2 t, t, ${n + 1};")
        lines.append(f"mul.f16x2 ${k}, t, ${n + 2};")
    lines.append("}")
    return "\n".join(lines)


def column_order(bits: int, width: int = GROUP) -> torch.Tensor:
    """`pi: [width]` int64: column c of an unpacked tile holds element `pi[c]` of its group (channel `g * 64 +
    pi[c]`). Word i's output k (`pair_asm`) is stored as fp16 columns `2 * (n * i + k)` and `+ 1`, so with
    `E = 32 / bits` elements per word, `c = E * i + 2 * k + h` holds element `E * i + k + (E / 2) * h`. The scores
    are a sum over columns (the queries are staged in the same order) and the values' rows come out in this order
    (stored back to their channels): only the code that fills and empties tiles knows it."""
    c = torch.arange(width)
    e = 32 // bits
    return (c // e) * e + (c % e) // 2 + (e // 2) * (c % 2)


if HAVE_GLUON:
    _PAIR_ASM_2 = gl.constexpr(pair_asm(2))
    _PAIR_ASM_4 = gl.constexpr(pair_asm(4))


@_jit
def _pi(c, BITS: gl.constexpr):
    """`column_order` in the kernel: the group element held by tile column `c`."""
    E: gl.constexpr = 32 // BITS
    return (c // E) * E + (c % E) // 2 + (E // 2) * (c % 2)


@_jit
def _fp16x2(x):
    """`[BT]` fp16 -> `[BT]` int32 holding the value twice (low and high half)."""
    v = x.to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
    return v | (v << 16)


@_jit
def _unpack_pairs(w, z, s, BITS: gl.constexpr, HALF: gl.constexpr):
    """Words `w: [BT, W]` int32 of one group, stored zero points `z: [BT]` int8 (`z - HALF`) and steps `s: [BT]`
    fp16 (both in the row layout of `w`) -> `[BT, W * 16 / BITS]` int32: fp16 pairs `(code - z) * s`, pair
    `p = (16 / BITS) * i + k` = output k of word i (`pair_asm`), i.e. fp16 columns in `column_order`."""
    zz = _fp16x2((z.to(gl.int32) + (1024 + HALF)).to(gl.float16))[:, None]
    ss = _fp16x2(s)[:, None]
    w, zz = gl.broadcast(w, zz)
    w, ss = gl.broadcast(w, ss)
    if BITS == 4:
        r0, r1, r2, r3 = gl.inline_asm_elementwise(_PAIR_ASM_4, "=r,=r,=r,=r,r,r,r", [w, zz, ss],
                                                   dtype=[gl.int32] * 4, is_pure=True, pack=1)
        x = _order4(r0, r1, r2, r3)
    else:
        r0, r1, r2, r3, r4, r5, r6, r7 = gl.inline_asm_elementwise(
            _PAIR_ASM_2, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r", [w, zz, ss], dtype=[gl.int32] * 8, is_pure=True, pack=1)
        x = _order8(r0, r1, r2, r3, r4, r5, r6, r7)
    return gl.reshape(x, [w.shape[0], w.shape[1] * (16 // BITS)])


if HAVE_GLUON and hasattr(gl.shared_memory_descriptor, "reinterpret"):  # Triton 3.9

    @_jit
    def _as_pairs(buf):
        """An fp16 `[N, BT, 64]` NVMMA-swizzled tile buffer viewed as int32 `[N, BT, 32]` (same 128-byte rows, same
        16-byte swizzle: the bytes land where the fp16 view reads them)."""
        pl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
        return buf.reinterpret(gl.int32, [buf.shape[0], buf.shape[1], 32], pl)

else:  # Triton 3.6 names it `_reinterpret`

    @_jit
    def _as_pairs(buf):
        """An fp16 `[N, BT, 64]` NVMMA-swizzled tile buffer viewed as int32 `[N, BT, 32]` (same 128-byte rows, same
        16-byte swizzle: the bytes land where the fp16 view reads them)."""
        pl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
        return buf._reinterpret(gl.int32, [buf.shape[0], buf.shape[1], 32], pl)


@_jit
def unpack_scaled_kernel(w_ptr, z_ptr, s_ptr, out_ptr, W: gl.constexpr, BITS: gl.constexpr, NW: gl.constexpr):
    """Test helper: `_unpack_pairs` of `[64, W]` words, `[64]` stored zero points and `[64]` fp16 steps, through
    a swizzled shared tile as the kernel stores it, read back as fp16 -> `out [64, W * 32 / BITS]` in
    `column_order` (on a GPU `bench_decode.py --check` runs it against the reference dequantization rounded to
    fp16; the CPU tests compile it for sm_90)."""
    w_l: gl.constexpr = gl.BlockedLayout([1, 1], [32 // W, W], [NW, 1], [1, 0])
    k_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    o_t = gl.arange(0, 64, layout=gl.SliceLayout(1, w_l))
    o_w = gl.arange(0, W, layout=gl.SliceLayout(0, w_l))
    w = gl.load(w_ptr + o_t[:, None] * W + o_w[None, :])
    x = _unpack_pairs(w, gl.load(z_ptr + o_t), gl.load(s_ptr + o_t), BITS, 1 << (BITS - 1))
    E: gl.constexpr = W * 32 // BITS
    buf = gl.allocate_shared_memory(gl.float16, [1, 64, E], k_sl)
    _as_pairs(buf).index(0).store(x)
    _cta_barrier()
    x_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])
    y = buf.index(0).load(x_l)
    o_r = gl.arange(0, 64, layout=gl.SliceLayout(1, x_l))
    o_e = gl.arange(0, E, layout=gl.SliceLayout(0, x_l))
    gl.store(out_ptr + o_r[:, None] * E + o_e[None, :], y)


# --------------------------------------------------------------------------------------------- metadata, queries
@_jit
def _load_meta(p_cs, p_cz, p_rs, p_rz, t0, lo, hi, GC: gl.constexpr, BT: gl.constexpr, meta_l: gl.constexpr,
               r_l: gl.constexpr):
    """Steps and zero points of tokens `[t0, t0 + BT)`: content `[GC, BT]` (fp16, int8) and RoPE `[BT]` in the
    RoPE unpacking layout `r_l` (zeros outside `[lo, hi)`: the tile's masked tokens unpack to 0)."""
    o_g = gl.arange(0, GC, layout=gl.SliceLayout(1, meta_l))
    t_m = t0 + gl.arange(0, BT, layout=gl.SliceLayout(0, meta_l)).to(gl.int64)
    m_m = ((t_m >= lo) & (t_m < hi))[None, :]
    off = t_m[None, :] * GC + o_g[:, None]
    s_c = gl.load(p_cs + off, mask=m_m, other=0.0)
    z_c = gl.load(p_cz + off, mask=m_m, other=0)
    t_r = t0 + gl.arange(0, BT, layout=r_l).to(gl.int64)
    m_r = (t_r >= lo) & (t_r < hi)
    s_r = gl.load(p_rs + t_r, mask=m_r, other=0.0)
    z_r = gl.load(p_rz + t_r, mask=m_r, other=0)
    return s_c, z_c, s_r, z_r


@_jit
def _stage_queries(qbuf, qlo, p_q, p_qr, row0, M, D_C: gl.constexpr, GC: gl.constexpr, BM: gl.constexpr,
                   Q_SPLIT: gl.constexpr, C_BITS: gl.constexpr, R_BITS: gl.constexpr, q_l: gl.constexpr):
    """Rows `row0 + [0, BM)` of `p_q: [M, D_C]` (content, groups 0..GC-1) and `p_qr: [M, 64]` (RoPE, group GC),
    divided by ONE per-row power of two `f` (so `|q| / f < 2**14` over both), as fp16 (high, and low for fp32
    queries) in `qbuf[g]: [BM, 64]`, columns in the tiles' `column_order`. Returns `f: [BM]` (q_l rows)."""
    o_m = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, q_l))
    m_m = (o_m < M)[:, None]
    o_c = gl.arange(0, 64, layout=gl.SliceLayout(0, q_l))
    o_k = _pi(o_c, C_BITS)
    amax = gl.zeros([BM], gl.float32, gl.SliceLayout(1, q_l))
    o_kr = _pi(o_c, R_BITS)
    for g in gl.static_range(GC + 1):
        if g < GC:
            x = gl.load(p_q + o_m[:, None] * D_C + g * 64 + o_k[None, :], mask=m_m, other=0.0).to(gl.float32)
        else:
            x = gl.load(p_qr + o_m[:, None] * 64 + o_kr[None, :], mask=m_m, other=0.0).to(gl.float32)
        amax = gl.maximum(amax, gl.max(gl.abs(x), axis=1))
    e = gl.maximum(gl.ceil(gl.log2(gl.maximum(amax, 1.0) / 16384.0)), 0.0)
    inv_f = gl.exp2(-e)
    for g in gl.static_range(GC + 1):
        if g < GC:
            x = gl.load(p_q + o_m[:, None] * D_C + g * 64 + o_k[None, :], mask=m_m, other=0.0).to(gl.float32)
        else:
            x = gl.load(p_qr + o_m[:, None] * 64 + o_kr[None, :], mask=m_m, other=0.0).to(gl.float32)
        x = x * inv_f[:, None]
        hi = x.to(gl.float16)
        qbuf.index(g).store(hi)
        if Q_SPLIT:
            qlo.index(g).store((x - hi.to(gl.float32)).to(gl.float16))
    return gl.exp2(e)


@_jit
def _dense_tile(kbuf, p_c, p_r, o_t, m_t, s_ct, s_rt, GC: gl.constexpr, C_BITS: gl.constexpr,
                R_BITS: gl.constexpr, d_l: gl.constexpr):
    """Model-dtype copies of tokens `o_t: [BT]` (row slots; `m_t` valid) -> the fp16 tiles `kbuf[g]: [BT, 64]`, in
    the packed tiles' `column_order` (the queries are staged in that order)."""
    o_c = gl.arange(0, 64, layout=gl.SliceLayout(0, d_l))
    o_k = _pi(o_c, C_BITS)
    for g in gl.static_range(GC):
        x = gl.load(p_c + (o_t * s_ct)[:, None] + g * 64 + o_k[None, :], mask=m_t[:, None], other=0.0)
        kbuf.index(g).store(x.to(gl.float16))
    x = gl.load(p_r + (o_t * s_rt)[:, None] + _pi(o_c, R_BITS)[None, :], mask=m_t[:, None], other=0.0)
    kbuf.index(GC).store(x.to(gl.float16))


@_jit
def _store_o(o_ptr, o_row, m_m, o, inv_l, g: gl.constexpr, GC: gl.constexpr, D_C: gl.constexpr,
             C_BITS: gl.constexpr, acc_l: gl.constexpr):
    """`o^T[64, BM]` of group g (rows in `column_order`), normalised, to its channels of the partial output rows
    `o_row: [BM]`."""
    if g < GC:
        o_d = _pi(gl.arange(0, 64, layout=gl.SliceLayout(1, acc_l)), C_BITS)
        gl.store(o_ptr + o_row[None, :] * D_C + g * 64 + o_d[:, None], o * inv_l[None, :], mask=m_m[None, :])


# --------------------------------------------------------------------------------------------- one tile
@_jit
def _pv(kbuf, pbuf, o, alpha, g: gl.constexpr, kz):
    """`o^T[64, BM] * alpha + K_g^T[64, BT] @ P[BT, BM]`, issued without waiting (A: the tile through a transposed
    descriptor). `kz` is a run-time zero added to every buffer index (see `_attend`)."""
    return warpgroup_mma(kbuf.index(g + kz).permute((1, 0)), pbuf.index(kz), o * alpha[None, :], is_async=True)


@_jit
def _attend(kbuf, qbuf, qlo, pbuf, f, m_valid, m_i, l_p, o0, o1, o2, o3, o4, o5, o6, o7, kz,
            GC: gl.constexpr, BT: gl.constexpr, BM: gl.constexpr, Q_SPLIT: gl.constexpr, acc_l: gl.constexpr):
    """Scores of the tile in `kbuf` (dequantized keys: content groups 0..GC-1, RoPE group GC), one online-softmax
    step over its tokens (axis 0), and the values of every content group. Returns `(m_i, l_p, o0..o7)`; `l_p:
    [BT, BM]` holds the row sums per token lane (reduced once, at the end).

    `kz` is zero at run time but unknown to the compiler: added to every shared-memory buffer index, it keeps the
    wgmma descriptors from being hoisted out of the token loop (where they take registers), as in the exact kernel
    (a shift of a loop variable by less than its width)."""
    zero = gl.zeros([BT, BM], gl.float32, acc_l)
    a = warpgroup_mma(kbuf.index(kz), qbuf.index(kz).permute((1, 0)), zero, use_acc=False, is_async=True)
    if Q_SPLIT:
        a = warpgroup_mma(kbuf.index(kz), qlo.index(kz).permute((1, 0)), a, is_async=True)
    for g in gl.static_range(1, GC + 1):
        a = warpgroup_mma(kbuf.index(g + kz), qbuf.index(g + kz).permute((1, 0)), a, is_async=True)
        if Q_SPLIT:
            a = warpgroup_mma(kbuf.index(g + kz), qlo.index(g + kz).permute((1, 0)), a, is_async=True)
    a = warpgroup_mma_wait(0, deps=[a])
    b_s = gl.where(m_valid, a * f[None, :], float("-inf"))
    m_new = gl.maximum(m_i, gl.max(b_s, axis=0))
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_use)
    p = gl.exp2(b_s - m_use[None, :])
    l_p = l_p * alpha[None, :] + p
    pbuf.index(kz).store(p.to(gl.float16))
    fence_async_shared()
    _cta_barrier()
    if GC == 8:
        o0 = _pv(kbuf, pbuf, o0, alpha, 0, kz)
        o1 = _pv(kbuf, pbuf, o1, alpha, 1, kz)
        o2 = _pv(kbuf, pbuf, o2, alpha, 2, kz)
        o3 = _pv(kbuf, pbuf, o3, alpha, 3, kz)
        o4 = _pv(kbuf, pbuf, o4, alpha, 4, kz)
        o5 = _pv(kbuf, pbuf, o5, alpha, 5, kz)
        o6 = _pv(kbuf, pbuf, o6, alpha, 6, kz)
        o7 = _pv(kbuf, pbuf, o7, alpha, 7, kz)
        o0, o1, o2, o3, o4, o5, o6, o7 = warpgroup_mma_wait(0, deps=[o0, o1, o2, o3, o4, o5, o6, o7])
    else:  # 4 content groups (MiniCPM3's d_c = 256); o4..o7 unused
        o0 = _pv(kbuf, pbuf, o0, alpha, 0, kz)
        o1 = _pv(kbuf, pbuf, o1, alpha, 1, kz)
        o2 = _pv(kbuf, pbuf, o2, alpha, 2, kz)
        o3 = _pv(kbuf, pbuf, o3, alpha, 3, kz)
        o0, o1, o2, o3 = warpgroup_mma_wait(0, deps=[o0, o1, o2, o3])
    return m_new, l_p, o0, o1, o2, o3, o4, o5, o6, o7


# --------------------------------------------------------------------------------------------- split arithmetic
@_jit
def _program_coords(num_splits, M, BM: gl.constexpr, ND: gl.constexpr):
    """`(i_s, i_hb, i_b)` of this program in the flat grid of `B * cdiv(M, BM) * (num_splits + ND)` programs: first
    the packed splits of every (batch row, head block) (split fastest, then head block, then row), then the one-tile
    copy programs in the same order (`program_order`). The hardware starts programs in id order, so every packed
    program starts in the first wave and the copies fill the slots left over (interleaved per batch row, the copies of
    the first rows took slots the packed programs of the last rows then waited for)."""
    pid = gl.program_id(0)
    n_hb = (M + BM - 1) // BM
    n_long = gl.num_programs(0) // (num_splits + ND) * num_splits
    is_long = pid < n_long
    pc = pid - n_long
    i_s = gl.where(is_long, pid % num_splits, num_splits + pc % ND)
    r = gl.where(is_long, pid // num_splits, pc // ND)
    return i_s.to(gl.int64), r % n_hb, (r // n_hb).to(gl.int64)


@_jit
def _split_range(i_s, num_splits, length, split_target, lp, S: gl.constexpr, R: gl.constexpr, BT: gl.constexpr):
    """The packed positions of split `i_s` (`mla_decode_fast.split_plan`: sized from the device-side length, not the
    capacity, tile-aligned from 0): `(base, lo_valid, hi, n_tiles)`: tiles start at `base`, positions `[lo_valid,
    hi)` are valid (after the sink and the row's left padding `lp`, before the recent ring); the copy programs
    (`i_s >= num_splits`) get no packed tiles."""
    covered = gl.maximum(length - R, 0)
    tokens_per_split = (covered + split_target - 1) // split_target
    tokens_per_split = gl.maximum((tokens_per_split + BT - 1) // BT * BT, 2 * BT)
    base = i_s * tokens_per_split
    lo = gl.maximum(base, S)
    hi = gl.where(i_s >= num_splits, lo, gl.minimum(base + tokens_per_split, length - R))
    n_tiles = gl.where(hi > lo, (hi - base + BT - 1) // BT, 0).to(gl.int32)
    return base, gl.maximum(lo, lp + S), hi, n_tiles


@_jit
def _copy_ranges(i_s, num_splits, length, S: gl.constexpr, R: gl.constexpr, BT: gl.constexpr):
    """Copy program `d = i_s - num_splits` attends one 64-token tile: sink slots `[s_lo, s_hi)` for the first
    `cdiv(S, 64)` programs, then recent positions `[r_lo, r_hi)` from `length - R`; empty ranges elsewhere. Returns
    `(s_lo, s_hi, r_lo, r_hi)`."""
    SINK_TILES: gl.constexpr = (S + BT - 1) // BT
    d = i_s - num_splits
    is_dense = i_s >= num_splits
    s_lo = d * BT
    s_hi = gl.where(is_dense & (d < SINK_TILES), gl.minimum(s_lo + BT, S), s_lo)
    r_lo = gl.maximum(length - R, 0) + (d - SINK_TILES) * BT
    r_hi = gl.where(is_dense & (d >= SINK_TILES), gl.minimum(r_lo + BT, length), r_lo)
    return s_lo, s_hi, r_lo, r_hi


@_jit
def _finish(l_p, m_i):
    """Row sums per token lane `l_p: [BT, BM]` and reference maxima `m_i: [BM]` (base 2) -> `(1 / l, natural-log
    LSE)`, `(0, -inf)` for a row with no visible position."""
    l_i = gl.sum(l_p, axis=0)
    has = l_i > 0
    inv_l = gl.where(has, 1.0 / gl.where(has, l_i, 1.0), 0.0)
    return inv_l, gl.where(has, (m_i + gl.log2(gl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))


# --------------------------------------------------------------------------------------------- the kernel
def _jit_dynamic(fn):
    """`gluon.jit` without specialisation on the per-step counts (each new value would compile a new kernel)."""
    if not HAVE_GLUON:
        return fn
    return gluon.jit(fn, do_not_specialize=["M", "Tq", "split_target", "num_splits"])


@_jit_dynamic
def mla_decode_gluon_scaled_kernel(
    q_ptr, qr_ptr,
    cc_ptr, cs_ptr, cz_ptr, rc_ptr, rs_ptr, rz_ptr,
    snc_ptr, snr_ptr, rcc_ptr, rcr_ptr, lp_ptr, len_ptr,
    o_ptr, lse_ptr,
    M, Tq, split_target, num_splits, qk_scale,
    s_qb, s_qrb, s_ccb, s_csb, s_rcb, s_rsb,
    s_sncb, s_snct, s_snrb, s_snrt, s_rccb, s_rcct, s_rcrb, s_rcrt,
    GC: gl.constexpr, C_BITS: gl.constexpr, R_BITS: gl.constexpr, S: gl.constexpr, R: gl.constexpr,
    BM: gl.constexpr, Q_SPLIT: gl.constexpr, STAGES: gl.constexpr, CPV_C: gl.constexpr, CPV_R: gl.constexpr,
    NW: gl.constexpr,
):
    """One program per (split, block of BM rows, batch row): the splits of `mla_decode_gluon_kernel` (tile-aligned,
    sized from the device-side length, split `num_splits` takes the sink and recent copies), the same inputs
    (codes as 32-bit words, rows contiguous), except that the sink and recent copies are spread over `ND =
    cdiv(S, 64) + cdiv(R, 64)` programs of one tile each (splits `num_splits .. num_splits + ND - 1`: sink tiles,
    then recent tiles from `length - R`), so no program attends more than one copied tile after the packed ones
    (at batch 1 the copied tiles were the longest program). Outputs `o: [B, M, num_splits + ND, D_C]`, `lse: [B, M,
    num_splits + ND]` (normalised partials, natural-log LSE, -inf when empty)."""
    BT: gl.constexpr = 64
    D_C: gl.constexpr = GC * 64
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
    tc_l: gl.constexpr = gl.SliceLayout(1, wc_l)  # per token, content unpacking
    tr_l: gl.constexpr = gl.SliceLayout(1, wr_l)  # per token, RoPE unpacking
    HALF_C: gl.constexpr = 1 << (C_BITS - 1)
    HALF_R: gl.constexpr = 1 << (R_BITS - 1)

    ND: gl.constexpr = (S + BT - 1) // BT + (R + BT - 1) // BT  # programs for the copied tokens
    i_s, i_hb, i_b = _program_coords(num_splits, M, BM, ND)
    length = gl.load(len_ptr).to(gl.int64)
    lp = gl.load(lp_ptr + i_b).to(gl.int64)
    o_m = i_hb * BM + gl.arange(0, BM, layout=col_l)
    m_m = o_m < M
    lim_m = length - Tq + (o_m % Tq) + 1  # query t of Tq sees positions < length - Tq + t + 1

    kbuf = gl.allocate_shared_memory(gl.float16, [GC + 1, BT, 64], k_sl)
    kpairs = _as_pairs(kbuf)  # the same bytes as int32 fp16 pairs: what the unpacking stores
    qbuf = gl.allocate_shared_memory(gl.float16, [GC + 1, BM, 64], k_sl)
    if Q_SPLIT:
        qlo = gl.allocate_shared_memory(gl.float16, [GC + 1, BM, 64], k_sl)
    else:
        qlo = qbuf
    pbuf = gl.allocate_shared_memory(gl.float16, [1, BT, BM], p_sl)
    msc = gl.allocate_shared_memory(gl.float16, [GC * BT], plain1)
    mzc = gl.allocate_shared_memory(gl.int8, [GC * BT], plain1)
    stage_c = gl.allocate_shared_memory(gl.int32, [STAGES, GC * BT, WPG_C], plain)
    stage_r = gl.allocate_shared_memory(gl.int32, [STAGES, BT, WPG_R], plain)

    f = _stage_queries(qbuf, qlo, q_ptr + i_b * s_qb, qr_ptr + i_b * s_qrb, i_hb * BM, M, D_C, GC, BM, Q_SPLIT,
                       C_BITS, R_BITS, q_l)
    f = gl.convert_layout(f, col_l) * qk_scale  # scores in base 2, pre-multiplied by scaling * log2(e)

    m_i = gl.full([BM], float("-inf"), gl.float32, col_l)
    l_p = gl.zeros([BT, BM], gl.float32, acc_l)
    o0 = gl.zeros([64, BM], gl.float32, acc_l)
    o1 = gl.zeros([64, BM], gl.float32, acc_l)
    o2 = gl.zeros([64, BM], gl.float32, acc_l)
    o3 = gl.zeros([64, BM], gl.float32, acc_l)
    o4 = gl.zeros([64, BM], gl.float32, acc_l)
    o5 = gl.zeros([64, BM], gl.float32, acc_l)
    o6 = gl.zeros([64, BM], gl.float32, acc_l)
    o7 = gl.zeros([64, BM], gl.float32, acc_l)
    base, lo_valid, hi, n_tiles = _split_range(i_s, num_splits, length, split_target, lp, S, R, BT)
    p_cc = cc_ptr + i_b * s_ccb
    p_rc = rc_ptr + i_b * s_rcb
    p_cs = cs_ptr + i_b * s_csb
    p_cz = cz_ptr + i_b * s_csb
    p_rs = rs_ptr + i_b * s_rsb
    p_rz = rz_ptr + i_b * s_rsb
    for st in gl.static_range(STAGES):
        _issue_tile(stage_c, stage_r, st, p_cc, p_rc, base + st * BT, lo_valid, hi, GC, WPG_C, WPG_R, BT, CPV_C,
                    CPV_R, NW)
        async_copy.commit_group()
    s_c, z_c, s_r, z_r = _load_meta(p_cs, p_cz, p_rs, p_rz, base, lo_valid, hi, GC, BT, meta_l, tr_l)
    o_bt = gl.arange(0, BT, layout=row_l).to(gl.int64)
    for it in range(n_tiles):
        t0 = base + it * BT
        slot = it % STAGES
        # metadata of tile `it` to shared memory (read back per group in the unpacking layout); the next tile's
        # is prefetched into registers
        msc.store(gl.reshape(s_c, [GC * BT]))
        mzc.store(gl.reshape(z_c, [GC * BT]))
        s_rt = s_r
        z_rt = z_r
        s_c, z_c, s_r, z_r = _load_meta(p_cs, p_cz, p_rs, p_rz, t0 + BT, lo_valid, hi, GC, BT, meta_l, tr_l)
        async_copy.wait_group(STAGES - 1)
        _cta_barrier()  # tile `it` and its metadata visible to every thread; the last tile's MMAs all waited
        for g in gl.static_range(GC):
            w = stage_c.index(slot).slice(g * BT, BT).load(wc_l)
            kpairs.index(g).store(_unpack_pairs(w, mzc.slice(g * BT, BT).load(tc_l),
                                                msc.slice(g * BT, BT).load(tc_l), C_BITS, HALF_C))
        w = stage_r.index(slot).load(wr_l)
        kpairs.index(GC).store(_unpack_pairs(w, z_rt, s_rt, R_BITS, HALF_R))
        fence_async_shared()
        _cta_barrier()  # the tiles are written and the slot is no longer read: refill it
        _issue_tile(stage_c, stage_r, slot, p_cc, p_rc, t0 + STAGES * BT, lo_valid, hi, GC, WPG_C, WPG_R, BT, CPV_C,
                    CPV_R, NW)
        async_copy.commit_group()
        o_t = t0 + o_bt
        m_valid = ((o_t >= lo_valid) & (o_t < hi))[:, None] & m_m[None, :]
        m_i, l_p, o0, o1, o2, o3, o4, o5, o6, o7 = _attend(
            kbuf, qbuf, qlo, pbuf, f, m_valid, m_i, l_p, o0, o1, o2, o3, o4, o5, o6, o7, (it >> 30), GC, BT, BM,
            Q_SPLIT, acc_l)
    async_copy.wait_group(0)

    # The last split: model-dtype sink copies (slot j = position lp + j) and the recent ring (slot p % R).
    o_dt = gl.arange(0, BT, layout=gl.SliceLayout(1, d_l)).to(gl.int64)
    s_lo, s_hi, r_lo, r_hi = _copy_ranges(i_s, num_splits, length, S, R, BT)
    p_snc = snc_ptr + i_b * s_sncb
    p_snr = snr_ptr + i_b * s_snrb
    for start in range(s_lo, s_hi, BT):
        _cta_barrier()
        o_j = start + o_dt
        _dense_tile(kbuf, p_snc, p_snr, o_j, (o_j < S) & (lp + o_j < length), s_snct, s_snrt, GC, C_BITS, R_BITS, d_l)
        fence_async_shared()
        _cta_barrier()
        o_jr = start + o_bt
        o_t = lp + o_jr
        m_valid = ((o_jr < S) & (o_t < length))[:, None] & m_m[None, :] & (o_t[:, None] < lim_m[None, :])
        m_i, l_p, o0, o1, o2, o3, o4, o5, o6, o7 = _attend(
            kbuf, qbuf, qlo, pbuf, f, m_valid, m_i, l_p, o0, o1, o2, o3, o4, o5, o6, o7,
            (start.to(gl.int64) >> 40).to(gl.int32), GC, BT, BM, Q_SPLIT, acc_l)
    lo_dense = lp + S
    p_rcc = rcc_ptr + i_b * s_rccb
    p_rcr = rcr_ptr + i_b * s_rcrb
    for start in range(r_lo, r_hi, BT):
        _cta_barrier()
        o_p = start + o_dt
        _dense_tile(kbuf, p_rcc, p_rcr, o_p % R, (o_p < r_hi) & (o_p >= lo_dense), s_rcct, s_rcrt, GC, C_BITS, R_BITS, d_l)
        fence_async_shared()
        _cta_barrier()
        o_t = start + o_bt
        m_valid = ((o_t < r_hi) & (o_t >= lo_dense))[:, None] & m_m[None, :] & (o_t[:, None] < lim_m[None, :])
        m_i, l_p, o0, o1, o2, o3, o4, o5, o6, o7 = _attend(
            kbuf, qbuf, qlo, pbuf, f, m_valid, m_i, l_p, o0, o1, o2, o3, o4, o5, o6, o7,
            (start.to(gl.int64) >> 40).to(gl.int32), GC, BT, BM, Q_SPLIT, acc_l)

    inv_l, b_lse = _finish(l_p, m_i)
    o_row = (i_b * M + o_m) * (num_splits + ND) + i_s
    _store_o(o_ptr, o_row, m_m, o0, inv_l, 0, GC, D_C, C_BITS, acc_l)
    _store_o(o_ptr, o_row, m_m, o1, inv_l, 1, GC, D_C, C_BITS, acc_l)
    _store_o(o_ptr, o_row, m_m, o2, inv_l, 2, GC, D_C, C_BITS, acc_l)
    _store_o(o_ptr, o_row, m_m, o3, inv_l, 3, GC, D_C, C_BITS, acc_l)
    _store_o(o_ptr, o_row, m_m, o4, inv_l, 4, GC, D_C, C_BITS, acc_l)
    _store_o(o_ptr, o_row, m_m, o5, inv_l, 5, GC, D_C, C_BITS, acc_l)
    _store_o(o_ptr, o_row, m_m, o6, inv_l, 6, GC, D_C, C_BITS, acc_l)
    _store_o(o_ptr, o_row, m_m, o7, inv_l, 7, GC, D_C, C_BITS, acc_l)
    gl.store(lse_ptr + o_row, b_lse, mask=m_m)


# --------------------------------------------------------------------------------------------- host side
def smem_bytes(fmt: CacheFormat, block_m: int, stages: int, q_split: bool) -> int:
    """Shared memory of one program: dequantized tiles, queries (twice for fp32), one P tile, metadata and the
    cp.async ring, plus 1 KB for the compiler's scratch (the tests compare it with what the compiler allocates)."""
    gc = fmt.content.n_groups
    tiles = (gc + 1) * BLOCK_T * GROUP * 2
    queries = (gc + 1) * block_m * GROUP * 2 * (2 if q_split else 1)
    probs = BLOCK_T * block_m * 2
    meta = gc * BLOCK_T * 3
    ring = stages * BLOCK_T * (fmt.content.code_bytes + fmt.rope.code_bytes)
    return tiles + queries + probs + meta + ring + 1024


def programs_per_sm(fmt: CacheFormat, block_m: int, stages: int, q_split: bool) -> int:
    """How many programs of this launch fit one multiprocessor's shared memory (each block reserves 1 KB)."""
    return SMEM_PER_SM // (smem_bytes(fmt, block_m, stages, q_split) + 1024)


def copy_programs(fmt: CacheFormat) -> int:
    """Programs (partial-output slots) per row and head block for the sink and recent copies: one per 64-token tile
    of each, `cdiv(S, 64) + cdiv(R, 64)` (3 for 4 sink and 128 recent tokens)."""
    return -(-fmt.sink_tokens // BLOCK_T) + -(-fmt.recent_tokens // BLOCK_T)


def flat_grid(NS: int, fmt: CacheFormat, M: int, block_m: int, B: int) -> tuple[int]:
    """The one-dimensional grid of the Gluon kernels: `B * cdiv(M, block_m) * (NS + copy_programs(fmt))` programs,
    numbered as `program_coords` (and the kernels' `_program_coords`) says."""
    return (B * -(-M // block_m) * (NS + copy_programs(fmt)),)


def program_coords(pid: int, NS: int, nd: int, n_hb: int, n_programs: int) -> tuple[int, int, int]:
    """`(split, head block, batch row)` of program `pid` of a flat grid of `n_programs` (`flat_grid`): the packed
    splits `0 .. NS - 1` of every (row, head block) first, split fastest, then the `nd` copy programs (splits `NS ..
    NS + nd - 1`) in the same order. The host's statement of the kernels' `_program_coords` (tested on the CPU)."""
    n_long = n_programs // (NS + nd) * NS
    if pid < n_long:
        s, r = pid % NS, pid // NS
    else:
        s, r = NS + (pid - n_long) % nd, (pid - n_long) // nd
    return s, r % n_hb, r // n_hb


def scaled_handles(fmt: CacheFormat, q_dtype: torch.dtype, device, copy_dtype: torch.dtype | None = None) -> bool:
    """Whether this kernel computes the case: what the exact Gluon kernel handles (`gluon_handles`), with 2- or
    4-bit content and RoPE (at 8 bits the fp16 rounding of the scaled keys would move the LSE past 1e-4) and 4 or 8
    content groups."""
    if not exact.gluon_handles(fmt, q_dtype, device, copy_dtype):
        return False
    return fmt.content.bits in (2, 4) and fmt.rope.bits in (2, 4) and fmt.content.n_groups in (4, 8)


def launch_scaled(q, qr, cp, rp, fmt, sink_c, sink_r, recent_c, recent_r, lp, length, o_part, lse_part, M, Tq,
                  split_target, NS, qk_scale, block_m, num_warps, stages, maxnreg=None):
    """Launch `mla_decode_gluon_scaled_kernel` on `flat_grid` (`B * cdiv(M, block_m) * (NS + copy_programs(fmt))`; the
    kernel sizes the splits from the device-side length; `NS` must cover them, `mla_decode_fast.split_plan`; the
    partials `o_part`, `lse_part` hold `NS + copy_programs(fmt)` slots). `maxnreg` caps the registers per thread
    (two 8-warp programs per SM need at most 128)."""
    B = q.shape[0]
    q_split = q.dtype == torch.float32 or qr.dtype == torch.float32
    need = smem_bytes(fmt, block_m, stages, q_split)
    if need > SMEM_LIMIT:
        raise ValueError(f"the scaled Gluon decode kernel with {block_m}-row blocks and {stages} stages needs {need} "
                         f"bytes of shared memory for {fmt.name}, more than {SMEM_LIMIT}: use fewer stages or a "
                         f"smaller block_m")
    cw, rw = cp["codes"].view(torch.int32), rp["codes"].view(torch.int32)
    wpg_c, wpg_r = 2 * fmt.content.bits, 2 * fmt.rope.bits
    grid = flat_grid(NS, fmt, M, block_m, B)
    mla_decode_gluon_scaled_kernel[grid](
        q, qr, cw, cp["scale"], cp["zero"], rw, rp["scale"], rp["zero"],
        sink_c, sink_r, recent_c, recent_r, lp, length, o_part, lse_part,
        M, Tq, split_target, NS, qk_scale,
        q.stride(0), qr.stride(0), cw.stride(0), cp["scale"].stride(0), rw.stride(0), rp["scale"].stride(0),
        sink_c.stride(0), sink_c.stride(1), sink_r.stride(0), sink_r.stride(1),
        recent_c.stride(0), recent_c.stride(1), recent_r.stride(0), recent_r.stride(1),
        GC=fmt.content.n_groups, C_BITS=fmt.content.bits, R_BITS=fmt.rope.bits, S=fmt.sink_tokens,
        R=fmt.recent_tokens, BM=block_m, Q_SPLIT=q_split, STAGES=stages, CPV_C=exact.cp_vec(wpg_c, num_warps),
        CPV_R=exact.cp_vec(wpg_r, num_warps), NW=num_warps,
        num_warps=num_warps, **({"maxnreg": int(maxnreg)} if maxnreg else {}),
    )
