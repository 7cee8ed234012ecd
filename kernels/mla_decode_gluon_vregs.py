"""Value operands in registers for the register-operand Gluon kernel (`mla_decode_gluon_regs.py`, `VREG=True`).

The register kernel stores every content key it unpacks for the scores to shared memory (`kbuf`, 64 KB per tile),
because the value `wgmma` (`O^T[64 channels, 16 rows] += V^T[64 channels, 64 tokens] P[64 tokens, 16 rows]`) needs
each warp to see every token of 16 channels, while the score fragments give each warp 16 tokens of every channel.
Nsight Compute (docs/BENCHMARKS.md) put those stores and the `wgmma`s' reads of them at ~60% of the L1 data-pipe
wavefronts, the busiest unit. Here the values take a second path: each thread loads, per 16-token k-step, the code
words of the 16 contiguous channels it owns in the value fragments (`chunk = 8 w + r` of warp w, lane `4 r + q`:
channels `[16 chunk, + 16)`, tokens `2 q + e + 8 h` of the k-step) and unpacks them straight into the register A
operands of the value `wgmma`s. Nothing goes through shared memory but P; the unpacking is done twice per content
key (once per view), the words are read twice (the second time from L1/L2).

Value fragment of M-tile m (`m64n16k16`, A from registers, k_width 2): row `i = 16 w + 8 h' + r` holds channel
`value_row_channel(m, i) = 16 (8 w + r) + 2 m + h'`; its k pair `(2 q, 2 q + 1)` is two consecutive tokens, so one
register holds the same channel of tokens t and t + 1: `pair_asm` interleaves the two tokens' words with `prmt`
(bytes 2j, 2j + 1 of each) and then unpacks as `half_asm` does (`lop3` under the magic number 0x6400, `sub.f16x2`
with `(1024 + z_t, 1024 + z_t+1)`, `mul.f16x2` with `(s_t, s_t+1)`): one rounding to fp16, as the scores' keys.

Layouts (one k-step, 16 tokens): words `[16 t, 32 chunk, WU]` (`vwords_layout`) and keys `[16 t, 32 chunk, 16 c]`
(`vkeys_layout`, the copies are loaded straight into it): lanes `4 r + q` hold token bits 1-2 (`q`) and chunk bits 0-2
(`r`), warps chunk bits 3-4, registers token bits 0 (`e`) and 3 (`h`) and the words / channels.
"""

from __future__ import annotations

import torch

from .mla_decode_gluon import HAVE_GLUON, _jit

if HAVE_GLUON:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait

    from .mla_decode_gluon import _order4, _order8


