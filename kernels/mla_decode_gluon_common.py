"""What the two programs of the Hopper (sm_90) Gluon decode kernel share (the kernel and its one-warpgroup program:
`mla_decode_gluon_regs.py`; its two-warpgroup program: `mla_decode_gluon_wide.py`; design: docs/KERNELS.md).

Grid: one-dimensional, `B * cdiv(M, BM) * (NS + ND)` programs (`flat_grid`): the `NS` packed splits of every
(batch row, head block) first, split fastest, then `ND = copy_programs(fmt)` copy programs that attend one 64-token
tile of the sink or recent copies each (`_program_coords`).

Unit layout (one of `GC` content units, then the RoPE unit, per 64-token tile): in unit u, thread `q = lane % 4`
of each quad owns the 16 contiguous channels `[_unit_base(u, q), + 16)` of two tokens (rows `lane / 4` and `+ 8`
of its warp's 16), i.e. 1 (2-bit), 2 (4-bit) or 4 (8-bit) code words per token. The asm (`half_asm`) turns a word
into its fp16 elements in word order; the same registers are then *viewed* two ways, both free relabellings
checked at compile time (`convert_layout(..., assert_trivial=True)`):
  - the A fragment of `m64n16k16` (row = token, column `16 kc + 8 h + 2 q + e`, holding the element `E w + k +
    (E / 2) e` of the thread's words with `(E / 2) w + k = 2 kc + h`, `E = 32 / bits`): the queries are staged in
    that order (`_score_channel`);
  - the tile row of `kbuf[u]`, column `16 q + 8 (k % 2) + (E / 2) w + 2 (k // 2) + e` (`_v_view`): the value
    rows of `O^T` come out in it, a thread's two rows adjacent channels, stored back as pairs (`_store_o`).
"""

from __future__ import annotations

import torch

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

    HAVE_GLUON = True
    _cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier  # Triton 3.9 / 3.6
except ImportError:  # a Triton without Gluon (< 3.5): the portable Triton kernel serves every case
    HAVE_GLUON = False

from quantmla_hf.format import CacheFormat

from .mla_decode_ref import FP16_PARTIAL_SCALE

GROUP = 64  # elements per quantization group the kernels take (content and RoPE)
BLOCK_T = 64  # tokens per tile: the M of one warpgroup's wgmma
MIN_SPLIT_TILES = 4  # fewest tiles in a split of 2/4-bit content (`_split_range`)
MIN_SPLIT_TILES_8BIT = 2  # and of 8-bit content, whose tiles cost twice
SMEM_LIMIT = 232448  # bytes of shared memory one sm_90 block may use (227 KB)
SMEM_PER_SM = 233472  # bytes of shared memory of one sm_90 multiprocessor (228 KB); each block also reserves 1 KB


_jit = gluon.jit if HAVE_GLUON else (lambda fn: fn)
_constexpr_fn = gluon.constexpr_function if HAVE_GLUON else (lambda fn: fn)  # called in a kernel at compile time
# the split minimums as the kernels read them: a constexpr global enters the kernels' cache key, a plain int does not
_MIN_TILES, _MIN_TILES_8BIT = ((gl.constexpr(MIN_SPLIT_TILES), gl.constexpr(MIN_SPLIT_TILES_8BIT)) if HAVE_GLUON
                               else (MIN_SPLIT_TILES, MIN_SPLIT_TILES_8BIT))
_FP16_PARTIAL_SCALE = gl.constexpr(FP16_PARTIAL_SCALE) if HAVE_GLUON else FP16_PARTIAL_SCALE


def _jit_dynamic(fn):
    """`gluon.jit` without specialisation on the per-step counts and the page-table width (each new value would
    compile a new kernel: a serving step's table is as wide as its longest request)."""
    if not HAVE_GLUON:
        return fn
    params = fn.__code__.co_varnames[:fn.__code__.co_argcount]
    dynamic = [n for n in ("M", "Tq", "split_target", "num_splits", "s_pt") if n in params]
    return gluon.jit(fn, do_not_specialize=dynamic)


@_jit
def _order4(y0, y1, y2, y3):
    """`[..., 2, 2]` whose flattening is y0, y1, y2, y3 (join stacks on a new last axis)."""
    return gl.join(gl.join(y0, y2), gl.join(y1, y3))


@_jit
def _order8(x0, x1, x2, x3, x4, x5, x6, x7):
    return gl.join(_order4(x0, x2, x4, x6), _order4(x1, x3, x5, x7))


