"""Fast split-K MLA decode on the packed QuantMLA cache (issue #11), behind the static launch interface.

Same function as `mla_decode.py` (reference: `mla_decode_ref.py`; notes: docs/KERNELS.md "Fast kernel"):

    rows m = (head h, query token t) of `q_lat: [B, H, Tq, d_c]`, `q_rot: [B, H, Tq, d_R]`, flattened to `M = H * Tq`
    score[m, j] = (q_lat[m] . c[j] + q_rot[m] . k_R[j]) * scaling          for every valid cached position j
    o_lat[m] = softmax_j(score[m]) @ c,  lse[m] = logsumexp_j score[m]

What differs from the fallback kernel:

* Groups are a batch dimension. A token tile of the content path is read once as bytes `[BT, G, NB]` and unpacked
  once into exact fp16 integers `code - z` as `[BT, G, group]` (fp16 "magic number" 1024: `code | 0x6400` is the
  fp16 `1024 + code`, so no int-to-float conversion). The scores of all groups are ONE batched dot
  `[G, BM, group] x [G, group, BT] -> [G, BM, BT]`, each group's partial times its per-token scale `s[j, g]`, summed
  over G: exact integer keys, the scale applied after the dot (what keeps the LSE within 1e-4 at 8 bits).
  The values are the same tile times its scales (`fp16((code - z) * s)`, one rounding) in a second batched dot
  `[G, BM, BT] x [G, BT, group] -> [G, BM, group]` with the probabilities broadcast over the groups.
* The queries are loaded once per program (before the token loop) as `[G, BM, group]`, not once per tile.
* The bytes of the next token tile are loaded before the current tile is computed (`PREFETCH`): one tile of
  every plane is always in flight per program.
* Splits depend only on (B, head blocks, capacity); `length` and `left_padding` are read in-kernel, so the launch
  never synchronises with the host and can be captured in a CUDA graph. A split whose range lies past `length`
  writes an empty partial (`lse = -inf`, `o = 0`) that the combine ignores.

Handled here (`fast_supported`): both paths quantized (2, 4 or 8 bits), power-of-two widths, group counts and group
sizes of at least 16, model-dtype copies in bf16/fp16 (not fp32), queries in bf16, fp16 or fp32, on CUDA with
compute capability >= 8. Everything else takes `mla_decode.py`.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from quantmla_hf.format import CacheFormat

LOG2E = 1.4426950408889634


@triton.jit
def _magic_codes(b_byte, BITS: tl.constexpr):
    """`[BT, G, NB]` uint8 code bytes -> `[BT, G, NB * 8 // BITS]` fp16 `1024 + code` in element order (exact).

    4 bits: byte i holds element 2i (bits 0-3) and 2i+1 (bits 4-7); 2 bits: elements 4i..4i+3 at bits 0-1, 2-3,
    4-5, 6-7; 8 bits: one element per byte (quantmla_hf/format.py)."""
    BT: tl.constexpr = b_byte.shape[0]
    G: tl.constexpr = b_byte.shape[1]
    NB: tl.constexpr = b_byte.shape[2]
    x = b_byte.to(tl.int16)
    if BITS == 4:
        x = tl.reshape(tl.join(x & 15, x >> 4), (BT, G, NB * 2))
    elif BITS == 2:
        # join stacks on a new last axis: join(join(e0, e2), join(e1, e3))[..., k, j] = e(2k + j): flattened e0 e1 e2 e3
        x = tl.reshape(tl.join(tl.join(x & 3, (x >> 4) & 3), tl.join((x >> 2) & 3, x >> 6)), (BT, G, NB * 4))
    return (x | 0x6400).to(tl.float16, bitcast=True)


@triton.jit
def _load_packed(p_codes, p_scale, p_zero, s_t, s_mt, o_t, m_t, G: tl.constexpr, NB: tl.constexpr):
    """Raw planes of tokens `o_t: [BT]` (row-offset pointers): codes `[BT, G, NB]` uint8, scale `[BT, G]` fp16,
    zero `[BT, G]` int8 (zeros where `m_t` is false)."""
    o_g = tl.arange(0, G)
    o_k = tl.arange(0, NB)
    p = p_codes + (o_t * s_t)[:, None, None] + (o_g * NB)[None, :, None] + o_k[None, None, :]
    b_code = tl.load(p, mask=m_t[:, None, None], other=0)
    o_meta = (o_t * s_mt)[:, None] + o_g[None, :]
    b_scale = tl.load(p_scale + o_meta, mask=m_t[:, None], other=0.0)
    b_zero = tl.load(p_zero + o_meta, mask=m_t[:, None], other=0)
    return b_code, b_scale, b_zero


@triton.jit
def _int_keys(b_code, b_zero, BITS: tl.constexpr):
    """Exact fp16 integers `code - z`: `[BT, G, group]` (z = stored zero + 2**(BITS-1), |code - z| < 2048)."""
    HALF: tl.constexpr = 1 << (BITS - 1)
    z = (b_zero.to(tl.int32) + (1024 + HALF)).to(tl.float16)  # 1024 + z, exact
    return _magic_codes(b_code, BITS) - z[:, :, None]


@triton.jit
def _load_dense(p_vals, s_t, o_t, m_t, G: tl.constexpr, GROUP: tl.constexpr):
    """Model-dtype rows `o_t` as fp16 `[BT, G, GROUP]` (exact for magnitudes in [6e-5, 65504]); zeros if masked."""
    o_g = tl.arange(0, G)
    o_k = tl.arange(0, GROUP)
    p = p_vals + (o_t * s_t)[:, None, None] + (o_g * GROUP)[None, :, None] + o_k[None, None, :]
    return tl.load(p, mask=m_t[:, None, None], other=0.0).to(tl.float16)


@triton.jit
def _group_scores(q_hi, q_lo, b_k, b_s, Q_SPLIT: tl.constexpr):
    """`sum_g s[:, g] * (q_g . k_g)`: queries `[G, BM, GROUP]` fp16 (high, low parts), keys `[BT, G, GROUP]` fp16,
    scales `[BT, G]` fp32 -> `[BM, BT]` fp32."""
    k_t = tl.permute(b_k, (1, 2, 0))  # [G, GROUP, BT]
    d = tl.dot(q_hi, k_t)
    if Q_SPLIT:
        d += tl.dot(q_lo, k_t)
    return tl.sum(d * tl.trans(b_s)[:, None, :], axis=0)


@triton.jit
def _load_queries(p_q, o_m, m_m, D: tl.constexpr, G: tl.constexpr, GROUP: tl.constexpr):
    """Rows `o_m` of one path as `(hi, lo, f)`: `[G, BM, GROUP]` fp16 high and low parts of `q / f`, with `f: [BM]`
    a per-row power of two that keeps `|q| / f` below 2**14 (fp16 operands never overflow; bf16/fp16 queries are
    exact in the high part)."""
    o_g = tl.arange(0, G)
    o_k = tl.arange(0, GROUP)
    p = p_q + o_m[None, :, None] * D + (o_g * GROUP)[:, None, None] + o_k[None, None, :]
    q = tl.load(p, mask=m_m[None, :, None], other=0.0).to(tl.float32)
    amax = tl.max(tl.max(tl.abs(q), axis=2), axis=0)
    e = tl.maximum(tl.ceil(tl.log2(tl.maximum(amax, 1.0) / 16384.0)), 0.0)
    q = q * tl.exp2(-e)[None, :, None]
    q_hi = q.to(tl.float16)
    return q_hi, (q - q_hi.to(tl.float32)).to(tl.float16), tl.exp2(e)


@triton.jit
def _softmax_step(b_s, m_valid, m_i, l_i, acc, b_v):
    """Online softmax in base 2: scores `[BM, BT]`, values `[BT, G, GROUP]` fp16, `acc: [G, BM, GROUP]` fp32."""
    b_s = tl.where(m_valid, b_s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(b_s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    b_p = tl.exp2(b_s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(b_p, axis=1)
    G: tl.constexpr = acc.shape[0]
    p3 = tl.broadcast_to(b_p.to(tl.float16)[None, :, :], (G, b_p.shape[0], b_p.shape[1]))
    acc = acc * alpha[None, :, None] + tl.dot(p3, tl.permute(b_v, (1, 0, 2)))
    return m_new, l_i, acc


# Lengths and counts change every decode step: no specialisation on them (the length is read from memory anyway).
@triton.jit(do_not_specialize=["M", "Tq", "tokens_per_split", "num_splits"])
def mla_decode_fast_kernel(
    q_ptr, qr_ptr,
    cc_ptr, cs_ptr, cz_ptr, rc_ptr, rs_ptr, rz_ptr,
    snc_ptr, snr_ptr, rcc_ptr, rcr_ptr, lp_ptr, len_ptr,
    o_ptr, lse_ptr,
    M, Tq, tokens_per_split, num_splits, qk_scale,
    s_qb, s_qrb, s_ccb, s_cct, s_csb, s_cst, s_rcb, s_rct, s_rsb, s_rst,
    s_sncb, s_snct, s_snrb, s_snrt, s_rccb, s_rcct, s_rcrb, s_rcrt,
    D_C: tl.constexpr, GC: tl.constexpr, GROUP_C: tl.constexpr, C_BITS: tl.constexpr,
    D_R: tl.constexpr, GR: tl.constexpr, GROUP_R: tl.constexpr, R_BITS: tl.constexpr,
    S: tl.constexpr, R: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr, Q_SPLIT: tl.constexpr, PREFETCH: tl.constexpr,
):
    """One program per (split, head block, batch row): splits `0 .. num_splits-1` take `tokens_per_split` packed
    positions each from `S`; split `num_splits` takes the sink and recent copies. Writes the normalised partial
    `o: [B, M, num_splits + 1, D_C]` and `lse: [B, M, num_splits + 1]` (natural log, -inf when empty)."""
    i_s = tl.program_id(0).to(tl.int64)
    i_hb = tl.program_id(1).to(tl.int64)
    i_b = tl.program_id(2).to(tl.int64)
    NBC: tl.constexpr = GROUP_C * C_BITS // 8
    NBR: tl.constexpr = GROUP_R * R_BITS // 8

    length = tl.load(len_ptr).to(tl.int64)
    lp = tl.load(lp_ptr + i_b).to(tl.int64)
    o_m = (i_hb * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int32)
    m_m = o_m < M
    lim_m = length - Tq + (o_m % Tq) + 1  # query t of Tq sees positions < length - Tq + t + 1

    qc_hi, qc_lo, fc = _load_queries(q_ptr + i_b * s_qb, o_m, m_m, D_C, GC, GROUP_C)
    qr_hi, qr_lo, fr = _load_queries(qr_ptr + i_b * s_qrb, o_m, m_m, D_R, GR, GROUP_R)
    fc = fc * qk_scale  # scores in base 2, pre-multiplied by scaling * log2(e)
    fr = fr * qk_scale

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((GC, BLOCK_M, GROUP_C), tl.float32)
    is_dense = i_s == num_splits

    # Packed positions: this split's share of [S, length - R), intersected with [lp + S, ...). Every one of them lies
    # before each causal limit because Tq <= R.
    lo_s = S + i_s * tokens_per_split
    hi_s = tl.where(is_dense, lo_s, tl.minimum(lo_s + tokens_per_split, length - R))
    lo_valid = lp + S
    p_cc = cc_ptr + i_b * s_ccb
    p_cs = cs_ptr + i_b * s_csb
    p_cz = cz_ptr + i_b * s_csb
    p_rc = rc_ptr + i_b * s_rcb
    p_rs = rs_ptr + i_b * s_rsb
    p_rz = rz_ptr + i_b * s_rsb
    n_tiles = tl.cdiv(tl.maximum(hi_s - lo_s, 0), BLOCK_T)
    o_bt = tl.arange(0, BLOCK_T).to(tl.int64)
    if PREFETCH:
        o_t = lo_s + o_bt
        m_t = (o_t < hi_s) & (o_t >= lo_valid)
        c_code, c_scale, c_zero = _load_packed(p_cc, p_cs, p_cz, s_cct, s_cst, o_t, m_t, GC, NBC)
        r_code, r_scale, r_zero = _load_packed(p_rc, p_rs, p_rz, s_rct, s_rst, o_t, m_t, GR, NBR)
    for i in range(0, n_tiles):
        o_t = lo_s + i * BLOCK_T + o_bt
        m_t = (o_t < hi_s) & (o_t >= lo_valid)
        if PREFETCH:
            # Next tile's bytes in flight while this one is computed.
            o_n = o_t + BLOCK_T
            m_n = (o_n < hi_s) & (o_n >= lo_valid)
            n_c_code, n_c_scale, n_c_zero = _load_packed(p_cc, p_cs, p_cz, s_cct, s_cst, o_n, m_n, GC, NBC)
            n_r_code, n_r_scale, n_r_zero = _load_packed(p_rc, p_rs, p_rz, s_rct, s_rst, o_n, m_n, GR, NBR)
        else:
            c_code, c_scale, c_zero = _load_packed(p_cc, p_cs, p_cz, s_cct, s_cst, o_t, m_t, GC, NBC)
            r_code, r_scale, r_zero = _load_packed(p_rc, p_rs, p_rz, s_rct, s_rst, o_t, m_t, GR, NBR)
        k_c = _int_keys(c_code, c_zero, C_BITS)
        k_r = _int_keys(r_code, r_zero, R_BITS)
        cs32 = c_scale.to(tl.float32)
        b_s = (_group_scores(qc_hi, qc_lo, k_c, cs32, Q_SPLIT) * fc[:, None]
               + _group_scores(qr_hi, qr_lo, k_r, r_scale.to(tl.float32), Q_SPLIT) * fr[:, None])
        b_v = k_c * c_scale[:, :, None]  # fp16 (code - z) * s, one rounding
        m_i, l_i, acc = _softmax_step(b_s, m_m[:, None] & m_t[None, :], m_i, l_i, acc, b_v)
        if PREFETCH:
            c_code, c_scale, c_zero = n_c_code, n_c_scale, n_c_zero
            r_code, r_scale, r_zero = n_r_code, n_r_scale, n_r_zero

    # The last split takes the model-dtype copies: the sink (slot j = position lp + j) and the recent ring
    # (positions [length - R, length) past the sink, slot p % R), causal per query row.
    ones_c = tl.full((BLOCK_T, GC), 1.0, tl.float32)
    ones_r = tl.full((BLOCK_T, GR), 1.0, tl.float32)
    n_sink = tl.where(is_dense, S, 0)
    for start in range(0, n_sink, BLOCK_T):
        o_j = start + o_bt
        o_t = lp + o_j
        m_t = (o_j < S) & (o_t < length)
        k_c = _load_dense(snc_ptr + i_b * s_sncb, s_snct, o_j, m_t, GC, GROUP_C)
        k_r = _load_dense(snr_ptr + i_b * s_snrb, s_snrt, o_j, m_t, GR, GROUP_R)
        b_s = (_group_scores(qc_hi, qc_lo, k_c, ones_c, Q_SPLIT) * fc[:, None]
               + _group_scores(qr_hi, qr_lo, k_r, ones_r, Q_SPLIT) * fr[:, None])
        m_valid = m_m[:, None] & m_t[None, :] & (o_t[None, :] < lim_m[:, None])
        m_i, l_i, acc = _softmax_step(b_s, m_valid, m_i, l_i, acc, k_c)
    r_lo = tl.maximum(length - R, 0)
    r_hi = tl.where(is_dense, length, r_lo)
    for start in range(r_lo, r_hi, BLOCK_T):
        o_t = start + o_bt
        m_t = (o_t < r_hi) & (o_t >= lo_valid)
        k_c = _load_dense(rcc_ptr + i_b * s_rccb, s_rcct, o_t % R, m_t, GC, GROUP_C)
        k_r = _load_dense(rcr_ptr + i_b * s_rcrb, s_rcrt, o_t % R, m_t, GR, GROUP_R)
        b_s = (_group_scores(qc_hi, qc_lo, k_c, ones_c, Q_SPLIT) * fc[:, None]
               + _group_scores(qr_hi, qr_lo, k_r, ones_r, Q_SPLIT) * fr[:, None])
        m_valid = m_m[:, None] & m_t[None, :] & (o_t[None, :] < lim_m[:, None])
        m_i, l_i, acc = _softmax_step(b_s, m_valid, m_i, l_i, acc, k_c)

    # Partial results: o normalised by this split's sum, lse in natural log (-inf for an empty split).
    has = l_i > 0
    inv_l = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
    b_lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    o_row = (i_b * M + o_m) * (num_splits + 1) + i_s  # [BM] index of (b, m, split)
    o_g = tl.arange(0, GC)
    o_k = tl.arange(0, GROUP_C)
    p_o = o_ptr + o_row[None, :, None] * D_C + (o_g * GROUP_C)[:, None, None] + o_k[None, None, :]
    tl.store(p_o, acc * inv_l[None, :, None], mask=m_m[None, :, None])
    tl.store(lse_ptr + o_row, b_lse, mask=m_m)


@triton.jit(do_not_specialize=["NSP"])
def mla_decode_fast_combine_kernel(o_part_ptr, lse_part_ptr, o_ptr, lse_ptr, NSP, D_C: tl.constexpr,
                                   BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Log-sum-exp merge of the splits of one (batch row, query row) and block of d_c columns; a row with no
    visible position gives zeros and lse -inf."""
    i_bm = tl.program_id(0).to(tl.int64)
    i_d = tl.program_id(1).to(tl.int64)
    o_s = tl.arange(0, BLOCK_S)
    m_s = o_s < NSP
    b_lse = tl.load(lse_part_ptr + i_bm * NSP + o_s, mask=m_s, other=float("-inf"))
    m = tl.max(b_lse, axis=0)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(b_lse - m_use)
    total = tl.sum(w, axis=0)
    o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D)
    m_d = o_d < D_C
    b_o = tl.load(o_part_ptr + (i_bm * NSP + o_s[:, None]) * D_C + o_d[None, :], mask=m_s[:, None] & m_d[None, :],
                  other=0.0)
    out = tl.sum(b_o * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(o_ptr + i_bm * D_C + o_d, out, mask=m_d)
    if i_d == 0:
        tl.store(lse_ptr + i_bm, tl.where(total > 0, m_use + tl.log(total), float("-inf")))


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def fast_supported(fmt: CacheFormat, q_dtype: torch.dtype, device, copy_dtype: torch.dtype | None = None) -> bool:
    """Whether `mla_decode_static` of this module handles this format, query dtype and device (else use the
    fallback `mla_decode.py`): both paths packed at 2, 4 or 8 bits, power-of-two widths and group counts, groups
    of at least 16 elements, queries in bf16/fp16/fp32, model-dtype copies (`copy_dtype`, when given) in
    bf16/fp16, and a CUDA device of compute capability >= 8 (the Triton interpreter also runs it, for tests)."""
    for p in (fmt.content, fmt.rope):
        if not p.quantized or p.bits not in (2, 4, 8):
            return False
        if not (_pow2(p.dim) and _pow2(p.group) and p.group >= 16 and _pow2(p.n_groups)):
            return False
    if q_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    if copy_dtype is not None and copy_dtype not in (torch.bfloat16, torch.float16):
        return False
    device = torch.device(device)
    if device.type == "cuda":
        return _interpreting() or torch.cuda.get_device_capability(device)[0] >= 8
    return device.type == "cpu" and _interpreting()


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_launch(B: int, M: int, capacity: int, fmt: CacheFormat, device) -> dict:
    """Launch chosen from static sizes only (B, rows, capacity): 16-row blocks (each token tile is unpacked once per
    16 rows) with 32-token tiles and 4 warps, or 64-row blocks and 8 warps for many rows (128 heads); splits so
    that about `waves` programs per multiprocessor exist, each with at least 2 tiles."""
    device = torch.device(device)
    many = M > 32
    launch = dict(block_m=64 if many else 16, block_t=32, num_warps=8 if many else 4, num_stages=1, prefetch=True,
                  waves=2)
    return launch


def num_splits_for(B: int, head_blocks: int, capacity: int, fmt: CacheFormat, sms: int, block_t: int,
                   waves: float) -> int:
    """Packed-position splits from static sizes: about `waves * sms` programs in all, each split at least 2 tiles."""
    n_packed = max(0, capacity - fmt.sink_tokens - fmt.recent_tokens)
    want = -(-int(waves * sms) // max(1, B * head_blocks))
    most = max(1, n_packed // (2 * block_t))
    return max(1, min(want, most))


def mla_decode_static(
    q_lat: torch.Tensor,
    q_rot: torch.Tensor,
    content_planes: dict[str, torch.Tensor],
    rope_planes: dict[str, torch.Tensor],
    fmt: CacheFormat,
    sink_c: torch.Tensor,
    sink_r: torch.Tensor,
    recent_c: torch.Tensor,
    recent_r: torch.Tensor,
    left_padding: torch.Tensor,
    length: torch.Tensor,
    capacity: int,
    scaling: float,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    **launch,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed attention of `Tq` query tokens over the first `length` positions of a packed cache layer, with no
    host synchronisation and a grid fixed by static sizes (the agreed interface, /work/notes/decode_interface.md).

    Args:
        q_lat: `[B, H, Tq, d_c]` queries with W_UK absorbed (bf16, fp16 or fp32).
        q_rot: `[B, H, Tq, d_R]` post-RoPE queries, rotated like the stored keys.
        content_planes, rope_planes: `codes/scale/zero` planes `[B, capacity, .]` of the two paths.
        fmt: the cache format (must pass `fast_supported`).
        sink_c, sink_r: `[B, S, d]` model-dtype copies of the first S real tokens of each row.
        recent_c, recent_r: `[B, R, d]` model-dtype ring of the last R positions (slot `p % R`).
        left_padding: `[B]` int64 on the device.
        length: int64 tensor of shape `[1]` on the device: positions cached (the Tq queries are the last Tq).
        capacity: static number of positions the planes hold; fixes the grid and the splits.
        scaling: softmax scale.
        out: optional preallocated `(o_lat [B, H, Tq, d_c] fp32, lse [B, H, Tq] fp32)`.
        launch: `block_m, block_t, num_warps, num_stages, prefetch, waves, num_splits` overrides (benchmarks).

    Returns:
        `o_lat: [B, H, Tq, d_c]` fp32 and `lse: [B, H, Tq]` fp32 (natural log; zeros and -inf for a row with no
        visible position).
    """
    if q_lat.dim() != 4 or q_rot.dim() != 4 or q_lat.shape[:3] != q_rot.shape[:3]:
        raise ValueError(f"q_lat and q_rot must be [B, H, Tq, d], got {tuple(q_lat.shape)} and {tuple(q_rot.shape)}")
    B, H, Tq, D_C = q_lat.shape
    D_R = q_rot.shape[-1]
    if D_C != fmt.content.dim or D_R != fmt.rope.dim:
        raise ValueError(f"query widths ({D_C}, {D_R}) do not match the cache format ({fmt.content.dim}, {fmt.rope.dim})")
    if not fast_supported(fmt, q_lat.dtype, q_lat.device, sink_c.dtype):
        raise ValueError(
            f"the fast decode kernel does not handle {fmt.name} (content {fmt.content}, rope {fmt.rope}) with "
            f"{q_lat.dtype} queries and {sink_c.dtype} copies on {q_lat.device}: check fast_supported() first and use "
            "kernels/mla_decode.py otherwise"
        )
    if Tq > fmt.recent_tokens:
        raise ValueError(f"{Tq} query tokens need a recent window of at least {Tq} tokens "
                         f"(recent_tokens={fmt.recent_tokens}); longer chunks go through the prefill path")
    if length.numel() != 1 or length.device != q_lat.device:
        raise ValueError(f"length must be a one-element tensor on {q_lat.device}, got shape {tuple(length.shape)} "
                         f"on {length.device}")
    for name, planes in (("content", content_planes), ("rope", rope_planes)):
        for key in ("codes", "scale", "zero"):
            if key not in planes:
                raise ValueError(f"{name} planes need 'codes', 'scale' and 'zero', got {sorted(planes)}")
            plane = planes[key]
            if plane.shape[0] != B or plane.shape[1] < capacity or plane.stride(-1) != 1:
                raise ValueError(f"{name} plane {key!r} must be [B={B}, capacity >= {capacity}, .] with a contiguous "
                                 f"last dimension, got shape {tuple(plane.shape)} strides {plane.stride()}")
        if planes["scale"].stride() != planes["zero"].stride():
            raise ValueError(f"{name} scale and zero planes must share strides, got {planes['scale'].stride()} and "
                             f"{planes['zero'].stride()}")
    for name, t, n in (("sink_c", sink_c, fmt.sink_tokens), ("sink_r", sink_r, fmt.sink_tokens),
                       ("recent_c", recent_c, fmt.recent_tokens), ("recent_r", recent_r, fmt.recent_tokens)):
        if t.shape[0] != B or t.shape[1] < n or t.stride(-1) != 1:
            raise ValueError(f"{name} must be [B={B}, {n}, d] with a contiguous last dimension, got {tuple(t.shape)}")

    M = H * Tq
    cfg = default_launch(B, M, capacity, fmt, q_lat.device)
    cfg.update({k: v for k, v in launch.items() if v is not None})
    BLOCK_M, BLOCK_T = int(cfg["block_m"]), int(cfg["block_t"])
    head_blocks = triton.cdiv(M, BLOCK_M)
    sms = _num_sms(q_lat.device.index or 0) if q_lat.is_cuda and not _interpreting() else 8
    NS = cfg.get("num_splits") or num_splits_for(B, head_blocks, capacity, fmt, sms, BLOCK_T, cfg["waves"])
    NS = max(1, int(NS))
    n_packed = max(1, capacity - fmt.sink_tokens - fmt.recent_tokens)
    tps = triton.cdiv(triton.cdiv(n_packed, NS), BLOCK_T) * BLOCK_T
    NSP = NS + 1

    q = q_lat.reshape(B, M, D_C).contiguous()
    qr = q_rot.reshape(B, M, D_R).contiguous()
    dev = q.device
    o_part = torch.empty((B, M, NSP, D_C), dtype=torch.float32, device=dev)
    lse_part = torch.empty((B, M, NSP), dtype=torch.float32, device=dev)
    cp, rp = content_planes, rope_planes
    lp = left_padding if left_padding.dtype == torch.int64 else left_padding.to(torch.int64)
    q_split = q_lat.dtype == torch.float32 or q_rot.dtype == torch.float32
    mla_decode_fast_kernel[(NSP, head_blocks, B)](
        q, qr, cp["codes"], cp["scale"], cp["zero"], rp["codes"], rp["scale"], rp["zero"],
        sink_c, sink_r, recent_c, recent_r, lp, length, o_part, lse_part,
        M, Tq, tps, NS, scaling * LOG2E,
        q.stride(0), qr.stride(0), cp["codes"].stride(0), cp["codes"].stride(1), cp["scale"].stride(0),
        cp["scale"].stride(1), rp["codes"].stride(0), rp["codes"].stride(1), rp["scale"].stride(0),
        rp["scale"].stride(1),
        sink_c.stride(0), sink_c.stride(1), sink_r.stride(0), sink_r.stride(1),
        recent_c.stride(0), recent_c.stride(1), recent_r.stride(0), recent_r.stride(1),
        D_C=D_C, GC=fmt.content.n_groups, GROUP_C=fmt.content.group, C_BITS=fmt.content.bits,
        D_R=D_R, GR=fmt.rope.n_groups, GROUP_R=fmt.rope.group, R_BITS=fmt.rope.bits,
        S=fmt.sink_tokens, R=fmt.recent_tokens, BLOCK_M=BLOCK_M, BLOCK_T=BLOCK_T, Q_SPLIT=q_split,
        PREFETCH=bool(cfg["prefetch"]), num_warps=int(cfg["num_warps"]), num_stages=int(cfg["num_stages"]),
    )
    if out is None:
        o = torch.empty((B, H, Tq, D_C), dtype=torch.float32, device=dev)
        lse = torch.empty((B, H, Tq), dtype=torch.float32, device=dev)
    else:
        o, lse = out
        if o.shape != (B, H, Tq, D_C) or lse.shape != (B, H, Tq) or not (o.is_contiguous() and lse.is_contiguous()):
            raise ValueError(f"out must be contiguous ([B, H, Tq, d_c], [B, H, Tq]) = ({(B, H, Tq, D_C)}, "
                             f"{(B, H, Tq)}), got {tuple(o.shape)} and {tuple(lse.shape)}")
    BLOCK_D = min(triton.next_power_of_2(D_C), 128)
    mla_decode_fast_combine_kernel[(B * M, triton.cdiv(D_C, BLOCK_D))](
        o_part, lse_part, o, lse, NSP, D_C=D_C, BLOCK_S=max(2, triton.next_power_of_2(NSP)), BLOCK_D=BLOCK_D,
    )
    return o, lse