def value_row_channel(m: int) -> torch.Tensor:
    """`[64]` int64: the content channel of row i of M-tile m's value output `o_m^T` (and A operand)."""
    i = torch.arange(64)
    return 16 * (8 * (i // 16) + i % 8) + 2 * m + (i % 16) // 8


def pair_asm(bits: int) -> str:
    """PTX that turns two code words holding the same `E = 32 / bits` channels of tokens t (`a`) and t + 1 (`b`) into
    `(code - z) * s` of both: output `e * E + c` (16-bit) is channel c (bits `[bits c, bits (c + 1))` of the word) of
    token t + e. Operands: outputs `$0 .. $(2E - 1)`, then `a`, `b`, fp16x2 `(1024 + z_t, 1024 + z_t+1)` and fp16x2
    `(s_t, s_t+1)`. Per byte pair j of the words one `prmt` puts a's bytes 2j, 2j + 1 in the low half and b's in the
    high half; then per channel one `lop3` (after a shift), `sub.f16x2` (exact), `mul.f16x2` (one rounding)."""
    n = 16 // bits  # channels per byte pair
    e = 2 * n
    o = 2 * e  # first input operand
    mask2 = ((1 << bits) - 1) * 0x10001
    lines = ["{", ".reg .b32 x, t, h;"]
    for j, sel in enumerate(("0x5410", "0x7632")):
        lines.append(f"prmt.b32 x, ${o}, ${o + 1}, {sel};")
        for k in range(n):
            src = "x"
            if k:
                lines.append(f"shr.u32 t, x, {bits * k};")
                src = "t"
            c = n * j + k
            lines.append(f"lop3.b32 t, {src}, {mask2:#010x}, 0x64006400, 0xEA;")
            lines.append(f"sub.f16x2 t, t, ${o + 2};")
            lines.append(f"mul.f16x2 h, t, ${o + 3};")
            lines.append(f"mov.b32 {{${c}, ${e + c}}}, h;")
    lines.append("}")
    return "\n".join(lines)


if HAVE_GLUON:
    _PAIR_ASM_2 = gl.constexpr(pair_asm(2))
    _PAIR_ASM_4 = gl.constexpr(pair_asm(4))
    _PAIR_ASM_8 = gl.constexpr(pair_asm(8))


def vwords_layout(wu: int):
    """`[16, 32, wu]` value words of one k-step (token, chunk, word): see the module docstring."""
    regs = [[1, 0, 0], [8, 0, 0]] + [[0, 0, 1 << i] for i in range(wu.bit_length() - 1)]
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=[[2, 0, 0], [4, 0, 0], [0, 1, 0], [0, 2, 0],
                                                                  [0, 4, 0]],
                                      warp_bases=[[0, 8, 0], [0, 16, 0]], block_bases=[], shape=[16, 32, wu])


def vkeys_layout():
    """`[16, 32, 16]` value keys of one k-step (token, chunk, channel of the chunk)."""
    return vwords_layout(16)


# --------------------------------------------------------------------------------------------- device helpers
@_jit
def _order16(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15):
    return gl.join(_order8(x0, x2, x4, x6, x8, x10, x12, x14), _order8(x1, x3, x5, x7, x9, x11, x13, x15))


@_jit
def _fp16_pair(lo, hi):
    """Two fp16 tensors -> int32 fp16x2 `(lo, hi)`."""
    a = lo.to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
    b = hi.to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
    return a | (b << 16)


@_jit
def _split_tokens3(x):
    """`[16, 32, W]` -> the even and odd tokens `[8, 32, W]` (token bit 0 is a register)."""
    return gl.split(gl.permute(gl.reshape(x, [8, 2, 32, x.shape[2]]), (0, 2, 3, 1)))


@_jit
def _split_tokens2(x):
    """`[16, 32]` -> the even and odd tokens `[8, 32]`."""
    return gl.split(gl.permute(gl.reshape(x, [8, 2, 32]), (0, 2, 1)))


@_jit
def load_vwords(p_c, t0, lo, hi, ROW_WORDS: gl.constexpr, WU: gl.constexpr, vl: gl.constexpr):
    """Value words `[16, 32, WU]` int32 of tokens `[t0, t0 + 16)` (zeros outside `[lo, hi)`): chunk's words `[chunk *
    WU, + WU)` of each token row."""
    ml: gl.constexpr = gl.SliceLayout(2, vl)
    o_t = t0 + gl.arange(0, 16, layout=gl.SliceLayout(1, ml)).to(gl.int64)
    o_c = gl.arange(0, 32, layout=gl.SliceLayout(0, ml))
    o_w = gl.arange(0, WU, layout=gl.SliceLayout(0, gl.SliceLayout(1, vl)))
    off = (o_t[:, None] * ROW_WORDS + (o_c * WU)[None, :])[:, :, None] + o_w[None, None, :]
    m = ((o_t >= lo) & (o_t < hi))[:, None, None]
    return gl.load(p_c + off, mask=m, other=0)


@_jit
def load_vmeta(p_s, p_z, t0, lo, hi, GC: gl.constexpr, vl: gl.constexpr):
    """Steps `[16, 32]` fp16 and stored zero points int8 of each chunk's group (`chunk // 4`) for tokens `[t0, t0 +
    16)`, zeros outside `[lo, hi)`."""
    ml: gl.constexpr = gl.SliceLayout(2, vl)
    o_t = t0 + gl.arange(0, 16, layout=gl.SliceLayout(1, ml)).to(gl.int64)
    o_c = gl.arange(0, 32, layout=gl.SliceLayout(0, ml))
    off = o_t[:, None] * GC + (o_c // 4)[None, :]
    m = ((o_t >= lo) & (o_t < hi))[:, None]
    return gl.load(p_s + off, mask=m, other=0.0), gl.load(p_z + off, mask=m, other=0)


@_jit
def unpack_vkeys(w, s, z, BITS: gl.constexpr, HALF: gl.constexpr):
    """Value words `[16, 32, WU]` and their steps / stored zero points `[16, 32]` -> keys `[16, 32, 16]` fp16
    `(code - z) * s` (channel `E w + c` of the chunk at `[t, chunk, E w + c]`)."""
    WU: gl.constexpr = BITS // 2
    E: gl.constexpr = 32 // BITS
    w0, w1 = _split_tokens3(w)
    s0, s1 = _split_tokens2(s)
    z0, z1 = _split_tokens2(z)
    zz = _fp16_pair((z0.to(gl.int32) + (1024 + HALF)).to(gl.float16), (z1.to(gl.int32) + (1024 + HALF)).to(gl.float16))
    ss = _fp16_pair(s0, s1)
    ml: gl.constexpr = gl.SliceLayout(2, w0.type.layout)
    zz, w0 = gl.broadcast(gl.convert_layout(zz, ml, assert_trivial=True)[:, :, None], w0)
    ss, w1 = gl.broadcast(gl.convert_layout(ss, ml, assert_trivial=True)[:, :, None], w1)
    if BITS == 4:
        y = gl.inline_asm_elementwise(_PAIR_ASM_4, "=h," * 16 + "r,r,r,r", [w0, w1, zz, ss],
                                      dtype=[gl.float16] * 16, is_pure=True, pack=1)
        k0 = _order8(y[0], y[1], y[2], y[3], y[4], y[5], y[6], y[7])
        k1 = _order8(y[8], y[9], y[10], y[11], y[12], y[13], y[14], y[15])
    elif BITS == 2:
        y = gl.inline_asm_elementwise(_PAIR_ASM_2, "=h," * 32 + "r,r,r,r", [w0, w1, zz, ss],
                                      dtype=[gl.float16] * 32, is_pure=True, pack=1)
        k0 = _order16(y[0], y[1], y[2], y[3], y[4], y[5], y[6], y[7], y[8], y[9], y[10], y[11], y[12], y[13], y[14],
                      y[15])
        k1 = _order16(y[16], y[17], y[18], y[19], y[20], y[21], y[22], y[23], y[24], y[25], y[26], y[27], y[28],
                      y[29], y[30], y[31])
    else:
        y = gl.inline_asm_elementwise(_PAIR_ASM_8, "=h," * 8 + "r,r,r,r", [w0, w1, zz, ss],
                                      dtype=[gl.float16] * 8, is_pure=True, pack=1)
        k0 = _order4(y[0], y[1], y[2], y[3])
        k1 = _order4(y[4], y[5], y[6], y[7])
    k0 = gl.reshape(k0, [8, 32, WU * E])  # [t // 2, chunk, E w + c]
    k1 = gl.reshape(k1, [8, 32, WU * E])
    return gl.reshape(gl.permute(gl.join(k0, k1), (0, 3, 1, 2)), [16, 32, 16])


@_jit
def load_vkeys_dense(p, o_slot, m_t, s_t, kl: gl.constexpr):
    """Model-dtype copies -> fp16 keys `[16, 32, 16]` of rows `o_slot: [16]` (valid `m_t`), channel `16 chunk + c`."""
    ml: gl.constexpr = gl.SliceLayout(2, kl)
    o_c = gl.arange(0, 32, layout=gl.SliceLayout(0, ml))
    o_e = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, kl)))
    off = ((o_slot * s_t)[:, None] + (o_c * 16)[None, :])[:, :, None] + o_e[None, None, :]
    return gl.load(p + off, mask=m_t[:, None, None], other=0.0).to(gl.float16)


