"""Triton split-K MLA decode on the packed QuantMLA cache: absorbed attention of a few query tokens over the history.

What one call computes (the plain PyTorch version is `mla_decode_ref.py`; design notes in `docs/KERNELS.md`):

    rows m = (head h, query token t) of `q_lat: [B, H, Tq, d_c]`, `q_rot: [B, H, Tq, d_R]`, flattened to `M = H * Tq`
    score[m, j] = (q_lat[m] . c[j] + q_rot[m] . k_R[j]) * scaling          for every valid cached position j
    o_lat[m] = softmax_j(score[m]) @ c,  lse[m] = logsumexp_j score[m]

Valid positions of batch row b are `[left_padding[b], length)`, and query t sees only positions
`< length - Tq + t + 1` (causal). Each position is read exactly once: positions `[lp, lp + S)` from the model-dtype
sink copy, the last `R` positions from the model-dtype recent ring (slot `p % R`), every other one from the packed
planes, dequantized in registers (byte layout in `quantmla_hf/format.py`). Nothing of the history is written back.

Kernel 1 (`mla_decode_fwd_kernel`): one program per (head block, batch row, split). Splits `0 .. NS-1` take
shares of the packed positions `[S, length - R)` sized from the length (`split_plan`); split `NS` takes the sink and
recent tokens. Each program keeps an online softmax in base 2 and writes its partial `o: [B, M, NS+1, d_c]`
(normalised) and `lse: [B, M, NS+1]`. The splits are merged by log-sum-exp by the fast module's combine kernel
(`mla_decode_fast.mla_decode_fast_combine_kernel`: fixed chunks, so the result does not depend on the grid).

Arithmetic (design notes: docs/KERNELS.md "Arithmetic and accuracy"):

    scores, one quantization group g at a time:  acc[m, j] += (q_g[m] . (code - z)_g[j]) * s_g[j]
        `code - z` is a small integer, exact in fp16, so each dot is exact up to fp32 accumulation; a 16-bit path
        is cut into nominal 64-column groups with unit scales
    values, whole width:  o[m] += p[m, j] * V[j]  with  V = fp16((code - z) * s)  (one rounding) and fp16 p

On CUDA the codes are dequantized by inline PTX (`_dequant_asm`: fp16 "magic number" 1536, no int-to-float
conversion); the Triton interpreter has no inline assembly, so on CPU the same values come from plain Triton integer
ops. Queries are scaled per row by a power of two that keeps them inside fp16's range; bf16/fp16 queries are then
exact in one fp16 operand, fp32 queries use a high/low fp16 split (two dots, ~22-bit products). Model-dtype copies
(bf16) are converted to fp16 for the dots, exact for magnitudes in [6e-5, 65504]. With fp32 models (`EXACT`) every
dot is an fp32 IEEE dot instead. Batch-row and token offsets are int64.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from quantmla_hf.format import CacheFormat

LOG2E = 1.4426950408889634


@triton.jit
def _dot(a, b, EXACT: tl.constexpr):
    if EXACT:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


# fp16 "magic number" dequantization in inline PTX, four codes per instance, producing fp16 pairs in element order.
# The input holds each code byte repeated once per code it carries (4 bits: b0 b0 b1 b1; 2 bits: b0 b0 b0 b0;
# 8 bits: b0 b1 b2 b3), so one 32-bit register feeds one instance that writes its four codes as two f16x2:
#   prmt   places one byte in the low byte of both halves (8 bits: two bytes, with 0x66 above each),
#   lop3   keeps one code per half, shifted by its bit offset k, and ORs in 0x6600 (fp16 1536: ulp 1 up to 2048),
#   fma    `x * 2**-k - (1536 * 2**-k)` leaves the code exactly (8 bits: a plain subtraction of 1536),
#   sub    the zero point z of each element's group, and, scaled, `mul` by its fp16 scale (one rounding).
# Triton packs four elements that are consecutive in a thread's registers, which need not be consecutive in the
# tensor (another token, another group): so every element takes its own z and scale, paired per f16x2 by `prmt`.
# Operands: $0, $1 the two f16x2 outputs; $2 the four bytes; $3 .. $6 each element's (z, z) fp16 pair;
# $7 .. $10 each element's (s, s) pair.
def _dequant_asm(bits: int, scaled: bool) -> str:
    lines = ["{", ".reg .b32 a, b, t0, t1, k0, k1, k2, p0, p1;"]
    if bits == 8:
        lines += ["mov.b32 k0, 0x66666666;", "mov.b32 k1, 0x66006600;",
                  "prmt.b32 t0, $2, k0, 0x5140;", "prmt.b32 t1, $2, k0, 0x5342;",
                  "sub.f16x2 t0, t0, k1;", "sub.f16x2 t1, t1, k1;"]
    elif bits == 4:
        # (1, 1/16) and -(1536, 96)
        lines += ["mov.b32 k0, 0x66006600;", "mov.b32 k1, 0x2c003c00;", "mov.b32 k2, 0xd600e600;",
                  "prmt.b32 a, $2, 0, 0x4140;", "prmt.b32 b, $2, 0, 0x4342;",
                  "lop3.b32 t0, a, 0x00f0000f, k0, 0xea;", "lop3.b32 t1, b, 0x00f0000f, k0, 0xea;",
                  "fma.rn.f16x2 t0, t0, k1, k2;", "fma.rn.f16x2 t1, t1, k1, k2;"]
    else:
        # (1, 1/4), -(1536, 384) for codes 4i, 4i+1 and (1/16, 1/64), -(96, 24) for codes 4i+2, 4i+3
        lines += ["mov.b32 k0, 0x66006600;", "prmt.b32 a, $2, 0, 0x4140;",
                  "lop3.b32 t0, a, 0x000c0003, k0, 0xea;", "lop3.b32 t1, a, 0x00c00030, k0, 0xea;",
                  "mov.b32 k1, 0x34003c00;", "mov.b32 k2, 0xde00e600;", "fma.rn.f16x2 t0, t0, k1, k2;",
                  "mov.b32 k1, 0x24002c00;", "mov.b32 k2, 0xce00d600;", "fma.rn.f16x2 t1, t1, k1, k2;"]
    # (z of element 0, z of element 1) and (z of element 2, z of element 3): low halves of $3/$4 and of $5/$6.
    lines += ["prmt.b32 p0, $3, $4, 0x5410;", "prmt.b32 p1, $5, $6, 0x5410;",
              "sub.f16x2 t0, t0, p0;", "sub.f16x2 t1, t1, p1;"]
    if scaled:
        lines += ["prmt.b32 p0, $7, $8, 0x5410;", "prmt.b32 p1, $9, $10, 0x5410;",
                  "mul.rn.f16x2 t0, t0, p0;", "mul.rn.f16x2 t1, t1, p1;"]
    lines += ["mov.b32 $0, t0;", "mov.b32 $1, t1;", "}"]
    return "\n".join(lines)


DEQUANT_ASM_2 = tl.constexpr(_dequant_asm(2, False))
DEQUANT_ASM_4 = tl.constexpr(_dequant_asm(4, False))
DEQUANT_ASM_8 = tl.constexpr(_dequant_asm(8, False))
DEQUANT_SCALED_ASM_2 = tl.constexpr(_dequant_asm(2, True))
DEQUANT_SCALED_ASM_4 = tl.constexpr(_dequant_asm(4, True))
DEQUANT_SCALED_ASM_8 = tl.constexpr(_dequant_asm(8, True))


@triton.jit
def _dequant_bytes(b_byte, b_zero, b_scale, BITS: tl.constexpr, SCALED: tl.constexpr):
    """`b_byte: [BN, NB]` uint8 code bytes, `b_zero, b_scale: [BN, NB * 8 // BITS]` int32 fp16 pairs (z, z) and
    (s, s) of each element's group -> `[BN, NB * 8 // BITS]` fp16 `code - z` (exact) or `(code - z) * s` (one
    fp16 rounding), in element order."""
    BN: tl.constexpr = b_byte.shape[0]
    NB: tl.constexpr = b_byte.shape[1]
    if BITS == 4:
        b_in = tl.reshape(tl.join(b_byte, b_byte), (BN, NB * 2))
    elif BITS == 2:
        b_in = tl.reshape(tl.join(tl.join(b_byte, b_byte), tl.join(b_byte, b_byte)), (BN, NB * 4))
    else:
        b_in = b_byte
    if SCALED:
        if BITS == 8:
            return tl.inline_asm_elementwise(DEQUANT_SCALED_ASM_8, "=r,=r,r,r,r,r,r,r,r,r,r",
                                             [b_in, b_zero, b_scale], dtype=tl.float16, is_pure=True, pack=4)
        elif BITS == 4:
            return tl.inline_asm_elementwise(DEQUANT_SCALED_ASM_4, "=r,=r,r,r,r,r,r,r,r,r,r",
                                             [b_in, b_zero, b_scale], dtype=tl.float16, is_pure=True, pack=4)
        else:
            return tl.inline_asm_elementwise(DEQUANT_SCALED_ASM_2, "=r,=r,r,r,r,r,r,r,r,r,r",
                                             [b_in, b_zero, b_scale], dtype=tl.float16, is_pure=True, pack=4)
    if BITS == 8:
        return tl.inline_asm_elementwise(DEQUANT_ASM_8, "=r,=r,r,r,r,r,r", [b_in, b_zero], dtype=tl.float16,
                                         is_pure=True, pack=4)
    elif BITS == 4:
        return tl.inline_asm_elementwise(DEQUANT_ASM_4, "=r,=r,r,r,r,r,r", [b_in, b_zero], dtype=tl.float16,
                                         is_pure=True, pack=4)
    else:
        return tl.inline_asm_elementwise(DEQUANT_ASM_2, "=r,=r,r,r,r,r,r", [b_in, b_zero], dtype=tl.float16,
                                         is_pure=True, pack=4)


@triton.jit
def _half_pair(x):
    """fp16 values `x` -> int32 bit patterns of the pair (x, x)."""
    b = x.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return b * 0x10001


@triton.jit
def _unpack_bytes(b_byte, BITS: tl.constexpr):
    """`[BN, nbytes]` int32 bytes -> `[BN, nbytes * 8 // BITS]` int32 codes in element order (interpreter path)."""
    MASK: tl.constexpr = (1 << BITS) - 1
    if BITS == 8:
        return b_byte
    elif BITS == 4:
        return tl.interleave(b_byte & MASK, b_byte >> 4)
    else:
        return tl.interleave(
            tl.interleave(b_byte & MASK, (b_byte >> 4) & MASK), tl.interleave((b_byte >> 2) & MASK, b_byte >> 6)
        )


@triton.jit
def _packed_group(p_codes, p_scale, p_zero, stride_t, stride_mt, o_t, m_t, g: tl.constexpr, GROUP: tl.constexpr,
                  GROUPP: tl.constexpr, BITS: tl.constexpr, EXACT: tl.constexpr, ASM: tl.constexpr):
    """Group `g` of tokens `o_t: [BN]` of one packed path (planes offset to the batch row): the exact integers
    `code - zero` as `[BN, GROUPP]` (fp16, fp32 when EXACT; padding columns hold finite junk that meets zero query
    columns) and the group scales `[BN]` fp32 (0 where masked)."""
    HALF: tl.constexpr = 1 << (BITS - 1)
    b_z = tl.load(p_zero + o_t * stride_mt + g, mask=m_t, other=0).to(tl.int32) + HALF
    b_s = tl.load(p_scale + o_t * stride_mt + g, mask=m_t, other=0.0).to(tl.float32)
    if ASM:
        NB: tl.constexpr = GROUP * BITS // 8
        o_k = tl.arange(0, NB)
        b_byte = tl.load(p_codes + (o_t * stride_t)[:, None] + g * NB + o_k[None, :], mask=m_t[:, None], other=0)
        zp = tl.broadcast_to(_half_pair(b_z)[:, None], (o_t.shape[0], GROUP))
        return _dequant_bytes(b_byte, zp, zp, BITS, False), b_s
    PACK: tl.constexpr = 8 // BITS
    o_k = tl.arange(0, GROUPP // PACK)
    m_k = m_t[:, None] & (o_k[None, :] < GROUP // PACK)
    b_byte = tl.load(p_codes + (o_t * stride_t)[:, None] + g * (GROUP // PACK) + o_k[None, :], mask=m_k, other=0)
    b_v = _unpack_bytes(b_byte.to(tl.int32), BITS) - b_z[:, None]
    # One return per function: triton 3.6 refuses returns of different types even under a constexpr branch.
    if EXACT:
        b_v = b_v.to(tl.float32)
    else:
        b_v = b_v.to(tl.float16)
    return b_v, b_s


@triton.jit
def _packed_values(p_codes, p_scale, p_zero, stride_t, stride_mt, o_t, m_t, D: tl.constexpr, DP: tl.constexpr,
                   GROUP: tl.constexpr, BITS: tl.constexpr, EXACT: tl.constexpr, ASM: tl.constexpr):
    """All `D` dequantized values `(code - zero) * scale` of tokens `o_t` as `[BN, DP]` (fp16 with one rounding,
    fp32 when EXACT; zeros past D and for masked tokens)."""
    HALF: tl.constexpr = 1 << (BITS - 1)
    if ASM:
        NB: tl.constexpr = DP * BITS // 8
        GP: tl.constexpr = DP // GROUP
        BN: tl.constexpr = o_t.shape[0]
        o_g = tl.arange(0, GP)
        m_g = m_t[:, None] & (o_g[None, :] < D // GROUP)
        o_meta = (o_t * stride_mt)[:, None] + o_g[None, :]  # [BN, GP]
        b_z = tl.load(p_zero + o_meta, mask=m_g, other=0).to(tl.int32) + HALF
        b_s = tl.load(p_scale + o_meta, mask=m_g, other=0.0)
        # Each element takes its group's pairs: [BN, GP] -> [BN, GP, GROUP] -> [BN, DP].
        zp = tl.reshape(tl.broadcast_to(_half_pair(b_z)[:, :, None], (BN, GP, GROUP)), (BN, DP))
        sp = tl.reshape(tl.broadcast_to(_half_pair(b_s)[:, :, None], (BN, GP, GROUP)), (BN, DP))
        o_k = tl.arange(0, NB)
        b_byte = tl.load(p_codes + (o_t * stride_t)[:, None] + o_k[None, :],
                         mask=m_t[:, None] & (o_k[None, :] < D * BITS // 8), other=0)
        return _dequant_bytes(b_byte, zp, sp, BITS, True)
    PACK: tl.constexpr = 8 // BITS
    o_k = tl.arange(0, DP // PACK)
    m_k = m_t[:, None] & (o_k[None, :] < D // PACK)
    b_byte = tl.load(p_codes + (o_t * stride_t)[:, None] + o_k[None, :], mask=m_k, other=0)
    o_d = tl.arange(0, DP)
    m_d = m_t[:, None] & (o_d[None, :] < D)
    o_meta = (o_t * stride_mt)[:, None] + (o_d // GROUP)[None, :]
    b_z = tl.load(p_zero + o_meta, mask=m_d, other=0).to(tl.int32) + HALF
    b_s = tl.load(p_scale + o_meta, mask=m_d, other=0.0).to(tl.float32)
    b_v = (_unpack_bytes(b_byte.to(tl.int32), BITS) - b_z).to(tl.float32) * b_s
    if not EXACT:
        b_v = b_v.to(tl.float16)
    return b_v


@triton.jit
def _dense_cols(p_vals, stride_t, o_t, m_t, col0: tl.constexpr, WIDTH: tl.constexpr, WIDTHP: tl.constexpr,
                D: tl.constexpr, EXACT: tl.constexpr):
    """Columns `[col0, col0 + WIDTH)` of model-dtype rows `o_t` as `[BN, WIDTHP]` (fp16, fp32 when EXACT; zeros
    where masked or past D)."""
    o_k = tl.arange(0, WIDTHP)
    m = m_t[:, None] & (o_k[None, :] < WIDTH) & (col0 + o_k[None, :] < D)
    b_v = tl.load(p_vals + (o_t * stride_t)[:, None] + col0 + o_k[None, :], mask=m, other=0.0)
    if EXACT:
        b_v = b_v.to(tl.float32)
    else:
        b_v = b_v.to(tl.float16)
    return b_v


@triton.jit
def _query_cols(p_q, o_m, m_m, col0: tl.constexpr, WIDTH: tl.constexpr, WIDTHP: tl.constexpr, D: tl.constexpr,
                inv_f, EXACT: tl.constexpr):
    """Query columns `[col0, col0 + WIDTH)` of rows `o_m` times the per-row power of two `inv_f`:
    `(hi, lo)` fp16 `[BM, WIDTHP]` with `lo` the rounding error of `hi` (fp32 `(q, q)` when EXACT)."""
    o_k = tl.arange(0, WIDTHP)
    m = m_m[:, None] & (o_k[None, :] < WIDTH) & (col0 + o_k[None, :] < D)
    q = tl.load(p_q + o_m[:, None] * D + col0 + o_k[None, :], mask=m, other=0.0).to(tl.float32)
    if EXACT:
        q_hi = q
        q_lo = q
    else:
        q = q * inv_f[:, None]
        q_hi = q.to(tl.float16)
        q_lo = (q - q_hi.to(tl.float32)).to(tl.float16)
    return q_hi, q_lo


@triton.jit
def _qk(q_hi, q_lo, b_k, EXACT: tl.constexpr, Q_SPLIT: tl.constexpr):
    """`[BM, W] x [BN, W]^T -> [BM, BN]` fp32: fp32 IEEE when EXACT, else fp16 operands with fp32 accumulation
    (plus the low part of the query when Q_SPLIT)."""
    if EXACT:
        return tl.dot(q_hi, tl.trans(b_k), input_precision="ieee")
    d = tl.dot(q_hi, tl.trans(b_k))
    if Q_SPLIT:
        d += tl.dot(q_lo, tl.trans(b_k))
    return d


@triton.jit
def _row_scale(p_q, o_m, m_m, D: tl.constexpr, DP: tl.constexpr, EXACT: tl.constexpr):
    """Per-row power of two `f = 2**e` (`[BM]`) that keeps `|q| / f` below 2**14, so fp16 query operands neither
    overflow nor lose bf16 bits; returns `(f, 1 / f)` (ones when EXACT)."""
    o_k = tl.arange(0, DP)
    q = tl.load(p_q + o_m[:, None] * D + o_k[None, :], mask=m_m[:, None] & (o_k[None, :] < D), other=0.0)
    amax = tl.max(tl.abs(q.to(tl.float32)), axis=1)
    if EXACT:
        e = tl.zeros_like(amax)
    else:
        e = tl.maximum(tl.ceil(tl.log2(tl.maximum(amax, 1.0) / 16384.0)), 0.0)
    return tl.exp2(e), tl.exp2(-e)


@triton.jit
def _path_scores(p_q, o_m, m_m, inv_f, p0, p1, p2, stride_t, stride_mt, o_t, m_t, D: tl.constexpr,
                 G: tl.constexpr, GROUP: tl.constexpr, GROUPP: tl.constexpr, BITS: tl.constexpr,
                 EXACT: tl.constexpr, Q_SPLIT: tl.constexpr, ASM: tl.constexpr):
    """Unscaled scores `q . k` of one path for tokens `o_t`: `[BM, BN]` fp32, one group at a time (a packed group's
    integer dot times its per-token scale; a 16-bit path in columns of GROUP)."""
    acc = tl.zeros((o_m.shape[0], o_t.shape[0]), tl.float32)
    for g in tl.static_range(G):
        q_hi, q_lo = _query_cols(p_q, o_m, m_m, g * GROUP, GROUP, GROUPP, D, inv_f, EXACT)
        if BITS == 16:
            b_k = _dense_cols(p0, stride_t, o_t, m_t, g * GROUP, GROUP, GROUPP, D, EXACT)
            acc += _qk(q_hi, q_lo, b_k, EXACT, Q_SPLIT)
        else:
            b_k, b_s = _packed_group(p0, p1, p2, stride_t, stride_mt, o_t, m_t, g, GROUP, GROUPP, BITS, EXACT, ASM)
            acc += _qk(q_hi, q_lo, b_k, EXACT, Q_SPLIT) * b_s[None, :]
    return acc


@triton.jit
def _online_update(b_s, m_valid, m_i, l_i, acc, b_v, EXACT: tl.constexpr):
    """One online-softmax step with base-2 scores `b_s: [BM, BN]`, values `b_v: [BN, D_CP]` (fp16, fp32 when
    EXACT), accumulator `acc: [BM, D_CP]` fp32."""
    b_s = tl.where(m_valid, b_s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(b_s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    b_p = tl.exp2(b_s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(b_p, axis=1)
    if EXACT:
        acc = acc * alpha[:, None] + tl.dot(b_p, b_v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(b_p.to(tl.float16), b_v)
    return m_new, l_i, acc


@triton.jit
def _dense_step(q_ptr_b, qr_ptr_b, o_m, m_m, inv_fc, inv_fr, fc, fr, p_c, s_ct, p_r, s_rt, o_slot, o_pos, m_t,
                lim_m, m_i, l_i, acc, D_C: tl.constexpr, D_CP: tl.constexpr, GC: tl.constexpr, GROUP_C: tl.constexpr,
                GROUP_CP: tl.constexpr, D_R: tl.constexpr, GR: tl.constexpr, GROUP_R: tl.constexpr,
                GROUP_RP: tl.constexpr, EXACT: tl.constexpr, Q_SPLIT: tl.constexpr):
    """Softmax step over model-dtype copies (sink or recent slots `o_slot`, positions `o_pos`), causal per row."""
    s_c = _path_scores(q_ptr_b, o_m, m_m, inv_fc, p_c, p_c, p_c, s_ct, s_ct, o_slot, m_t, D_C, GC, GROUP_C,
                       GROUP_CP, 16, EXACT, Q_SPLIT, False)
    s_r = _path_scores(qr_ptr_b, o_m, m_m, inv_fr, p_r, p_r, p_r, s_rt, s_rt, o_slot, m_t, D_R, GR, GROUP_R,
                       GROUP_RP, 16, EXACT, Q_SPLIT, False)
    b_v = _dense_cols(p_c, s_ct, o_slot, m_t, 0, D_C, D_CP, D_C, EXACT)
    m_valid = m_m[:, None] & m_t[None, :] & (o_pos[None, :] < lim_m[:, None])
    return _online_update(s_c * fc[:, None] + s_r * fr[:, None], m_valid, m_i, l_i, acc, b_v, EXACT)


# Lengths and counts change every decode step: specialising on them (== 1, % 16) would recompile mid-generation.
@triton.jit(do_not_specialize=["length", "M", "Tq", "split_target", "num_splits"])
def mla_decode_fwd_kernel(
    q_ptr, qr_ptr,
    c0_ptr, c1_ptr, c2_ptr, r0_ptr, r1_ptr, r2_ptr,
    sc_ptr, sr_ptr, rc_ptr, rr_ptr, lp_ptr, len_ptr,
    o_ptr, lse_ptr,
    length, M, Tq, split_target, num_splits, qk_scale,
    s_qb, s_qrb, s_c0b, s_c0t, s_c1b, s_c1t, s_r0b, s_r0t, s_r1b, s_r1t,
    s_scb, s_sct, s_srb, s_srt, s_rcb, s_rct, s_rrb, s_rrt,
    D_C: tl.constexpr, D_CP: tl.constexpr, GC: tl.constexpr, GROUP_C: tl.constexpr, GROUP_CP: tl.constexpr,
    C_BITS: tl.constexpr,
    D_R: tl.constexpr, D_RP: tl.constexpr, GR: tl.constexpr, GROUP_R: tl.constexpr, GROUP_RP: tl.constexpr,
    R_BITS: tl.constexpr,
    S: tl.constexpr, R: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EXACT: tl.constexpr, Q_SPLIT: tl.constexpr,
    C_ASM: tl.constexpr, R_ASM: tl.constexpr, LEN_FROM_PTR: tl.constexpr,
):
    if LEN_FROM_PTR:
        # Static caches: the length lives on the device (int64 [1]); the grid follows the capacity, and a split
        # whose share lies past the length writes an empty partial (lse = -inf) that the combine skips.
        length = tl.load(len_ptr)
    i_hb = tl.program_id(0).to(tl.int64)
    i_b = tl.program_id(1).to(tl.int64)
    i_s = tl.program_id(2).to(tl.int64)

    o_m = (i_hb * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int32)
    m_m = o_m < M
    # Causal limit of each query row: query t of Tq sees positions < length - Tq + t + 1.
    lim_m = length - Tq + (o_m % Tq) + 1
    lp = tl.load(lp_ptr + i_b)
    q_b = q_ptr + i_b * s_qb
    qr_b = qr_ptr + i_b * s_qrb
    fc, inv_fc = _row_scale(q_b, o_m, m_m, D_C, D_CP, EXACT)
    fr, inv_fr = _row_scale(qr_b, o_m, m_m, D_R, D_RP, EXACT)
    fc = fc * qk_scale  # scores in base 2, pre-multiplied by scaling * log2(e)
    fr = fr * qk_scale

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D_CP), tl.float32)
    is_dense = i_s == num_splits

    # Packed positions: this split's share of [S, length - R), intersected with [lp + S, ...); all of them lie
    # before every causal limit because Tq <= R.
    # Split size from the length (host or device), never from the capacity (`split_plan`): a growing cache and a
    # static one cut the same positions into the same splits.
    hi = length - R
    packed_len = tl.maximum(hi - S, 0)
    tokens_per_split = (packed_len + split_target - 1) // split_target
    tokens_per_split = tl.maximum((tokens_per_split + BLOCK_N - 1) // BLOCK_N * BLOCK_N, 4 * BLOCK_N)
    lo_s = S + i_s * tokens_per_split
    hi_s = tl.where(is_dense, lo_s, tl.minimum(lo_s + tokens_per_split, hi))
    lo_valid = lp + S
    p_c0 = c0_ptr + i_b * s_c0b
    p_c1 = c1_ptr + i_b * s_c1b
    p_c2 = c2_ptr + i_b * s_c1b
    p_r0 = r0_ptr + i_b * s_r0b
    p_r1 = r1_ptr + i_b * s_r1b
    p_r2 = r2_ptr + i_b * s_r1b
    for start in range(lo_s, hi_s, BLOCK_N):
        o_t = start + tl.arange(0, BLOCK_N).to(tl.int64)
        m_t = (o_t < hi_s) & (o_t >= lo_valid)
        s_c = _path_scores(q_b, o_m, m_m, inv_fc, p_c0, p_c1, p_c2, s_c0t, s_c1t, o_t, m_t, D_C, GC, GROUP_C,
                           GROUP_CP, C_BITS, EXACT, Q_SPLIT, C_ASM)
        s_r = _path_scores(qr_b, o_m, m_m, inv_fr, p_r0, p_r1, p_r2, s_r0t, s_r1t, o_t, m_t, D_R, GR, GROUP_R,
                           GROUP_RP, R_BITS, EXACT, Q_SPLIT, R_ASM)
        if C_BITS == 16:
            b_v = _dense_cols(p_c0, s_c0t, o_t, m_t, 0, D_C, D_CP, D_C, EXACT)
        else:
            # 8-bit values take the plain path: the earlier scaled 8-bit assembly (one zero/scale pair for four
            # packed elements) gave wrong values on the H200; the per-element version is not yet checked there.
            b_v = _packed_values(p_c0, p_c1, p_c2, s_c0t, s_c1t, o_t, m_t, D_C, D_CP, GROUP_C, C_BITS, EXACT,
                                 C_ASM and C_BITS != 8)
        m_valid = m_m[:, None] & m_t[None, :]
        m_i, l_i, acc = _online_update(s_c * fc[:, None] + s_r * fr[:, None], m_valid, m_i, l_i, acc, b_v, EXACT)

    # The last split takes the model-dtype copies: the sink (slot j = position lp + j) ...
    n_sink = tl.where(is_dense, S, 0)
    for start in range(0, n_sink, BLOCK_N):
        o_j = start + tl.arange(0, BLOCK_N).to(tl.int64)
        o_t = lp + o_j
        m_t = (o_j < S) & (o_t < length)
        m_i, l_i, acc = _dense_step(q_b, qr_b, o_m, m_m, inv_fc, inv_fr, fc, fr, sc_ptr + i_b * s_scb, s_sct,
                                    sr_ptr + i_b * s_srb, s_srt, o_j, o_t, m_t, lim_m, m_i, l_i, acc, D_C, D_CP, GC,
                                    GROUP_C, GROUP_CP, D_R, GR, GROUP_R, GROUP_RP, EXACT, Q_SPLIT)
    # ... and the recent ring (positions [length - R, length) past the sink, slot p % R).
    r_lo = tl.maximum(hi, 0)
    r_hi = tl.where(is_dense, length, r_lo)
    for start in range(r_lo, r_hi, BLOCK_N):
        o_t = start + tl.arange(0, BLOCK_N).to(tl.int64)
        m_t = (o_t < r_hi) & (o_t >= lo_valid)
        m_i, l_i, acc = _dense_step(q_b, qr_b, o_m, m_m, inv_fc, inv_fr, fc, fr, rc_ptr + i_b * s_rcb, s_rct,
                                    rr_ptr + i_b * s_rrb, s_rrt, o_t % R, o_t, m_t, lim_m, m_i, l_i, acc, D_C, D_CP,
                                    GC, GROUP_C, GROUP_CP, D_R, GR, GROUP_R, GROUP_RP, EXACT, Q_SPLIT)

    # Partial results: o normalised by this split's sum, lse in natural log (-inf for an empty split).
    has = l_i > 0
    inv_l = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
    b_lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    o_row = (i_b * M + o_m) * (num_splits + 1) + i_s  # [BM] index of (b, m, split)
    o_d = tl.arange(0, D_CP)
    tl.store(o_ptr + o_row[:, None] * D_C + o_d[None, :], acc * inv_l[:, None],
             mask=m_m[:, None] & (o_d[None, :] < D_C))
    tl.store(lse_ptr + o_row, b_lse, mask=m_m)


def _planes(planes: dict[str, torch.Tensor], bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if bits == 16:
        v = planes["values"]
        return v, v, v
    return planes["codes"], planes["scale"], planes["zero"]


def _tiling(fmt_path) -> tuple[int, int, int, int]:
    """(groups, padded groups, group width, padded group width) of a path as the kernel tiles it. A 16-bit path is
    cut into nominal groups of 64 with unit scales when 64 divides it, else one group of its whole width. Padded
    sizes are powers of two, widths at least 16 (the dot minimum)."""
    if fmt_path.quantized:
        g, w = fmt_path.n_groups, fmt_path.group
    elif fmt_path.dim % 64 == 0:
        g, w = fmt_path.dim // 64, 64
    else:
        g, w = 1, fmt_path.dim
    return g, triton.next_power_of_2(g), w, max(16, triton.next_power_of_2(w))


def _use_asm(fmt_path, device: torch.device, exact: bool = False) -> bool:
    """Inline-assembly dequantization: on CUDA (not the interpreter, which has no inline assembly), for groups of
    at least 16 elements, and not for fp32 copies (`exact`): the assembly makes fp16 operands, which the fp32 IEEE
    dots of an fp32 model refuse (the kernel did not compile for sm_90)."""
    return (not exact and device.type == "cuda" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0") and fmt_path.quantized
            and fmt_path.group >= 16 and (fmt_path.group * fmt_path.bits) % 32 == 0)


def split_plan(batch: int, head_blocks: int, n_capacity: int, num_sms: int, block_n: int,
               num_splits: int | None = None) -> tuple[int, int]:
    """Splits of the packed positions as `(split_target, grid_splits)`.

    `split_target` (or `num_splits` when given) is about 8 programs per multiprocessor (short programs keep the last
    wave's tail small; 8 beat 2 and 16 on the H200, docs/BENCHMARKS.md) and depends on static sizes only, not on the
    length or the capacity. The kernel cuts the `n = length - S - R` packed positions the length holds into
    `tokens_per_split = max(4 * block_n, round_up(cdiv(n, split_target), block_n))` each (at least 4 blocks, so
    the partial outputs stay small against the cache bytes read): the same boundaries whether the length is a host
    int (growing cache) or a device tensor (static cache of any capacity). At most `min(split_target,
    cdiv(n, 4 * block_n))` splits hold positions, so `grid_splits`, that bound at `n_capacity` (the packed positions
    the planes can hold), is enough."""
    target = max(1, int(num_splits or -(-8 * num_sms // max(1, batch * head_blocks))))
    return target, max(1, min(target, -(-max(0, n_capacity) // (4 * block_n))))


def mla_decode_fwd(
    q_lat, q_rot, content, rope, fmt: CacheFormat, sink_c, sink_r, recent_c, recent_r, left_padding, length,
    scaling, num_splits=None, block_m=None, block_n=None, num_warps=None, num_stages=None, maxnreg=None,
    capacity=None, out=None,
):
    """Host wrapper: flatten (head, query) rows, pick blocks and splits, launch both kernels.

    `length` is an int, or an int64 tensor `[1]` on the device (then `capacity`, the static number of positions
    the planes hold, sets the splits and the grid, and the kernel reads the length itself)."""
    B, H, Tq, D_C = q_lat.shape
    D_R = q_rot.shape[-1]
    M = H * Tq
    # fp32 queries keep ~22-bit products through a high/low fp16 split (two dots); bf16/fp16 queries are exact in
    # one fp16 operand (after the kernel's per-row power-of-two scaling).
    q_split = q_lat.dtype == torch.float32 or q_rot.dtype == torch.float32
    q = q_lat.reshape(B, M, D_C).contiguous()
    qr = q_rot.reshape(B, M, D_R).contiguous()
    S, R = fmt.sink_tokens, fmt.recent_tokens
    GC, GCP, GROUP_C, GROUP_CP = _tiling(fmt.content)
    GR, GRP, GROUP_R, GROUP_RP = _tiling(fmt.rope)
    if D_C >= 256:
        # Launches measured fastest on the H200 (docs/BENCHMARKS.md, "launch sweep"): 16 rows with 32-token tiles
        # and 4 warps (two programs per multiprocessor); more rows (128 heads, several query tokens) in blocks of
        # 32 with 64-token tiles and 8 warps. Two pipeline stages.
        BLOCK_M = block_m or (16 if M <= 16 else 32)
        BLOCK_N = block_n or (32 if BLOCK_M <= 16 else 64)
        num_warps = num_warps or (4 if BLOCK_M <= 16 else 8)
        num_stages = num_stages or 2
    else:
        BLOCK_M = block_m or 16
        BLOCK_N = block_n or 16
    head_blocks = triton.cdiv(M, BLOCK_M)
    n_capacity = max(0, (capacity if isinstance(length, torch.Tensor) else length) - R - S)
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 8
    target, num_splits = split_plan(B, head_blocks, n_capacity, sms, BLOCK_N, num_splits)
    NSP = num_splits + 1
    o_part = torch.empty((B, M, NSP, D_C), dtype=torch.float32, device=q.device)
    lse_part = torch.empty((B, M, NSP), dtype=torch.float32, device=q.device)
    c0, c1, c2 = _planes(content, fmt.content.bits)
    r0, r1, r2 = _planes(rope, fmt.rope.bits)
    lp = left_padding.to(device=q.device, dtype=torch.int64).contiguous()
    extra = {k: v for k, v in (("num_warps", num_warps), ("num_stages", num_stages), ("maxnreg", maxnreg)) if v is not None}
    len_from_ptr = isinstance(length, torch.Tensor)
    exact = sink_c.dtype == torch.float32  # fp32 copies: fp32 IEEE dots (plain integer dequantization)
    mla_decode_fwd_kernel[(head_blocks, B, NSP)](
        q, qr, c0, c1, c2, r0, r1, r2, sink_c, sink_r, recent_c, recent_r, lp, length if len_from_ptr else lp,
        o_part, lse_part, 0 if len_from_ptr else length, M, Tq, target, num_splits, scaling * LOG2E,
        q.stride(0), qr.stride(0), c0.stride(0), c0.stride(1), c1.stride(0), c1.stride(1),
        r0.stride(0), r0.stride(1), r1.stride(0), r1.stride(1),
        sink_c.stride(0), sink_c.stride(1), sink_r.stride(0), sink_r.stride(1),
        recent_c.stride(0), recent_c.stride(1), recent_r.stride(0), recent_r.stride(1),
        D_C=D_C, D_CP=triton.next_power_of_2(D_C), GC=GC, GROUP_C=GROUP_C, GROUP_CP=GROUP_CP,
        C_BITS=fmt.content.bits,
        D_R=D_R, D_RP=triton.next_power_of_2(D_R), GR=GR, GROUP_R=GROUP_R, GROUP_RP=GROUP_RP, R_BITS=fmt.rope.bits,
        S=S, R=R, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, EXACT=exact, Q_SPLIT=q_split,
        C_ASM=_use_asm(fmt.content, q.device, exact), R_ASM=_use_asm(fmt.rope, q.device, exact),
        LEN_FROM_PTR=len_from_ptr,
        **extra,
    )
    o, lse = combine_partials(o_part, lse_part, out)
    return o.view(B, H, Tq, D_C), lse.view(B, H, Tq)


def combine_partials(o_part: torch.Tensor, lse_part: torch.Tensor, out: tuple | None = None):
    """Merge split partials by log-sum-exp: `o_part: [B, M, NSP, d_c]` (each normalised by its own sum) and
    `lse_part: [B, M, NSP]` (natural log, `-inf` for an empty split) -> `o: [B, M, d_c]`, `lse: [B, M]` fp32
    (zeros and `-inf` where every split is empty). `out` optionally gives the two output tensors."""
    B, M, NSP, D_C = o_part.shape
    if out is None:
        o = torch.empty((B, M, D_C), dtype=torch.float32, device=o_part.device)
        lse = torch.empty((B, M), dtype=torch.float32, device=o_part.device)
    else:
        o, lse = out[0].view(B, M, D_C), out[1].view(B, M)
    from .mla_decode_fast import COMBINE_BLOCK_D, COMBINE_CHUNK, mla_decode_fast_combine_kernel

    BLOCK_D = min(triton.next_power_of_2(D_C), COMBINE_BLOCK_D)
    # The fast module's combine: fixed-size chunks over the splits, empty ones skipped, so the sum (and its bits)
    # does not depend on the grid (a host-length launch and a capacity-sized one agree exactly).
    mla_decode_fast_combine_kernel[(B * M, triton.cdiv(D_C, BLOCK_D))](
        o_part, lse_part, o, lse, NSP, D_C=D_C, BLOCK_S=COMBINE_CHUNK, BLOCK_D=BLOCK_D,
    )
    return o, lse


def mla_decode(
    q_lat: torch.Tensor,
    q_rot: torch.Tensor,
    content: dict[str, torch.Tensor],
    rope: dict[str, torch.Tensor],
    fmt: CacheFormat,
    sink_content: torch.Tensor,
    sink_rope: torch.Tensor,
    recent_content: torch.Tensor,
    recent_rope: torch.Tensor,
    left_padding: torch.Tensor,
    length: int,
    scaling: float,
    num_splits: int | None = None,
    **launch,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed attention of `Tq` query tokens over the `length` positions of a packed QuantMLA cache layer.

    Args:
        q_lat: `[B, H, Tq, d_c]` queries with W_UK absorbed (`q_nope @ W_UK`).
        q_rot: `[B, H, Tq, d_R]` post-RoPE queries, already rotated like the stored keys (Hadamard baseline).
        content, rope: plane dicts of the two paths (`codes/scale/zero` or `values`), `[B, capacity >= length, .]`.
        fmt: the cache format (bits, groups, `sink_tokens` S, `recent_tokens` R).
        sink_content, sink_rope: `[B, S, d]` model-dtype copies of the first S real tokens of each row.
        recent_content, recent_rope: `[B, R, d]` model-dtype ring of the last R positions (slot `p % R`).
        left_padding: `[B]` padding positions before each row's first real token.
        length: positions cached (the query tokens are the last `Tq` of them).
        scaling: softmax scale.
        num_splits: packed-position splits per (row, head block); `None` picks from batch, heads and length.

    Returns:
        `o_lat: [B, H, Tq, d_c]` fp32 and `lse: [B, H, Tq]` fp32 (natural log; `-inf` and zeros for a row with no
        visible position).
    """
    if q_lat.dim() != 4 or q_rot.dim() != 4 or q_lat.shape[:3] != q_rot.shape[:3]:
        raise ValueError(f"q_lat and q_rot must be [B, H, Tq, d], got {tuple(q_lat.shape)} and {tuple(q_rot.shape)}")
    B, H, Tq, d_c = q_lat.shape
    if d_c != fmt.content.dim or q_rot.shape[-1] != fmt.rope.dim:
        raise ValueError(
            f"query widths ({d_c}, {q_rot.shape[-1]}) do not match the cache format ({fmt.content.dim}, {fmt.rope.dim})"
        )
    if Tq > fmt.recent_tokens:
        raise ValueError(
            f"{Tq} query tokens need a recent window of at least {Tq} tokens (recent_tokens={fmt.recent_tokens}); "
            "longer chunks go through the prefill path"
        )
    if length < Tq:
        raise ValueError(f"the cache holds {length} positions but {Tq} query tokens were given (append them first)")
    for name, planes in (("content", content), ("rope", rope)):
        for key, plane in planes.items():
            if plane.shape[0] != B or plane.shape[1] < length or plane.stride(-1) != 1:
                raise ValueError(
                    f"{name} plane {key!r} must be [B={B}, capacity >= {length}, .] with a contiguous last dimension, "
                    f"got shape {tuple(plane.shape)} strides {plane.stride()}"
                )
    for name, t in (("sink_content", sink_content), ("sink_rope", sink_rope), ("recent_content", recent_content),
                    ("recent_rope", recent_rope)):
        if t.shape[0] != B or t.stride(-1) != 1:
            raise ValueError(f"{name} must be [B={B}, ., d] with a contiguous last dimension, got {tuple(t.shape)}")
    return mla_decode_fwd(
        q_lat, q_rot, content, rope, fmt, sink_content, sink_rope, recent_content, recent_rope, left_padding, length,
        scaling, num_splits=num_splits, **launch,
    )


def mla_decode_static(
    q_lat, q_rot, content_planes: dict, rope_planes: dict, fmt: CacheFormat, sink_c, sink_r, recent_c, recent_r,
    left_padding, length, capacity: int, scaling: float, out: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`mla_decode` with the length on the device, for captured graphs (interface of docs/KERNELS.md, "Static
    launch"): `length` an int64 tensor `[1]` (positions cached, the `Tq` queries being the last of them),
    `left_padding` `[B]` int64, both read in the kernel; splits and grid follow `(B, H, capacity)` only, so one
    launch serves every step of a generation. No host synchronisation and no check that reads device values.
    `out` optionally gives preallocated `(o_lat [B, H, Tq, d_c], lse [B, H, Tq])` fp32.

    Returns `o_lat: [B, H, Tq, d_c]` fp32 and `lse: [B, H, Tq]` fp32.
    """
    B, H, Tq, d_c = q_lat.shape
    if d_c != fmt.content.dim or q_rot.shape[-1] != fmt.rope.dim or q_rot.shape[:3] != q_lat.shape[:3]:
        raise ValueError(
            f"queries {tuple(q_lat.shape)}, {tuple(q_rot.shape)} do not match the cache format "
            f"(d_c={fmt.content.dim}, d_R={fmt.rope.dim})"
        )
    if Tq > fmt.recent_tokens:
        raise ValueError(f"{Tq} query tokens need recent_tokens >= {Tq} (got {fmt.recent_tokens})")
    return mla_decode_fwd(
        q_lat, q_rot, content_planes, rope_planes, fmt, sink_c, sink_r, recent_c, recent_r, left_padding, length,
        scaling, capacity=capacity, out=out,
    )