@_jit
def _program_coords(num_splits, M, BM: gl.constexpr, ND: gl.constexpr):
    """`(i_s, i_hb, i_b)` of this program in the flat grid of `B * cdiv(M, BM) * (num_splits + ND)` programs: first
    the packed splits of every (batch row, head block) (split fastest, then head block, then row), then the one-tile
    copy programs in the same order (programs start in id order: the packed ones in the first wave)."""
    pid = gl.program_id(0)
    n_hb = (M + BM - 1) // BM
    if ND == 0:  # no copy programs (a 16-bit cache in pages keeps no copies)
        return (pid % num_splits).to(gl.int64), (pid // num_splits) % n_hb, (pid // num_splits // n_hb).to(gl.int64)
    n_long = gl.num_programs(0) // (num_splits + ND) * num_splits
    is_long = pid < n_long
    pc = pid - n_long
    i_s = gl.where(is_long, pid % num_splits, num_splits + pc % ND)
    r = gl.where(is_long, pid // num_splits, pc // ND)
    return i_s.to(gl.int64), r % n_hb, (r // n_hb).to(gl.int64)


@_jit
def _program_rows(num_splits, M, len_ptr, lp_ptr, BM: gl.constexpr, ND: gl.constexpr, PAGED: gl.constexpr):
    """`(i_s, i_hb, i_b, length, lp, i_c)` of this program (`_program_coords`): its length and left padding (int64)
    and its row of the copies. `PAGED`: batch row b is request b, of length `len_ptr[b]`, its copies in row
    `lp_ptr[b]`, no left padding; else `len_ptr[0]` is every row's length and `lp_ptr[b]` its left padding."""
    i_s, i_hb, i_b = _program_coords(num_splits, M, BM, ND)
    if PAGED:
        length = gl.load(len_ptr + i_b).to(gl.int64)
        lp = length * 0
        i_c = gl.load(lp_ptr + i_b).to(gl.int64)  # the request's row of the copies
    else:
        length = gl.load(len_ptr).to(gl.int64)
        lp = gl.load(lp_ptr + i_b).to(gl.int64)
        i_c = i_b
    return i_s, i_hb, i_b, length, lp, i_c


@_jit
def _split_range(i_s, num_splits, length, split_target, lp, S: gl.constexpr, R: gl.constexpr, BT: gl.constexpr,
                 C_BITS: gl.constexpr):
    """The packed positions of split `i_s` (`ops.backends.split_plan`: sized from the device-side length, tile-aligned
    from 0, at least `min_split_tiles` tiles): `(base, lo_valid, hi, n_tiles)`: tiles start at `base`, positions
    `[lo_valid, hi)` are valid; the copy programs (`i_s >= num_splits`) get no packed tiles."""
    covered = gl.maximum(length - R, 0)
    tokens_per_split = (covered + split_target - 1) // split_target
    MIN_TILES: gl.constexpr = _MIN_TILES_8BIT if C_BITS == 8 else _MIN_TILES  # min_split_tiles
    tokens_per_split = gl.maximum((tokens_per_split + BT - 1) // BT * BT, MIN_TILES * BT)
    base = i_s * tokens_per_split
    lo = gl.maximum(base, S)
    hi = gl.where(i_s >= num_splits, lo, gl.minimum(base + tokens_per_split, length - R))
    n_tiles = gl.where(hi > lo, (hi - base + BT - 1) // BT, 0).to(gl.int32)
    return base, gl.maximum(lo, lp + S), hi, n_tiles


@_jit
def _copy_tile(i_s, num_splits, length, i_c, snc_ptr, snr_ptr, rcc_ptr, rcr_ptr, s_sncb, s_snct, s_snrb, s_snrt,
               s_rccb, s_rcct, s_rcrb, s_rcrt, S: gl.constexpr, R: gl.constexpr, BT: gl.constexpr):
    """The one 64-token tile of model-dtype copies that copy program `d = i_s - num_splits` attends: sink slots
    `[lo, hi)` (slot j holds position `lp + j`) for the first `cdiv(S, 64)` programs, then recent positions `[lo,
    hi)` from `length - R` (slot `p % R` of the ring); an empty range for the packed programs. Returns `(lo, hi,
    sink, p_c, p_r, s_ct, s_rt)`: the range, whether it is the sink's, and the content and RoPE copies of copy row
    `i_c` with their token strides."""
    SINK_TILES: gl.constexpr = (S + BT - 1) // BT
    d = i_s - num_splits
    sink = d < SINK_TILES
    s_lo = d * BT
    r_lo = gl.maximum(length - R, 0) + (d - SINK_TILES) * BT
    lo = gl.where(sink, s_lo, r_lo)
    hi = gl.where(i_s >= num_splits, gl.where(sink, gl.minimum(s_lo + BT, S), gl.minimum(r_lo + BT, length)), lo)
    p_c = gl.where(sink, snc_ptr + i_c * s_sncb, rcc_ptr + i_c * s_rccb)
    p_r = gl.where(sink, snr_ptr + i_c * s_snrb, rcr_ptr + i_c * s_rcrb)
    return lo, hi, sink, p_c, p_r, gl.where(sink, s_snct, s_rcct), gl.where(sink, s_snrt, s_rcrt)


@_jit
def _copy_rows(start, hi, sink, lp, length, o_dt, o_bt, lim_m, m_m, S: gl.constexpr, R: gl.constexpr):
    """The 64 copied tokens from `start` of a copy tile `[start, hi)` (`_copy_tile`), valid from position `lp + S`
    (recent) or `lp` (sink) up to `length`: `(kz, slot, m_t, m_valid)`: a run-time zero for the shared-memory
    indices, their slots and valid keys in the layout of `o_dt: [64]` (the dense loads), and the score mask `[64,
    BM]` in the layout of `o_bt: [64]` (rows `m_m`, query rows seeing positions below `lim_m`)."""
    kz = (start.to(gl.int64) >> 40).to(gl.int32)
    shift = gl.where(sink, lp, 0)
    p_min = gl.where(sink, 0, lp + S)
    j = start + o_dt
    m_t = (j < hi) & (j + shift >= p_min) & (j + shift < length)
    p = start + o_bt + shift
    m_valid = ((p < hi + shift) & (p >= p_min) & (p < length))[:, None] & m_m[None, :] & (p[:, None] < lim_m[None, :])
    return kz, gl.where(sink, j, j % R), m_t, m_valid


@_jit
def _copy_slots(start, hi, sink, lp, length, o_dt, S: gl.constexpr, R: gl.constexpr):
    """The slots and valid keys `(slot, m_t)` of the 64 copied tokens from `start` of a copy tile, in the layout of
    `o_dt: [64]`: what `_copy_rows` computes first (the split kernel's scorer needs no score mask). `_copy_rows`
    keeps its own copy of these lines: calling this from it reorders the register programs' SASS."""
    shift = gl.where(sink, lp, 0)
    p_min = gl.where(sink, 0, lp + S)
    j = start + o_dt
    m_t = (j < hi) & (j + shift >= p_min) & (j + shift < length)
    return gl.where(sink, j, j % R), m_t


@_jit
def _batch_planes(cc_ptr, cs_ptr, cz_ptr, rc_ptr, rs_ptr, rz_ptr, i_b, s_ccb, s_csb, s_rcb, s_rsb):
    """The plane pointers of batch row `i_b`: `(p_cc, p_rc, p_cs, p_cz, p_rs, p_rz)`, content and RoPE code words,
    steps and zero points (the zero points share their steps' strides)."""
    return (cc_ptr + i_b * s_ccb, rc_ptr + i_b * s_rcb, cs_ptr + i_b * s_csb, cz_ptr + i_b * s_csb,
            rs_ptr + i_b * s_rsb, rz_ptr + i_b * s_rsb)


@_jit
def _planes_from(p_cc, p_rc, p_cs, p_cz, p_rs, p_rz, t, GC: gl.constexpr, C_BITS: gl.constexpr,
                 R_BITS: gl.constexpr):
    """The plane pointers of `_batch_planes` advanced to position `t` (rows of `GC * 2 * C_BITS` and `2 * R_BITS`
    code words, `GC` and one steps and zero points)."""
    RWC: gl.constexpr = GC * 2 * C_BITS
    RWR: gl.constexpr = 2 * R_BITS
    return p_cc + t * RWC, p_rc + t * RWR, p_cs + t * GC, p_cz + t * GC, p_rs + t, p_rz + t


@_jit
def _split_rows(p_cc, p_rc, p_cs, p_cz, p_rs, p_rz, pt_ptr, s_pt, i_b, base, lo_valid, hi, n_tiles, GC: gl.constexpr,
                C_BITS: gl.constexpr, R_BITS: gl.constexpr, BT: gl.constexpr, PAGED: gl.constexpr):
    """A split as the row-pointer loads see it (int32 positions relative to its first tile, `_row_ptrs`,
    `_load_meta_rows`): `(lo, hi, last, p_pt, p_cc, p_rc, p_cs, p_cz, p_rs, p_rz, row, shift)`, the valid positions
    `[lo, hi)`, the last row word loads read, the page numbers from the split's first tile (`PAGED`) or the planes
    advanced to it (`_planes_from`), and tile 0's `_tile_rows`."""
    lo = (lo_valid - base).to(gl.int32)
    hi = (hi - base).to(gl.int32)
    last = gl.maximum(hi - 1, 0)
    first = gl.where(n_tiles > 0, base, 0)
    if PAGED:
        p_pt = pt_ptr + i_b * s_pt + first // BT
    else:
        p_pt = pt_ptr
        p_cc, p_rc, p_cs, p_cz, p_rs, p_rz = _planes_from(p_cc, p_rc, p_cs, p_cz, p_rs, p_rz, first, GC, C_BITS,
                                                          R_BITS)
    row, shift = _tile_rows(_tile_page(p_pt, 0, last, PAGED), 0, last, PAGED)
    return lo, hi, last, p_pt, p_cc, p_rc, p_cs, p_cz, p_rs, p_rz, row, shift


@_constexpr_fn
def _partial_scale(element_ty):
    """The factor partials of this element type hold `o_s` times (`mla_decode_ref.partial_scale`)."""
    return _FP16_PARTIAL_SCALE if element_ty == gl.float16 else 1.0


@_jit
def _finish(l_i, m_i, o_ptr):
    """Row sums `l_i: [BM]` and reference maxima `m_i: [BM]` (base 2) -> `(scale / l, natural-log LSE)`, `(0,
    -inf)` for a row with no visible position; `scale`: the factor of partials stored through `o_ptr`
    (`_partial_scale`: fp16 partials are scaled, fp32 ones are not)."""
    SCALE: gl.constexpr = _partial_scale(o_ptr.dtype.element_ty)
    has = l_i > 0
    inv_l = gl.where(has, SCALE / gl.where(has, l_i, 1.0), 0.0)
    return inv_l, gl.where(has, (m_i + gl.log2(gl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))


def half_asm(bits: int, codes: bool = False) -> str:
    """PTX that turns one 32-bit code word into its `E = 32 / bits` fp16 elements `(code - z) * s`, in word order.

    Elements k and k + E/2 (bits `[bits*k, bits*(k+1))` and 16 higher) are put under the fp16 magic number `0x6400`
    in the two halves of one register by one `lop3`, made `code - z` exactly, then one `mul.f16x2` by `(s, s)`.

    2 and 4 bits: operands: outputs `$0 .. $(E-1)` (16-bit), then the word, fp16x2 `(1024 + z, 1024 + z)`, fp16x2
    `(s, s)`, fp16x2 `-(1024 / 2**bits + z)` and fp16x2 `(2**-bits, 2**-bits)`. In each shift group of two the even
    element is masked in place (`sub.f16x2` of `1024 + z`), the odd one a field higher (`fma.rn.f16x2` by `2**-bits`
    plus `-(1024 / 2**bits + z)`): half the shifts, both exact.

    8 bits: operands: outputs `$0 .. $(E-1)`, the word, `(1024 + z)` and `(s, s)`; every element shifted to bit 0
    (`code - z` is exact in fp16 up to 255 steps, and one `mul.f16x2` rounds it once, as below 8 bits).

    8 bits (`codes`): operands: outputs `$0 .. $(E-1)`, the word and `(1024 + z)`; the integers `code - z` (exact in
    fp16), the step applied by the caller (`_packed_scores`: the RoPE unit's score times its token's step)."""
    if codes and bits != 8:
        raise ValueError("half_asm(codes=True) is the 8-bit unit without the step: bits=8")
    n = 16 // bits
    e = 2 * n
    o = e  # first input operand
    mask = (1 << bits) - 1
    lines = ["{", ".reg .b32 x, t, h;"]
    for k in range(n):
        if bits == 8:
            src = f"${o}"
            if k:
                lines.append(f"shr.u32 t, ${o}, {bits * k};")
                src = "t"
            lines.append(f"lop3.b32 t, {src}, {mask * 0x10001:#010x}, 0x64006400, 0xEA;")
            lines.append(f"sub.f16x2 t, t, ${o + 1};")
        else:
            grp, odd = divmod(k, 2)
            src = f"${o}"
            if grp:
                if not odd:
                    lines.append(f"shr.u32 x, ${o}, {2 * bits * grp};")
                src = "x"
            lines.append(f"lop3.b32 t, {src}, {(mask << (bits * odd)) * 0x10001:#010x}, 0x64006400, 0xEA;")
            if odd:
                lines.append(f"fma.rn.f16x2 t, t, ${o + 4}, ${o + 3};")
            else:
                lines.append(f"sub.f16x2 t, t, ${o + 1};")
        if codes:
            lines.append(f"mov.b32 {{${k}, ${k + n}}}, t;")
            continue
        lines.append(f"mul.f16x2 h, t, ${o + 2};")
        lines.append(f"mov.b32 {{${k}, ${k + n}}}, h;")
    lines.append("}")
    return "\n".join(lines)


@_jit
def _unit_base(u: gl.constexpr, q, GC: gl.constexpr):
    """First channel of the 16 that thread `q` (of a quad) owns in unit u: content units `0 .. GC - 1` (`64 * (q + 4
    * (u // 4)) + 16 * (u % 4)`, channels of the content latent), RoPE unit `GC` (`16 * q`)."""
    if u == GC:
        return 16 * q
    return 64 * (q + 4 * (u // 4)) + 16 * (u % 4)


@_jit
def _score_channel(u: gl.constexpr, c, BITS: gl.constexpr, GC: gl.constexpr):
    """The channel (of the content latent for u < GC, of the RoPE key for u = GC) held by column `c` of unit u's
    score A operand (the A-fragment order of the module docstring); the queries are staged in it."""
    N: gl.constexpr = 16 // BITS
    p = 2 * (c // 16) + (c // 8) % 2
    return _unit_base(u, (c // 2) % 4, GC) + (p // N) * (2 * N) + p % N + N * (c % 2)


@_jit
def _order16(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15):
    return gl.join(_order8(x0, x2, x4, x6, x8, x10, x12, x14), _order8(x1, x3, x5, x7, x9, x11, x13, x15))


def meta_asm(bits: int) -> str:
    """PTX that turns a token's stored zero point (its byte `b`, zero-extended: `z - HALF` as int8) and fp16 step
    `s` into the fp16x2 pairs `half_asm` takes: outputs `$0` `(1024 + z, 1024 + z)`, `$1` `(s, s)`, `$2` `-(1024 /
    2**bits + z)` (both halves), inputs `$3` = `b`, `$4` = `s` (16-bit). `(b ^ 0x80) | 0x6400` is the fp16 `1024 +
    z - HALF + 128`, then `add.f16x2` of `HALF - 128` and `sub.f16x2` from `1024 - 1024 / 2**bits` (all exact)."""
    half = 1 << (bits - 1)
    c1 = _fp16_bits(half - 128)
    c2 = _fp16_bits(1024 - 1024 / 2**bits)
    return "\n".join([
        "{", ".reg .b32 x, c;",
        "prmt.b32 x, $3, 0, 0x4040;",
        "xor.b32 x, x, 0x64806480;",
        f"mov.b32 c, {c1 * 0x10001:#010x};",
        "add.rn.f16x2 $0, x, c;",
        f"mov.b32 c, {c2 * 0x10001:#010x};",
        "sub.rn.f16x2 $2, c, $0;",
        "mov.b32 $1, {$4, $4};",
        "}"])


def _fp16_bits(x: float) -> int:
    """The 16 bits of `x` as fp16 (x exactly representable)."""
    v = torch.tensor(x, dtype=torch.float16)
    if float(v) != x:
        raise ValueError(f"{x} is not exact in fp16")
    return int(v.view(torch.int16)) & 0xFFFF


if HAVE_GLUON:  # the asm of each width (plain functions cannot be called in a kernel: they read torch)
    _HALF_ASM_2 = gl.constexpr(half_asm(2))
    _HALF_ASM_4 = gl.constexpr(half_asm(4))
    _HALF_ASM_8 = gl.constexpr(half_asm(8))
    _HALF_ASM_8_CODES = gl.constexpr(half_asm(8, codes=True))
    _META_ASM_2 = gl.constexpr(meta_asm(2))
    _META_ASM_4 = gl.constexpr(meta_asm(4))
    _META_ASM_8 = gl.constexpr(meta_asm(8))
    # an L2 prefetch of the line at `$1` where `$2` is non-zero (`_prefetch_rows`); `$0` is a dummy
    _PREFETCH_ASM = gl.constexpr("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }")


@_jit
def _pair_meta(s, z, BITS: gl.constexpr):
    """Steps `s` fp16 and stored zero points `z` int8 (`[64, 4]`) -> the int32 fp16x2 pairs `half_asm` takes: `zz =
    (1024 + z, 1024 + z)`, `ss = (s, s)`, `zh = -(1024 / 2**BITS + z)` (both halves), `z` the stored value plus
    `2**(BITS - 1)` (`meta_asm`)."""
    ASM: gl.constexpr = _META_ASM_2 if BITS == 2 else (_META_ASM_4 if BITS == 4 else _META_ASM_8)
    return gl.inline_asm_elementwise(ASM, "=r,=r,=r,r,h", [z.to(gl.uint8, bitcast=True).to(gl.int32), s],
                                     dtype=[gl.int32] * 3, is_pure=True, pack=1)


@_jit
def _unpack_unit(w, zz, ss, zh, BITS: gl.constexpr, wl: gl.constexpr):
    """Words `w: [64, 4, WU]` int32 (thread q's words of each token), `zz`, `ss`, `zh: [64, 4]` int32 fp16x2 pairs ->
    `[64, 4, WU, 2, E / 2]` fp16 `(code - z) * s` (rounded once), element `(E / 2) * e + k` of word `w` at `[t, q,
    w, e, k]` (`zh` unused at 8 bits)."""
    ml: gl.constexpr = gl.SliceLayout(2, wl)
    zz, w = gl.broadcast(gl.convert_layout(zz, ml, assert_trivial=True)[:, :, None], w)
    ss, w = gl.broadcast(gl.convert_layout(ss, ml, assert_trivial=True)[:, :, None], w)
    if BITS != 8:
        zh, w = gl.broadcast(gl.convert_layout(zh, ml, assert_trivial=True)[:, :, None], w)
        step = gl.full(w.shape, 0x2C002C00 if BITS == 4 else 0x34003400, gl.int32, w.type.layout)  # 2**-BITS x2
    if BITS == 8:
        y0, y1, y2, y3 = gl.inline_asm_elementwise(
            _HALF_ASM_8, "=h,=h,=h,=h,r,r,r", [w, zz, ss], dtype=[gl.float16] * 4, is_pure=True, pack=1)
        return gl.reshape(_order4(y0, y1, y2, y3), [64, 4, w.shape[2], 2, 2])
    elif BITS == 4:
        y0, y1, y2, y3, y4, y5, y6, y7 = gl.inline_asm_elementwise(
            _HALF_ASM_4, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r,r,r", [w, zz, ss, zh, step], dtype=[gl.float16] * 8,
            is_pure=True, pack=1)
        return gl.reshape(_order8(y0, y1, y2, y3, y4, y5, y6, y7), [64, 4, w.shape[2], 2, 4])
    else:
        y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15 = gl.inline_asm_elementwise(
            _HALF_ASM_2, "=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,r,r,r,r,r", [w, zz, ss, zh, step],
            dtype=[gl.float16] * 16, is_pure=True, pack=1)
        x = _order16(y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15)
        return gl.reshape(x, [64, 4, w.shape[2], 2, 8])


@_jit
def _unpack_codes8(w, zz, wl: gl.constexpr):
    """8-bit words `w: [64, 4, WU]` int32 and `zz: [64, 4]` (`(1024 + z)` pairs) -> `[64, 4, WU, 2, 2]` fp16 `code -
    z` (exact), in `_unpack_unit`'s element order."""
    ml: gl.constexpr = gl.SliceLayout(2, wl)
    zz, w = gl.broadcast(gl.convert_layout(zz, ml, assert_trivial=True)[:, :, None], w)
    y0, y1, y2, y3 = gl.inline_asm_elementwise(_HALF_ASM_8_CODES, "=h,=h,=h,=h,r,r", [w, zz], dtype=[gl.float16] * 4,
                                               is_pure=True, pack=1)
    return gl.reshape(_order4(y0, y1, y2, y3), [64, 4, w.shape[2], 2, 2])


@_jit
def _rope_steps(s, acc_l: gl.constexpr):
    """The RoPE group's steps `[64, 4]` fp16 (the same for every q) -> `[64]` fp32 in the rows of a score accumulator
    `[64, BM]` (the factors of the RoPE unit's integer-code scores)."""
    return gl.convert_layout(gl.max(s, axis=1).to(gl.float32), gl.SliceLayout(1, acc_l))


@_jit
def _row_steps(s, acc_l: gl.constexpr, R_BITS: gl.constexpr):
    """`_rope_steps` where `_packed_scores` scores the RoPE unit's integer codes (8-bit RoPE); zeros (unused)
    otherwise."""
    if R_BITS == 8:
        return _rope_steps(s, acc_l)
    return gl.zeros([64], gl.float32, gl.SliceLayout(1, acc_l))


@_jit
def _a_view(x5, dot_a: gl.constexpr):
    """`[64, 4, WU, 2, E / 2]` unit keys -> the `[64, 64]` A operand (a relabelling of the same registers)."""
    x = gl.permute(x5, (0, 1, 2, 4, 3))  # [t, q, w, k, e]: pair p = (E / 2) w + k
    x = gl.reshape(x, [64, 4, 4, 2, 2])  # [t, q, kc, h, e]
    x = gl.permute(x, (0, 2, 3, 1, 4))  # [t, kc, h, q, e]: column 16 kc + 8 h + 2 q + e
    return gl.convert_layout(gl.reshape(x, [64, 64]), dot_a, assert_trivial=True)


@_jit
def _v_view(x5):
    """`[64, 4, WU, 2, K]` unit keys (`K = E / 2`, element `E w + k + K e` at `[t, q, w, e, k]`) -> the `[64, 64]` tile
    stored for the values, in the `kbuf` column order of the module docstring: each 32-bit pair of a store is one
    register of the asm (no byte permutes)."""
    K: gl.constexpr = x5.shape[4]
    x = gl.reshape(x5, [64, 4, x5.shape[2], 2, K // 2, 2])  # [t, q, w, e, k // 2, k % 2]
    return gl.reshape(gl.permute(x, (0, 1, 5, 2, 4, 3)), [64, 64])


@_jit
def _load_unit(p_c, t0, lo, hi, u: gl.constexpr, ROW_WORDS: gl.constexpr, BITS: gl.constexpr, GC: gl.constexpr,
               wl: gl.constexpr, NU: gl.constexpr = 1, ROWS: gl.constexpr = False):
    """Code words `[64, 4, NU * WU]` of units `u .. u + NU - 1` (consecutive in a thread's group) for tokens `[t0, t0
    + 64)` (zeros outside `[lo, hi)`): thread q's words `_unit_base(u, q) * bits / 32 + [0, NU * WU)` of each token
    row of `ROW_WORDS` words.

    `ROWS`: `p_c` is the tile's `[64, 4]` row pointers (`_row_ptrs`; `lo` unused), `t0` and `hi` int32 rows, rows
    past `hi` not read (their steps are zero, `_load_meta_rows`, so their keys are 0 whatever the registers hold)."""
    WU: gl.constexpr = BITS // 2 * NU
    ml: gl.constexpr = gl.SliceLayout(2, wl)
    o_w = gl.arange(0, WU, layout=gl.SliceLayout(0, gl.SliceLayout(1, wl)))
    if ROWS:
        word0: gl.constexpr = _unit_base(u, 0, GC) * BITS // 32
        m = (t0 + gl.arange(0, 64, layout=gl.SliceLayout(1, ml))) <= hi
        w = gl.load(p_c[:, :, None] + (word0 + o_w)[None, None, :], mask=m[:, None, None])
    else:
        o_q = gl.arange(0, 4, layout=gl.SliceLayout(0, ml))
        word = _unit_base(u, o_q, GC) * BITS // 32
        o_t = t0 + gl.arange(0, 64, layout=gl.SliceLayout(1, ml)).to(gl.int64)
        off = (o_t[:, None] * ROW_WORDS + word[None, :])[:, :, None] + o_w[None, None, :]
        m = ((o_t >= lo) & (o_t < hi))[:, None, None]
        w = gl.load(p_c + off, mask=m, other=0)
    return w


@_jit
def _row_ptrs(p, t0, ROW_WORDS: gl.constexpr, Q_WORDS: gl.constexpr, wl: gl.constexpr):
    """`[64, 4]` pointers `p + (t0 + t) * ROW_WORDS + q * Q_WORDS` (int32 rows relative to `p`) in the rows of `wl`:
    the first code word of quad slot q of each of the tile's tokens (`_load_unit` with `ROWS`)."""
    ml: gl.constexpr = gl.SliceLayout(2, wl)
    o_t = t0 + gl.arange(0, 64, layout=gl.SliceLayout(1, ml))
    o_q = gl.arange(0, 4, layout=gl.SliceLayout(0, ml))
    return p + ((o_t * ROW_WORDS)[:, None] + (o_q * Q_WORDS)[None, :])


@_jit
def _load_group(p_s, p_z, t0, lo, hi, G0: gl.constexpr, GC: gl.constexpr, ml: gl.constexpr,
                ROWS: gl.constexpr = False, last=0, shift=0):
    """Steps `[64, 4]` fp16 and stored zero points int8 of content group `q + G0` (for `GC = 0`: the RoPE group, the
    same for every q) of tokens `[t0, t0 + 64)`, zeros outside `[lo, hi)` (int64 positions, masked loads). `ROWS`:
    int32 positions, those past `last` (a stored one) read `last`, position p from row `p + shift` (`_tile_rows`),
    no masks, the steps (not the zero points) zeroed outside `[lo, hi)`: such a token's keys are exactly 0 whatever
    its codes and zero point (`_load_unit` with `ROWS`)."""
    if ROWS:
        o_t = t0 + gl.arange(0, 64, layout=gl.SliceLayout(1, ml))
        o_a = gl.minimum(o_t, last) + shift
    else:
        o_t = t0 + gl.arange(0, 64, layout=gl.SliceLayout(1, ml)).to(gl.int64)
        o_a = o_t
    o_q = gl.arange(0, 4, layout=gl.SliceLayout(0, ml))
    m = ((o_t >= lo) & (o_t < hi))[:, None]
    if GC == 0:
        off = o_a[:, None] + 0 * o_q[None, :]
    else:
        off = o_a[:, None] * GC + (o_q + G0)[None, :]
    if ROWS:
        s = gl.where(m, gl.load(p_s + off), 0.0)
        z = gl.load(p_z + off)
    else:
        s = gl.load(p_s + off, mask=m, other=0.0)
        z = gl.load(p_z + off, mask=m, other=0)
    return s, z


@_jit
def _load_meta_rows(p_cs, p_cz, p_rs, p_rz, t0, lo, hi, last, shift, GC: gl.constexpr, ml: gl.constexpr,
                    ZERO: gl.constexpr = True):
    """The tile's steps and stored zero points `(s0, z0, s1, z1, sr, zr)` (content groups q and q + 4, RoPE) as
    `_load_group` with `ROWS` reads them, the three groups' addresses computed once (as three `_load_group` calls
    the 8-bit launches compile to other SASS). `ZERO` off: the steps not yet zeroed outside `[lo, hi)` (`lo`, `hi`
    unused; `_valid_steps` zeroes them a tile later, when they are used: the tile that issues the loads then does
    not wait for them, nor for the code words loaded on the same scoreboard after them)."""
    o_t = t0 + gl.arange(0, 64, layout=gl.SliceLayout(1, ml))
    o_a = gl.minimum(o_t, last) + shift
    o_q = gl.arange(0, 4, layout=gl.SliceLayout(0, ml))
    off = o_a[:, None] * GC + o_q[None, :]
    s0 = gl.load(p_cs + off)
    z0 = gl.load(p_cz + off)
    if GC == 8:
        s1 = gl.load(p_cs + off + 4)
        z1 = gl.load(p_cz + off + 4)
    else:
        s1 = s0
        z1 = z0
    off_r = o_a[:, None] + 0 * o_q[None, :]
    sr = gl.load(p_rs + off_r)
    if ZERO:
        s0, s1, sr = _valid_steps(s0, s1, sr, t0, lo, hi, ml)
    return s0, z0, s1, z1, sr, gl.load(p_rz + off_r)


@_jit
def _valid_steps(s0, s1, sr, t0, lo, hi, ml: gl.constexpr):
    """The steps of the tile at `t0` zeroed outside the valid positions `[lo, hi)` (a zero step makes a token's keys
    exactly 0 whatever its codes, `_load_group`)."""
    o_t = t0 + gl.arange(0, 64, layout=gl.SliceLayout(1, ml))
    valid = ((o_t >= lo) & (o_t < hi))[:, None]
    return gl.where(valid, s0, 0.0), gl.where(valid, s1, 0.0), gl.where(valid, sr, 0.0)


@_jit
def _prefetch_rows(p_c, tn, last, ROW_WORDS: gl.constexpr, wl: gl.constexpr):
    """Ask L2 for the code words of the tile at int32 position `tn` through its row pointers `p_c: [64, 4]` (layout
    `SliceLayout(2, wl)`; `_row_ptrs`: quad slot q's first word of each token row of `ROW_WORDS` words, a content
    row's quad slots in its first half), rows past the last stored position `last` left out: every 128-byte line of
    the rows, one `prefetch.global.L2` per pointer and line. Nothing waits for a prefetch and it holds no register,
    so the tile's own loads, which the compiler spreads over the tile before (the last pairs' late, to spare
    registers), find the words in L2."""
    ml: gl.constexpr = gl.SliceLayout(2, wl)
    o_t = tn + gl.arange(0, 64, layout=gl.SliceLayout(1, ml))
    o_q = gl.arange(0, 4, layout=gl.SliceLayout(0, ml))
    ok = ((o_t <= last)[:, None] & (o_q >= 0)[None, :]).to(gl.int32)
    for j in gl.static_range(2 if ROW_WORDS >= 64 else 1):
        gl.inline_asm_elementwise(_PREFETCH_ASM, "=r,l,r", [p_c + j * (ROW_WORDS // 2), ok], dtype=gl.int32,
                                  is_pure=False, pack=1)


@_jit
def _tile_page(p_pt, tn, last, PAGED: gl.constexpr):
    """`PAGED` (page pools; `p_pt[0]` the page number of the split's first tile): the page number of the tile at
    int32 position `tn`, loaded a tile before `_tile_rows` needs it; a tile past the last stored position `last`
    (>= 0) takes that position's page, so every read stays inside a page of the request. 0 for contiguous planes."""
    page = 0
    if PAGED:
        page = gl.load(p_pt + gl.maximum(gl.minimum(tn, last // 64 * 64), 0) // 64)
    return page


@_jit
def _tile_rows(page, tn, last, PAGED: gl.constexpr):
    """`(row, shift)` of the tile at int32 position `tn` (`page`: its `_tile_page`): the plane row its first token
    is read from and the offset from positions to rows; `(tn, 0)` for planes offset to the split's first tile.
    `PAGED`: `row = page * 64`, `shift = row - tn` (`tn` clamped as `_tile_page` clamps it)."""
    if PAGED:
        row = page * 64
        shift = row - gl.maximum(gl.minimum(tn, last // 64 * 64), 0)
    else:
        row = tn
        shift = 0
    return row, shift


@_jit
def _load_dense(p, o_slot, m_t, s_t, u: gl.constexpr, GC: gl.constexpr, BITS: gl.constexpr, xl: gl.constexpr,
                KD: gl.constexpr = gl.float16):
    """Model-dtype copies `[64, 4, 16]` of unit u (rows `o_slot: [64]` of stride `s_t`, valid `m_t`; thread q's 16
    channels from `_unit_base(u, q)`) -> `KD` (fp16, or the 16-bit planes' own type) `[64, 4, BITS / 2, 2, E / 2]`,
    the unpacked keys' order (`_unpack_unit`)."""
    sl: gl.constexpr = gl.SliceLayout(2, xl)
    o_q = gl.arange(0, 4, layout=gl.SliceLayout(0, sl))
    o_e = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, xl)))
    off = ((o_slot * s_t)[:, None] + _unit_base(u, o_q, GC)[None, :])[:, :, None] + o_e[None, None, :]
    x = gl.load(p + off, mask=m_t[:, None, None], other=0.0)
    return gl.reshape(x.to(KD), [64, 4, BITS // 2, 2, 16 // BITS])


@_jit
def _query_unit(p_q, p_qr, o_m, m_m, o_c, u: gl.constexpr, D_C: gl.constexpr, GC: gl.constexpr,
                C_BITS: gl.constexpr, R_BITS: gl.constexpr):
    """Unit u's 64 query columns of rows `o_m` (content units 0..GC-1, RoPE unit GC) in `score_channel` order,
    fp32; 16-bit content in channel order (unit u: channels `64 u + [0, 64)`: the split kernel copies those keys as
    they are)."""
    if u < GC and C_BITS == 16:
        x = gl.load(p_q + o_m[:, None] * D_C + (64 * u + o_c)[None, :], mask=m_m, other=0.0)
    elif u < GC:
        x = gl.load(p_q + o_m[:, None] * D_C + _score_channel(u, o_c, C_BITS, GC)[None, :], mask=m_m, other=0.0)
    else:
        x = gl.load(p_qr + o_m[:, None] * 64 + _score_channel(u, o_c, R_BITS, GC)[None, :], mask=m_m, other=0.0)
    return x.to(gl.float32)


@_jit
def _stage_queries(qbuf, qlo, p_q, p_qr, row0, M, D_C: gl.constexpr, GC: gl.constexpr, BM: gl.constexpr,
                   Q_SPLIT: gl.constexpr, C_BITS: gl.constexpr, R_BITS: gl.constexpr, q_l: gl.constexpr):
    """Rows `row0 + [0, BM)` of `p_q: [M, D_C]` and `p_qr: [M, 64]`, divided by one per-row power of two `f` (so
    `|q| / f < 2**14`), in the buffers' 16-bit type (fp16; the planes' for 16-bit keys; high, and low for fp32
    queries) in `qbuf[u]: [1, BM, 64]` in `_query_unit` order (units 0..GC-1 content, GC RoPE). Returns `f: [BM]`
    (q_l rows)."""
    o_m = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, q_l))
    m_m = (o_m < M)[:, None]
    o_c = gl.arange(0, 64, layout=gl.SliceLayout(0, q_l))
    amax = gl.zeros([BM], gl.float32, gl.SliceLayout(1, q_l))
    xs = ()
    for u in gl.static_range(GC + 1):
        x = _query_unit(p_q, p_qr, o_m, m_m, o_c, u, D_C, GC, C_BITS, R_BITS)
        amax = gl.maximum(amax, gl.max(gl.abs(x), axis=1))
        xs = xs + (x,)
    e = gl.maximum(gl.ceil(gl.log2(gl.maximum(amax, 1.0) / 16384.0)), 0.0)
    inv_f = gl.exp2(-e)
    for u in gl.static_range(GC + 1):
        x = xs[u] * inv_f[:, None]
        hi = x.to(qbuf[u].dtype)
        qbuf[u].index(0).store(hi)
        if Q_SPLIT:
            qlo[u].index(0).store((x - hi.to(gl.float32)).to(qlo[u].dtype))
    return gl.exp2(e)


@_jit
def _store_o(o_ptr, o_row, m_m, o, inv_l, u: gl.constexpr, GC: gl.constexpr, D_C: gl.constexpr,
             C_BITS: gl.constexpr):
    """`o^T[64, BM]` of unit u, normalised, to the partial output rows. Row `16 q + 8 h + i` of `o^T` is channel
    `_unit_base(u, q) + E (i // K) + 2 ((i % K) // 2) + K (i % 2) + h` (`_v_view`'s column order, `E = 32 / bits`,
    `K = E / 2`): the thread that holds row i holds row `i + 8`, the next channel, and writes both in one 8-byte
    store; the 8 threads of a column cover 64 contiguous bytes."""
    BM: gl.constexpr = o.shape[1]
    K: gl.constexpr = 16 // C_BITS
    x = o * inv_l[None, :]
    x = gl.reshape(gl.permute(gl.reshape(x, [4, 2, 8, BM]), (0, 2, 3, 1)), [32, BM, 2])  # [8 q + i, row, h]
    st_l: gl.constexpr = _pair_layout(BM)
    x = gl.convert_layout(x, st_l, assert_trivial=True)  # h the first register: one 8-byte store
    c = gl.arange(0, 32, layout=gl.SliceLayout(1, gl.SliceLayout(2, st_l)))
    i = c % 8
    o_d = _unit_base(u, c // 8, GC) + (i // K) * (2 * K) + ((i % K) // 2) * 2 + K * (i % 2)
    o_h = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, st_l)))
    r = gl.convert_layout(o_row, gl.SliceLayout(0, gl.SliceLayout(2, st_l)), assert_trivial=True)
    m = gl.convert_layout(m_m, gl.SliceLayout(0, gl.SliceLayout(2, st_l)), assert_trivial=True)
    gl.store(o_ptr + (r[None, :, None] * D_C + o_d[:, None, None]) + o_h[None, None, :], x, mask=m[None, :, None])


@_constexpr_fn
def _pair_layout(BM: int):
    """The `m64nBMk16` accumulator `[64, BM]` viewed as `[32, BM, 2]` (`[8 q + i, row, h]` for accumulator row `16 q
    + 8 h + i`) with h in the first register (`_store_o`)."""
    regs = [[0, 0, 1], [0, 1, 0]] + [[0, 8 << j, 0] for j in range(BM.bit_length() - 4)]
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=[[0, 2, 0], [0, 4, 0], [1, 0, 0], [2, 0, 0],
                                                                  [4, 0, 0]],
                                      warp_bases=[[8, 0, 0], [16, 0, 0]], block_bases=[], shape=[32, BM, 2])


@_jit
def _score_unit(x5, acc, p1, p2, qbuf, qlo, kbuf, u: gl.constexpr, kz, GC: gl.constexpr, Q_SPLIT: gl.constexpr,
                INFLIGHT: gl.constexpr, dot_a: gl.constexpr, FIRST: gl.constexpr = 0):
    """Issue unit u's score `wgmma`(s) on the A view of `x5`, store its content keys to `kbuf[u]` (`_v_view`), then
    wait until at most `INFLIGHT` (0 or 1) units' `wgmma`s are in flight (`p1`, `p2`: the last unit's A operands,
    alive until its `wgmma`s finish). Returns `(acc, p1, p2)`. `FIRST`: the warpgroup's first unit of the tile
    (starts the accumulator, waits for the previous tile's value reads)."""
    a = _a_view(x5, dot_a)
    acc = warpgroup_mma(a, qbuf[u].index(kz).permute((1, 0)), acc, use_acc=u > FIRST, is_async=True)
    if Q_SPLIT:
        acc = warpgroup_mma(a, qlo[u].index(kz).permute((1, 0)), acc, is_async=True)
    PER: gl.constexpr = 2 if Q_SPLIT else 1
    if u < GC:
        if u == FIRST:
            _cta_barrier()  # every warp's value wgmmas of the previous tile have finished reading kbuf
        kbuf[u].index(0).store(_v_view(x5))
    if INFLIGHT == 0:
        acc, a = warpgroup_mma_wait(0, deps=[acc, a])
        return acc, a, p2
    else:  # INFLIGHT == 1
        if u > 0:
            p1 = warpgroup_mma_wait(PER, deps=[p1])
        return acc, a, p2


@_jit
def _pv(kbuf, pbuf, o, u: gl.constexpr, kz):
    """`o^T[64, BM] + kbuf[u]^T[64, BT] @ P[BT, BM]`, issued without waiting."""
    return warpgroup_mma(kbuf[u].index(kz).permute((1, 0)), pbuf.index(kz), o, is_async=True)


@_jit
def _softmax_pv(acc, kbuf, pbuf, f, m_valid, m_i, l_p, outs, kz, vbuf):
    """One online-softmax step over the tile's scores `acc: [64, BM]` (tokens on axis 0), then the values of every
    content unit (`outs[u] = o_u^T[64, BM] += kbuf[u]^T @ P`, waited). Returns `(m_i, l_p, outs)`, `l_p: [64, BM]`
    the row sums per token (reduced at the end). Lazy rescaling (`_references`): P is stored against the present
    references; a per-warp vote (`vbuf: [4]` int32, read after the barrier that publishes P) on any score passing
    its reference by more than 8 moves the references, rescales the accumulators and stores P again."""
    b_s = gl.where(m_valid, acc * f[None, :], float("-inf"))
    m_new = m_i
    m_use = gl.where(m_i == float("-inf"), 0.0, m_i)
    p = gl.exp2(b_s - m_use[None, :])
    up = (b_s > (m_i + 8.0)[None, :]).to(gl.int32)
    vbuf.store(gl.max(gl.reshape(up, [4, up.shape[0] * up.shape[1] // 4]), axis=1))  # tokens 16 w.. of warp w
    pbuf.index(kz).store(p.to(gl.float16))
    fence_async_shared()
    _cta_barrier()
    if gl.max(vbuf.load(gl.BlockedLayout([4], [32], [4], [0])), axis=0) > 0:
        move, m_new, m_use, p = _references(b_s, m_i)
        alpha = gl.exp2(m_i - m_use)
        l_p = l_p * alpha[None, :]
        outs = _rescale(outs, alpha)
        pbuf.index(kz).store(p.to(gl.float16))
        fence_async_shared()
        _cta_barrier()
    l_p = l_p + p
    return m_new, l_p, _values(kbuf, pbuf, outs, 0, kz)


@_jit
def _lane_sums(p):
    """`[64, BM]` probabilities (accumulator layout: a thread holds tokens `t` and `t + 8` of its warp's 16) ->
    `[4, 8, BM]`, the sum of each thread's two tokens (a register-local add; half the registers of keeping both)."""
    BM: gl.constexpr = p.shape[1]
    return gl.sum(gl.reshape(p, [4, 2, 8, BM]), axis=1)


@_jit
def _references(b_s, m_i):
    """Lazy rescaling of scores `b_s: [64, BM]` (base 2) against references `m_i: [BM]`: `(move, m_new, m_use, p)`,
    a row's reference moved to the tile's maximum where that passes it by more than 8 (RESCALE_LOG2; true for every
    row's first finite scores, `m_i = -inf`), `m_use` the reference with -inf as 0, `p = 2**(b_s - m_use)`."""
    m_tile = gl.max(b_s, axis=0)
    move = m_tile > m_i + 8.0
    m_new = gl.where(move, m_tile, m_i)
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    return move, m_new, m_use, gl.exp2(b_s - m_use[None, :])


@_jit
def _rescale(outs, alpha):
    """The value accumulators `outs` (a tuple of `[64, BM]`) times `alpha: [BM]` (per row)."""
    scaled = ()
    for u in gl.static_range(len(outs)):
        scaled = scaled + (outs[u] * alpha[None, :],)
    return scaled


@_jit
def _values(kbuf, pbuf, outs, U0: gl.constexpr, kz):
    """`outs[u] + kbuf[U0 + u]^T[64, BT] @ P[BT, BM]` for each value accumulator of the tuple `outs`, waited."""
    pv = ()
    for u in gl.static_range(len(outs)):
        pv = pv + (_pv(kbuf, pbuf, outs[u], U0 + u, kz),)
    return warpgroup_mma_wait(0, deps=pv)


@_jit
def _dense_scores(p_c, p_r, o_slot, m_t, s_ct, s_rt, qbuf, qlo, kbuf, kz, U0: gl.constexpr, NU: gl.constexpr,
                  ROPE: gl.constexpr, GC: gl.constexpr, BM: gl.constexpr, Q_SPLIT: gl.constexpr, C_BITS: gl.constexpr,
                  R_BITS: gl.constexpr, INFLIGHT: gl.constexpr, xl: gl.constexpr, acc_l: gl.constexpr,
                  dot_a: gl.constexpr):
    """Scores `[64, BM]` (waited) of content units `U0 .. U0 + NU - 1` (and with `ROPE` the RoPE unit) of 64
    model-dtype copied tokens (rows `o_slot`, valid `m_t`), their content keys stored to `kbuf`; each unit's copies
    loaded while the unit before is scored."""
    acc = gl.zeros([64, BM], gl.float32, acc_l)
    x5 = _load_dense(p_c, o_slot, m_t, s_ct, U0, GC, C_BITS, xl)
    nx = _load_dense(p_c, o_slot, m_t, s_ct, U0 + 1, GC, C_BITS, xl)
    acc, p1, p2 = _score_unit(x5, acc, x5, x5, qbuf, qlo, kbuf, U0, kz, GC, Q_SPLIT, INFLIGHT, dot_a, U0)
    for u in gl.static_range(U0 + 1, U0 + NU - 1):
        x5 = nx
        nx = _load_dense(p_c, o_slot, m_t, s_ct, u + 1, GC, C_BITS, xl)
        acc, p1, p2 = _score_unit(x5, acc, p1, p2, qbuf, qlo, kbuf, u, kz, GC, Q_SPLIT, INFLIGHT, dot_a, U0)
    if ROPE:
        xr = _load_dense(p_r, o_slot, m_t, s_rt, GC, GC, R_BITS, xl)
    acc, p1, p2 = _score_unit(nx, acc, p1, p2, qbuf, qlo, kbuf, U0 + NU - 1, kz, GC, Q_SPLIT, INFLIGHT, dot_a, U0)
    if ROPE:
        acc, p1, p2 = _score_unit(xr, acc, p1, p2, qbuf, qlo, kbuf, GC, kz, GC, Q_SPLIT, INFLIGHT, dot_a, U0)
    acc, p1, p2 = warpgroup_mma_wait(0, deps=[acc, p1, p2])
    return acc


@_jit
def _split_units(w, WU: gl.constexpr, wl: gl.constexpr):
    """Words `[64, 4, 2 WU]` of two consecutive units of a thread's group -> the two units' `[64, 4, WU]` (layout
    `wl`; a relabelling of the same registers)."""
    u0, u1 = gl.split(gl.permute(gl.reshape(w, [64, 4, 2, WU]), (0, 1, 3, 2)))
    return gl.convert_layout(u0, wl, assert_trivial=True), gl.convert_layout(u1, wl, assert_trivial=True)


@_jit
def _unit_pair(cp, u: gl.constexpr, zz, ss, zh, acc, p1, p2, qbuf, qlo, kbuf, kz, p_cc, tn, lo, end,
               GC: gl.constexpr, Q_SPLIT: gl.constexpr, C_BITS: gl.constexpr, INFLIGHT: gl.constexpr,
               wc_l: gl.constexpr, wp_l: gl.constexpr, dot_a: gl.constexpr, FIRST: gl.constexpr, ROWS: gl.constexpr):
    """Content units u and u + 1 (words `cp: [64, 4, 2 WU]`): unpacked, scored and stored as `_score_unit` does,
    `cp` replaced by the words of the tile at `tn` once both are unpacked (`_load_unit`). Returns `(acc, p1, p2,
    cp)`."""
    c0, c1 = _split_units(cp, C_BITS // 2, wc_l)
    x5 = _unpack_unit(c0, zz, ss, zh, C_BITS, wc_l)
    acc, p1, p2 = _score_unit(x5, acc, p1, p2, qbuf, qlo, kbuf, u, kz, GC, Q_SPLIT, INFLIGHT, dot_a, FIRST)
    x5 = _unpack_unit(c1, zz, ss, zh, C_BITS, wc_l)
    cp = _load_unit(p_cc, tn, lo, end, u, GC * 2 * C_BITS, C_BITS, GC, wp_l, 2, ROWS)
    acc, p1, p2 = _score_unit(x5, acc, p1, p2, qbuf, qlo, kbuf, u + 1, kz, GC, Q_SPLIT, INFLIGHT, dot_a, FIRST)
    return acc, p1, p2, cp


@_jit
def _packed_scores(c01, c23, c45, c67, cr, zz0, ss0, zh0, zz1, ss1, zh1, zzr, ssr, zhr, s_row, qbuf, qlo, kbuf, kz,
                   p_cc, p_rc, tn, lo, end, U0: gl.constexpr, NU: gl.constexpr, ROPE: gl.constexpr,
                   GC: gl.constexpr, BM: gl.constexpr, Q_SPLIT: gl.constexpr, C_BITS: gl.constexpr,
                   R_BITS: gl.constexpr, INFLIGHT: gl.constexpr, wc_l: gl.constexpr, wp_l: gl.constexpr,
                   wr_l: gl.constexpr, acc_l: gl.constexpr, dot_a: gl.constexpr, ROWS: gl.constexpr):
    """Scores `[64, BM]` (waited) of content units `U0 .. U0 + NU - 1` (NU = 4 or 8) and, with `ROPE`, the RoPE unit
    of one packed tile, from the words of unit pairs `c01, c23` (units U0 .. U0 + 3: a thread's 32 channels of group
    q) and `c45, c67` (units 4-7, group q + 4), `cr` (RoPE), with the fp16x2 metadata of those groups (`zz0, ss0,
    zh0`; `zz1, ss1, zh1`; `zzr, ssr, zhr`: `half_asm`); the content keys stored to `kbuf`. Each pair's words are
    replaced by the next tile's (at `tn`) once both units are unpacked: `_load_unit` masked to `[lo, end)`, or with
    `ROWS` from the row pointers `p_cc`, `p_rc` up to row `end`. Returns `(acc, c01, c23, c45, c67, cr)`. 8-bit
    RoPE (C4R8, C2R8, C8R8): the RoPE unit scores its integer codes `code - z` (exact in fp16) in a chain of its
    own, times its tokens' steps `s_row: [64]` fp32 (`_row_steps`) when added: one `wgmma` per k-step, exact."""
    RWR: gl.constexpr = 2 * R_BITS
    R_INT: gl.constexpr = R_BITS == 8
    acc = gl.zeros([64, BM], gl.float32, acc_l)
    p1 = acc
    p2 = acc
    acc, p1, p2, c01 = _unit_pair(c01, U0, zz0, ss0, zh0, acc, p1, p2, qbuf, qlo, kbuf, kz, p_cc, tn, lo, end, GC,
                                  Q_SPLIT, C_BITS, INFLIGHT, wc_l, wp_l, dot_a, U0, ROWS)
    acc, p1, p2, c23 = _unit_pair(c23, U0 + 2, zz0, ss0, zh0, acc, p1, p2, qbuf, qlo, kbuf, kz, p_cc, tn, lo, end, GC,
                                  Q_SPLIT, C_BITS, INFLIGHT, wc_l, wp_l, dot_a, U0, ROWS)
    if NU == 8:
        acc, p1, p2, c45 = _unit_pair(c45, 4, zz1, ss1, zh1, acc, p1, p2, qbuf, qlo, kbuf, kz, p_cc, tn, lo, end, GC,
                                      Q_SPLIT, C_BITS, INFLIGHT, wc_l, wp_l, dot_a, 0, ROWS)
        acc, p1, p2, c67 = _unit_pair(c67, 6, zz1, ss1, zh1, acc, p1, p2, qbuf, qlo, kbuf, kz, p_cc, tn, lo, end, GC,
                                      Q_SPLIT, C_BITS, INFLIGHT, wc_l, wp_l, dot_a, 0, ROWS)
    if ROPE and R_INT:
        x5 = _unpack_codes8(cr, zzr, wr_l)
        cr = _load_unit(p_rc, tn, lo, end, GC, RWR, R_BITS, GC, wr_l, 1, ROWS)
        pend = acc  # the content chain; the RoPE unit's starts afresh (FIRST = GC: use_acc off)
        acc, p1, p2 = _score_unit(x5, acc, p1, p2, qbuf, qlo, kbuf, GC, kz, GC, Q_SPLIT, INFLIGHT, dot_a, GC)
    elif ROPE:
        x5 = _unpack_unit(cr, zzr, ssr, zhr, R_BITS, wr_l)
        cr = _load_unit(p_rc, tn, lo, end, GC, RWR, R_BITS, GC, wr_l, 1, ROWS)
        acc, p1, p2 = _score_unit(x5, acc, p1, p2, qbuf, qlo, kbuf, GC, kz, GC, Q_SPLIT, INFLIGHT, dot_a, U0)
    if ROPE and R_INT:
        acc, pend, p1, p2 = warpgroup_mma_wait(0, deps=[acc, pend, p1, p2])
        acc = pend + acc * s_row[:, None]
    else:
        acc, p1, p2 = warpgroup_mma_wait(0, deps=[acc, p1, p2])
    return acc, c01, c23, c45, c67, cr


@_jit
def _tile_scores(c01, c23, c45, c67, cr, s0, z0, s1, z1, sr, zr, p_cs, p_cz, p_rs, p_rz, qbuf, qlo, kbuf, kz, p_cc,
                 p_rc, t0, lo, hi, GC: gl.constexpr, BM: gl.constexpr, Q_SPLIT: gl.constexpr, C_BITS: gl.constexpr,
                 R_BITS: gl.constexpr, INFLIGHT: gl.constexpr, wc_l: gl.constexpr, wp_l: gl.constexpr,
                 wr_l: gl.constexpr, acc_l: gl.constexpr, dot_a: gl.constexpr, ml: gl.constexpr, last, p_pt, page_n,
                 PAGED: gl.constexpr):
    """Scores of the packed tile at int32 position `t0` (relative to the split's first tile) from its words `c01 ..
    cr` and metadata (steps `s0, s1, sr`, zero points `z0, z1, zr`: `_load_meta_rows`), loading the next tile's (`t0
    + 64`) through row pointers up to row `last`. `PAGED`: the planes are page pools, `p_pt` the split's page
    numbers and `page_n` the next tile's (`_tile_page`); the page of the tile after it is loaded here, and below 8
    bits the steps arrive unzeroed (`_load_meta_rows` without `ZERO`) and are zeroed here (`DEFER`). Returns `(acc,
    c01, c23, c45, c67, cr, s0, z0, s1, z1, sr, zr, page)`, the next tile's and the page of the one after."""
    # zeroed where loaded, the steps would make the tile wait for its last code words (issued later in pages than in
    # contiguous planes, on the same scoreboard); the contiguous and 8-bit launches keep that form (moved, the
    # zeroing made the contiguous C4R4 and C2R4 launches 1.02-1.09x slower: docs/BENCHMARKS.md)
    DEFER: gl.constexpr = PAGED and C_BITS < 8
    # the next tile's words asked of L2 first (below 8 bits; docs/BENCHMARKS.md, "Code words asked of L2 a tile ahead")
    PREFETCH: gl.constexpr = C_BITS < 8
    tn = t0 + 64
    page_nn = _tile_page(p_pt, tn + 64, last, PAGED)
    if DEFER:
        s0, s1, sr = _valid_steps(s0, s1, sr, t0, lo, hi, ml)
    zz0, ss0, zh0 = _pair_meta(s0, z0, C_BITS)
    zz1, ss1, zh1 = _pair_meta(s1, z1, C_BITS)
    zzr, ssr, zhr = _pair_meta(sr, zr, R_BITS)
    s_row = _row_steps(sr, acc_l, R_BITS)
    row, shift = _tile_rows(page_n, tn, last, PAGED)
    s0, z0, s1, z1, sr, zr = _load_meta_rows(p_cs, p_cz, p_rs, p_rz, tn, lo, hi, last, shift, GC, ml, not DEFER)
    p_cc = _row_ptrs(p_cc, row, GC * 2 * C_BITS, 2 * C_BITS, wp_l)
    p_rc = _row_ptrs(p_rc, row, 2 * R_BITS, R_BITS // 2, wr_l)
    if PREFETCH:
        _prefetch_rows(p_cc, tn, last, GC * 2 * C_BITS, wp_l)
        _prefetch_rows(p_rc, tn, last, 2 * R_BITS, wr_l)
    acc, c01, c23, c45, c67, cr = _packed_scores(
        c01, c23, c45, c67, cr, zz0, ss0, zh0, zz1, ss1, zh1, zzr, ssr, zhr, s_row, qbuf, qlo, kbuf, kz, p_cc, p_rc, tn,
        lo, last, 0, GC, True, GC, BM, Q_SPLIT, C_BITS, R_BITS, INFLIGHT, wc_l, wp_l, wr_l, acc_l, dot_a, True)
    return acc, c01, c23, c45, c67, cr, s0, z0, s1, z1, sr, zr, page_nn


@_jit
def _alloc_tiles(GC: gl.constexpr, BT: gl.constexpr, BM: gl.constexpr, Q_SPLIT: gl.constexpr):
    """The shared buffers of a program, one allocation per unit (so the barrier analysis sees the units' stores as
    disjoint): `kbuf`, `GC` `[1, BT, 64]` fp16, a tile's content keys for the value `wgmma`s; `qbuf`, `qlo`, `GC + 1`
    `[1, BM, 64]` fp16, the staged queries and (`Q_SPLIT`, else `qbuf` again) their low parts; `pbuf: [1, BT, BM]`
    fp16, the probabilities."""
    k_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    p_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=2 * BM if BM < 64 else 128, element_bitwidth=16,
                                              rank=2)
    kbuf = _unit_buffers(GC, BT, k_sl)
    qbuf = _unit_buffers(GC + 1, BM, k_sl)
    qlo = _unit_buffers(GC + 1, BM, k_sl) if Q_SPLIT else qbuf
    return kbuf, qbuf, qlo, gl.allocate_shared_memory(gl.float16, [1, BT, BM], p_sl)


@_jit
def _unit_buffers(N: gl.constexpr, ROWS: gl.constexpr, sl: gl.constexpr, DEPTH: gl.constexpr = 1,
                  KD: gl.constexpr = gl.float16):
    """A tuple of `N` separately allocated shared buffers `[DEPTH, ROWS, 64]` of the 16-bit type `KD`, one per
    unit."""
    bufs = ()
    for u in gl.static_range(N):
        bufs = bufs + (gl.allocate_shared_memory(KD, [DEPTH, ROWS, 64], sl),)
    return bufs


@_constexpr_fn
def words_layout(wu: int):
    """`[64, 4, wu]` words: lane `4 r + q` of warp w holds token `16 w + r` (and `+ 8`, a register) and quad slot
    q, its `wu` words in registers (the rows and quad slots of the `m64n16k16` A fragments); `wu = 16` is the
    copies' layout (a quad slot's 16 channels)."""
    regs = [[0, 0, 1 << i] for i in range(wu.bit_length() - 1)] + [[8, 0, 0]]
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0],
                                                                  [4, 0, 0]],
                                      warp_bases=[[16, 0, 0], [32, 0, 0]], block_bases=[], shape=[64, 4, wu])


def tile_smem(fmt: CacheFormat, q_split: bool, block_m: int) -> int:
    """Shared memory of a program's tiles: content keys `[GC, 64, 64]` fp16, queries `[GC + 1, block_m, 64]` fp16
    (twice for fp32 queries), P `[64, block_m]` fp16, plus 1 KB of compiler scratch."""
    gc = fmt.content.n_groups
    return gc * BLOCK_T * GROUP * 2 + (gc + 1) * block_m * GROUP * 2 * (2 if q_split else 1) + BLOCK_T * block_m * 2 \
        + 1024


def min_split_tiles(fmt: CacheFormat) -> int:
    """Fewest 64-token tiles in a packed split of the Gluon kernels (`_split_range`)."""
    return MIN_SPLIT_TILES_8BIT if fmt.content.bits == 8 else MIN_SPLIT_TILES


def copy_programs(fmt: CacheFormat) -> int:
    """Programs (partial-output slots) per row and head block for the sink and recent copies: one per 64-token tile
    of each, `cdiv(S, 64) + cdiv(R, 64)` (3 for 4 sink and 128 recent tokens)."""
    return -(-fmt.sink_tokens // BLOCK_T) + -(-fmt.recent_tokens // BLOCK_T)


def flat_grid(NS: int, fmt: CacheFormat, M: int, block_m: int, B: int) -> tuple[int]:
    """The one-dimensional grid of the Gluon kernels: `B * cdiv(M, block_m) * (NS + copy_programs(fmt))` programs,
    numbered as `_program_coords` says."""
    return (B * -(-M // block_m) * (NS + copy_programs(fmt)),)


def launch_flat(kernel, what: str, smem_bytes, fallback: str, block_m: int, q, qr, cp, rp, fmt: CacheFormat,
                sink_c, sink_r, recent_c, recent_r, lp, length, o_part, lse_part, M, Tq, split_target, NS, qk_scale,
                page_table=None, **meta):
    """Launch a Gluon decode kernel on `flat_grid`: queries `[B, M, d_c]` / `[B, M, d_R]`, code planes (read as
    int32 words), copies, left padding, device-side length, partials `[B, M, NS + copy_programs(fmt), d_c]` (fp32,
    or fp16 scaled: `backends.partial_dtype`) and `[B, M, NS + copy_programs(fmt)]` fp32, the kernel's own
    constexprs and options `meta`. `page_table` (int32 `[B, max_pages]`): the `PAGED` launch, planes `[P, 64,
    width]` page pools, `lp` the requests' copy rows, `length` their lengths `[B]`. Refuses a format needing more
    than `SMEM_LIMIT` bytes of shared memory, naming `fallback`."""
    q_split = q.dtype == torch.float32 or qr.dtype == torch.float32
    smem_need = smem_bytes(fmt, q_split)
    if smem_need > SMEM_LIMIT:
        raise ValueError(f"the {what} needs {smem_need} bytes of shared memory for {fmt.name}, more than {SMEM_LIMIT}: "
                         f"use backend={fallback!r}")
    if fmt.content.quantized:
        cw, cs, cz = cp["codes"].view(torch.int32), cp["scale"], cp["zero"]
        rw, rs, rz = rp["codes"].view(torch.int32), rp["scale"], rp["zero"]
    else:  # 16-bit planes (values, no steps: their pointers stand in for the steps' and zero points', never read)
        cw = cs = cz = cp["values"]
        rw = rs = rz = rp["values"]
    paged = page_table is not None
    batch = 0 if paged else 1
    kernel[flat_grid(NS, fmt, M, block_m, q.shape[0])](
        q, qr, cw, cs, cz, rw, rs, rz, sink_c, sink_r, recent_c, recent_r, lp, length,
        o_part, lse_part, M, Tq, split_target, NS, qk_scale, q.stride(0), qr.stride(0),
        *(batch * t.stride(0) for t in (cw, cs, rw, rs)),
        *(t.stride(i) for t in (sink_c, sink_r, recent_c, recent_r) for i in (0, 1)),
        GC=fmt.content.dim // GROUP, C_BITS=fmt.content.bits, R_BITS=fmt.rope.bits,
        S=fmt.sink_tokens, R=fmt.recent_tokens, BM=block_m, Q_SPLIT=q_split, pt_ptr=page_table if paged else lp,
        s_pt=page_table.stride(0) if paged else 0, PAGED=paged, **meta,
    )


def score_rounding(fmt: CacheFormat) -> tuple[bool, bool]:
    """Whether the scores of the Gluon kernels see the packed keys of (content, RoPE) rounded once to fp16, to
    nearest: packed content keys always (a unit's `(code - z) * s` is one fp16 per element, `half_asm`), RoPE keys
    below 8 bits; 8-bit RoPE scores its integer codes, times the token's step in fp32 (exact to the fp32
    accumulation). The values always use the rounded keys. `mla_decode_ref.mla_decode_static_ref(score_rounding=...)`
    scores the same way; the portable kernel's group tiling scores exactly (`q . (code - z)` per group, times `s` in
    fp32) and rounds only its values."""
    return fmt.content.quantized, fmt.rope.bits < 8


def hopper_handles(fmt: CacheFormat, copy_dtype: torch.dtype, device) -> bool:
    """Whether the Gluon kernels can run this case: Gluon available, a CUDA device of compute capability 9.0
    (wgmma), both paths packed at 2/4/8 bits in groups of 64 (RoPE: one group) or both 16-bit planes, bf16/fp16
    copies. (Queries may be bf16, fp16 or fp32; the plane rows must also be contiguous: `planes_contiguous`; each
    kernel names the formats it takes.)"""
    c, r, device = fmt.content, fmt.rope, torch.device(device)
    packed = all(p.quantized and p.bits in (2, 4, 8) and p.group == GROUP for p in (c, r)) and r.n_groups == 1
    return (HAVE_GLUON and (packed or not (c.quantized or r.quantized))
            and copy_dtype in (torch.bfloat16, torch.float16) and device.type == "cuda"
            and torch.cuda.get_device_capability(device) == (9, 0))


def planes_contiguous(fmt: CacheFormat, content_planes: dict, rope_planes: dict) -> bool:
    """Plane rows laid out as docs/CACHE_FORMAT.md says with nothing between tokens (what the word view and the
    compile-time token strides assume); 16-bit `values` rows start on 16 bytes (the `cp.async` copies)."""
    for f, planes in ((fmt.content, content_planes), (fmt.rope, rope_planes)):
        if not f.quantized:
            v = planes["values"]
            if v.stride(2) != 1 or v.stride(1) != f.dim or v.data_ptr() % 16 or v.stride(0) % 8 or f.dim % 8:
                return False
            continue
        codes, scale, zero = planes["codes"], planes["scale"], planes["zero"]
        if (codes.stride(2) != 1 or codes.stride(1) != f.code_bytes or codes.storage_offset() % 4
                or codes.data_ptr() % 16 or codes.stride(0) % 4 or scale.stride() != zero.stride()
                or any(m.stride(2) != 1 or m.stride(1) != f.n_groups for m in (scale, zero))):
            return False
    return True