@_jit
def _a_tile(x, dot_a: gl.constexpr):
    """`[16, 4, 8, 2]` keys `[t, w, r, h']` of one M-tile -> its `[64, 16]` A operand (row `16 w + 8 h' + r`)."""
    return gl.convert_layout(gl.reshape(gl.permute(x, (1, 3, 2, 0)), [64, 16]), dot_a, assert_trivial=True)


@_jit
def value_kstep(keys, pb, o0, o1, o2, o3, o4, o5, o6, o7, dot_a: gl.constexpr):
    """Issue the 8 value `wgmma`s of one k-step: `o_m^T += A_m P_k` for M-tiles m = 0..7 from `keys: [16, 32, 16]`
    (`value_row_channel`) and `pb`: the k-step's `[16, BM]` slice of P in shared memory. Returns the accumulators
    and the 8 A operands (keep them alive until the `wgmma`s have finished)."""
    x = gl.permute(gl.reshape(keys, [16, 4, 8, 2, 2, 2, 2]), (0, 1, 2, 6, 3, 4, 5))  # [t, w, r, h', m2, m1, m0]
    e0, e1 = gl.split(x)  # m0
    e00, e01 = gl.split(e0)  # m1 (m0 = 0)
    e10, e11 = gl.split(e1)  # m1 (m0 = 1)
    x0, x4 = gl.split(e00)
    x2, x6 = gl.split(e01)
    x1, x5 = gl.split(e10)
    x3, x7 = gl.split(e11)
    a0 = _a_tile(x0, dot_a)
    a1 = _a_tile(x1, dot_a)
    a2 = _a_tile(x2, dot_a)
    a3 = _a_tile(x3, dot_a)
    a4 = _a_tile(x4, dot_a)
    a5 = _a_tile(x5, dot_a)
    a6 = _a_tile(x6, dot_a)
    a7 = _a_tile(x7, dot_a)
    o0 = warpgroup_mma(a0, pb, o0, is_async=True)
    o1 = warpgroup_mma(a1, pb, o1, is_async=True)
    o2 = warpgroup_mma(a2, pb, o2, is_async=True)
    o3 = warpgroup_mma(a3, pb, o3, is_async=True)
    o4 = warpgroup_mma(a4, pb, o4, is_async=True)
    o5 = warpgroup_mma(a5, pb, o5, is_async=True)
    o6 = warpgroup_mma(a6, pb, o6, is_async=True)
    o7 = warpgroup_mma(a7, pb, o7, is_async=True)
    return o0, o1, o2, o3, o4, o5, o6, o7, a0, a1, a2, a3, a4, a5, a6, a7


@_jit
def _kstep_keys(PACKED: gl.constexpr, k: gl.constexpr, w, vs, vz, p_c, p_s, p_z, t0, lo, hi, j, m_j, s_t,
                ROW_WORDS: gl.constexpr, GC: gl.constexpr, BITS: gl.constexpr, HALF: gl.constexpr, vl: gl.constexpr,
                kl: gl.constexpr):
    """k-step k's value keys `[16, 32, 16]` and, packed, the next k-step's words and metadata (loaded as soon as
    this one's are unpacked; the bytes were read for the scores, so they come from L1): `PACKED`: `w, vs, vz` are
    this k-step's words, steps and zero points (tokens `t0 + 16 k + [0, 16)`, valid `[lo, hi)`); otherwise the keys
    are loaded from the copies at `p_c` (rows `j: [16]`, valid `m_j`, row stride `s_t`). Returns `(keys, w, vs,
    vz)`."""
    if PACKED:
        keys = unpack_vkeys(w, vs, vz, BITS, HALF)
        if k < 3:
            w = load_vwords(p_c, t0 + 16 * (k + 1), lo, hi, ROW_WORDS, BITS // 2, vl)
            vs, vz = load_vmeta(p_s, p_z, t0 + 16 * (k + 1), lo, hi, GC, vl)
        return keys, w, vs, vz
    else:
        return load_vkeys_dense(p_c, j, m_j, s_t, kl), w, vs, vz


@_jit
def value_tile(PACKED: gl.constexpr, p_c, p_s, p_z, t0, lo, hi, j0, j1, j2, j3, m0, m1, m2, m3, s_t, pbuf,
               o0, o1, o2, o3, o4, o5, o6, o7, kz, ROW_WORDS: gl.constexpr, GC: gl.constexpr, BITS: gl.constexpr,
               HALF: gl.constexpr, vl: gl.constexpr, kl: gl.constexpr, dot_a: gl.constexpr):
    """The value `wgmma`s of one 64-token tile (waited), k-step by k-step, each k-step's 8 `wgmma`s issued while the
    next is unpacked (two k-steps' A operands alive). `PACKED`: from the code words of tokens `t0 + [0, 64)` at
    `p_c` (steps `p_s`, zero points `p_z`, valid `[lo, hi)`); otherwise from the copies at `p_c`, k-step k's rows
    `j_k: [16]`, valid `m_k`, row stride `s_t`."""
    p = pbuf.index(kz)
    if PACKED:
        w = load_vwords(p_c, t0, lo, hi, ROW_WORDS, BITS // 2, vl)
        vs, vz = load_vmeta(p_s, p_z, t0, lo, hi, GC, vl)
    else:
        w = j0
        vs = j0
        vz = j0
    kv, w, vs, vz = _kstep_keys(PACKED, 0, w, vs, vz, p_c, p_s, p_z, t0, lo, hi, j0, m0, s_t, ROW_WORDS, GC, BITS,
                                HALF, vl, kl)
    o0, o1, o2, o3, o4, o5, o6, o7, a0, a1, a2, a3, a4, a5, a6, a7 = value_kstep(
        kv, p.slice(0, 16), o0, o1, o2, o3, o4, o5, o6, o7, dot_a)
    kv, w, vs, vz = _kstep_keys(PACKED, 1, w, vs, vz, p_c, p_s, p_z, t0, lo, hi, j1, m1, s_t, ROW_WORDS, GC, BITS,
                                HALF, vl, kl)
    o0, o1, o2, o3, o4, o5, o6, o7, b0, b1, b2, b3, b4, b5, b6, b7 = value_kstep(
        kv, p.slice(16, 16), o0, o1, o2, o3, o4, o5, o6, o7, dot_a)
    a0, a1, a2, a3, a4, a5, a6, a7 = warpgroup_mma_wait(8, deps=[a0, a1, a2, a3, a4, a5, a6, a7])
    kv, w, vs, vz = _kstep_keys(PACKED, 2, w, vs, vz, p_c, p_s, p_z, t0, lo, hi, j2, m2, s_t, ROW_WORDS, GC, BITS,
                                HALF, vl, kl)
    o0, o1, o2, o3, o4, o5, o6, o7, a0, a1, a2, a3, a4, a5, a6, a7 = value_kstep(
        kv, p.slice(32, 16), o0, o1, o2, o3, o4, o5, o6, o7, dot_a)
    b0, b1, b2, b3, b4, b5, b6, b7 = warpgroup_mma_wait(8, deps=[b0, b1, b2, b3, b4, b5, b6, b7])
    kv, w, vs, vz = _kstep_keys(PACKED, 3, w, vs, vz, p_c, p_s, p_z, t0, lo, hi, j3, m3, s_t, ROW_WORDS, GC, BITS,
                                HALF, vl, kl)
    o0, o1, o2, o3, o4, o5, o6, o7, b0, b1, b2, b3, b4, b5, b6, b7 = value_kstep(
        kv, p.slice(48, 16), o0, o1, o2, o3, o4, o5, o6, o7, dot_a)
    o0, o1, o2, o3, o4, o5, o6, o7, a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7 = \
        warpgroup_mma_wait(0, deps=[o0, o1, o2, o3, o4, o5, o6, o7, a0, a1, a2, a3, a4, a5, a6, a7,
                                    b0, b1, b2, b3, b4, b5, b6, b7])
    return o0, o1, o2, o3, o4, o5, o6, o7


@_jit
def store_o_v(o_ptr, o_row, m_m, o, inv_l, m: gl.constexpr, D_C: gl.constexpr, acc_l: gl.constexpr):
    """`o_m^T[64, BM]` (row i = channel `value_row_channel(m)[i]`), normalised, to the partial output rows."""
    i = gl.arange(0, 64, layout=gl.SliceLayout(1, acc_l))
    o_d = 16 * (8 * (i // 16) + i % 8) + 2 * m + (i % 16) // 8
    gl.store(o_ptr + o_row[None, :] * D_C + o_d[:, None], o * inv_l[None, :], mask=m_m[None, :])
