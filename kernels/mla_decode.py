"""Triton split-K MLA decode on the packed QuantMLA cache: absorbed attention of a few query tokens over the history.

What one call computes (the plain PyTorch version is `mla_decode_ref.py`; design notes in `docs/KERNELS.md`):

    rows m = (head h, query token t) of `q_lat: [B, H, Tq, d_c]`, `q_rot: [B, H, Tq, d_R]`, flattened to `M = H * Tq`
    score[m, j] = (q_lat[m] . c[j] + q_rot[m] . k_R[j]) * scaling          for every valid cached position j
    o_lat[m] = softmax_j(score[m]) @ c,  lse[m] = logsumexp_j score[m]

Valid positions of batch row b are `[left_padding[b], length)`, and query t sees only positions
`< length - Tq + t + 1` (causal). Each position is read exactly once: positions `[lp, lp + S)` from the model-dtype
sink copy, the last `R` positions from the model-dtype recent ring (slot `p % R`), every other one from the packed
planes, dequantized in registers (byte layout in `quantmla_hf/format.py`). Nothing of the history is written back.

Kernel 1 (`mla_decode_fwd_kernel`): one program per (head block, batch row, split). Splits `0 .. NS-1` take equal
shares of the packed positions `[S, length - R)`; split `NS` takes the sink and recent tokens. Each program keeps an
online softmax in base 2 and writes its partial `o: [B, M, NS+1, d_c]` (normalised) and `lse: [B, M, NS+1]`.
Kernel 2 (`mla_decode_combine_kernel`): merges the splits of one (row, query row) by log-sum-exp.

Arithmetic: every path is cut into groups of `GROUP` elements (the quantization group; a 16-bit path uses the same
tiling with no scale) and scores are batched dots over groups, `[G, BM, GROUP] x [G, GROUP, BN]`, so the per-token
group scale multiplies an exact integer dot: codes minus zero point are small integers, exact in fp16. The query is
split into an fp16 high part and an fp16 low part (two dots, ~22 bits), so the scores and the LSE keep fp32-level
accuracy on tensor cores. Probabilities enter the value dot as fp16 (`p * scale` for packed tokens). Model-dtype
copies (bf16) are converted to fp16 for the dots, exact for magnitudes in [6e-5, 65504]. With fp32 models
(`EXACT`) every dot is an fp32 IEEE dot instead. All offsets are int64.
"""

from __future__ import annotations

import math

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


@triton.jit
def _load_packed(p_codes, p_scale, p_zero, stride_t, stride_mt, o_t, m_t, D: tl.constexpr, DP: tl.constexpr,
                 G: tl.constexpr, GP: tl.constexpr, GROUP: tl.constexpr, BITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Tokens `o_t` of one packed path (planes already offset to the batch row), dequantized in registers:
    `[BN, DP]` fp32 (zeros past D), exact (`(q - z) * s` of an 8-bit integer and an fp16 scale)."""
    PACK: tl.constexpr = 8 // BITS
    HALF: tl.constexpr = 1 << (BITS - 1)
    MASK: tl.constexpr = (1 << BITS) - 1
    o_k = tl.arange(0, DP // PACK)
    m_k = m_t[:, None] & (o_k[None, :] < D // PACK)
    b_byte = tl.load(p_codes + o_t[:, None] * stride_t + o_k[None, :], mask=m_k, other=0).to(tl.int32)
    if BITS == 8:
        b_q = b_byte
    elif BITS == 4:
        b_q = tl.interleave(b_byte & MASK, b_byte >> 4)
    else:
        b_q = tl.interleave(
            tl.interleave(b_byte & MASK, (b_byte >> 4) & MASK), tl.interleave((b_byte >> 2) & MASK, b_byte >> 6)
        )
    o_g = tl.arange(0, GP)
    m_g = m_t[:, None] & (o_g[None, :] < G)
    o_gt = o_t[:, None] * stride_mt + o_g[None, :]  # [BN, GP] offsets into the [cap, G] metadata
    b_z = tl.load(p_zero + o_gt, mask=m_g, other=0).to(tl.int32) + HALF
    b_s = tl.load(p_scale + o_gt, mask=m_g, other=0.0).to(tl.float32)
    b_x = (tl.reshape(b_q, (BLOCK_N, GP, GROUP)) - b_z[:, :, None]).to(tl.float32) * b_s[:, :, None]
    return tl.reshape(b_x, (BLOCK_N, DP))


@triton.jit
def _load_values(p_vals, stride_t, o_t, m_t, D: tl.constexpr, DP: tl.constexpr):
    """Model-dtype values of tokens `o_t`: `[BN, DP]` fp32 (zeros past D)."""
    o_k = tl.arange(0, DP)
    m = m_t[:, None] & (o_k[None, :] < D)
    return tl.load(p_vals + o_t[:, None] * stride_t + o_k[None, :], mask=m, other=0.0).to(tl.float32)


@triton.jit
def _scores(q_hi, q_lo, b_k, KDT: tl.constexpr, EXACT: tl.constexpr, K_LO: tl.constexpr):
    """`q: [BM, D]` (high, low parts) against `b_k: [BN, D]` fp32 -> `[BM, BN]` fp32.

    Not EXACT: q_hi.k_hi + q_lo.k_hi (+ q_hi.k_lo when the keys are not exact in fp16, K_LO), ~22-bit products."""
    if EXACT:
        return tl.dot(q_hi, tl.trans(b_k), input_precision="ieee")
    else:
        k_hi = b_k.to(KDT)
        d = tl.dot(q_hi, tl.trans(k_hi)) + tl.dot(q_lo, tl.trans(k_hi))
        if K_LO:
            d += tl.dot(q_hi, tl.trans((b_k - k_hi.to(tl.float32)).to(KDT)))
        return d


@triton.jit
def _online_update(b_s, m_valid, m_i, l_i, acc, b_v, KDT: tl.constexpr, EXACT: tl.constexpr):
    """One online-softmax step with base-2 scores `b_s: [BM, BN]` and values `b_v: [BN, d_c]` fp32."""
    b_s = tl.where(m_valid, b_s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(b_s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    b_p = tl.exp2(b_s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(b_p, axis=1)
    acc = acc * alpha[:, None] + _dot(b_p.to(KDT), b_v.to(KDT), EXACT)
    return m_new, l_i, acc


# Lengths and counts change every decode step: specialising on them (== 1, % 16) would recompile mid-generation.
@triton.jit(do_not_specialize=["length", "M", "Tq", "tokens_per_split", "num_splits"])
def mla_decode_fwd_kernel(
    q_ptr, qr_ptr,
    c0_ptr, c1_ptr, c2_ptr, r0_ptr, r1_ptr, r2_ptr,
    sc_ptr, sr_ptr, rc_ptr, rr_ptr, lp_ptr,
    o_ptr, lse_ptr,
    length, M, Tq, tokens_per_split, num_splits, qk_scale,
    s_qb, s_qrb, s_c0b, s_c0t, s_c1b, s_c1t, s_r0b, s_r0t, s_r1b, s_r1t,
    s_scb, s_sct, s_srb, s_srt, s_rcb, s_rct, s_rrb, s_rrt,
    D_C: tl.constexpr, D_CP: tl.constexpr, GC: tl.constexpr, GCP: tl.constexpr, GROUP_C: tl.constexpr,
    C_BITS: tl.constexpr,
    D_R: tl.constexpr, D_RP: tl.constexpr, GR: tl.constexpr, GRP: tl.constexpr, GROUP_R: tl.constexpr,
    R_BITS: tl.constexpr,
    S: tl.constexpr, R: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EXACT: tl.constexpr,
):
    i_hb = tl.program_id(0).to(tl.int64)
    i_b = tl.program_id(1).to(tl.int64)
    i_s = tl.program_id(2).to(tl.int64)
    KDT: tl.constexpr = tl.float32 if EXACT else tl.float16

    o_m = i_hb * BLOCK_M + tl.arange(0, BLOCK_M)
    m_m = o_m < M
    # Causal limit of each query row: query t of Tq sees positions < length - Tq + t + 1.
    lim_m = length - Tq + (o_m % Tq) + 1
    lp = tl.load(lp_ptr + i_b)

    o_c = tl.arange(0, D_CP)
    o_r = tl.arange(0, D_RP)
    m_qc = m_m[:, None] & (o_c[None, :] < D_C)
    q_c = tl.load(q_ptr + i_b * s_qb + o_m[:, None] * D_C + o_c[None, :], mask=m_qc, other=0.0)
    m_qr = m_m[:, None] & (o_r[None, :] < D_R)
    q_r = tl.load(qr_ptr + i_b * s_qrb + o_m[:, None] * D_R + o_r[None, :], mask=m_qr, other=0.0)
    # High and low fp16 halves of the query: two tensor-core dots give ~22-bit products.
    qc_hi = q_c.to(KDT)
    qc_lo = (q_c - qc_hi.to(tl.float32)).to(KDT)
    qr_hi = q_r.to(KDT)
    qr_lo = (q_r - qr_hi.to(tl.float32)).to(KDT)

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D_CP), tl.float32)
    is_dense = i_s == num_splits

    # Packed positions: this split's share of [S, length - R), intersected with [lp + S, ...); all of them lie
    # before every causal limit because Tq <= R.
    hi = length - R
    lo_s = S + i_s * tokens_per_split
    hi_s = tl.where(is_dense, lo_s, tl.minimum(lo_s + tokens_per_split, hi))
    lo_valid = lp + S
    for start in range(lo_s, hi_s, BLOCK_N):
        o_t = start + tl.arange(0, BLOCK_N).to(tl.int64)
        m_t = (o_t < hi_s) & (o_t >= lo_valid)
        if C_BITS == 16:
            b_c = _load_values(c0_ptr + i_b * s_c0b, s_c0t, o_t, m_t, D_C, D_CP)
        else:
            b_c = _load_packed(c0_ptr + i_b * s_c0b, c1_ptr + i_b * s_c1b, c2_ptr + i_b * s_c1b, s_c0t, s_c1t,
                               o_t, m_t, D_C, D_CP, GC, GCP, GROUP_C, C_BITS, BLOCK_N)
        if R_BITS == 16:
            b_r = _load_values(r0_ptr + i_b * s_r0b, s_r0t, o_t, m_t, D_R, D_RP)
        else:
            b_r = _load_packed(r0_ptr + i_b * s_r0b, r1_ptr + i_b * s_r1b, r2_ptr + i_b * s_r1b, s_r0t, s_r1t,
                               o_t, m_t, D_R, D_RP, GR, GRP, GROUP_R, R_BITS, BLOCK_N)
        b_s = _scores(qc_hi, qc_lo, b_c, KDT, EXACT, C_BITS != 16) + _scores(qr_hi, qr_lo, b_r, KDT, EXACT, R_BITS != 16)
        m_valid = m_m[:, None] & m_t[None, :]
        m_i, l_i, acc = _online_update(b_s * qk_scale, m_valid, m_i, l_i, acc, b_c, KDT, EXACT)

    # The last split takes the model-dtype copies: the sink (slot j = position lp + j) ...
    n_sink = tl.where(is_dense, S, 0)
    for start in range(0, n_sink, BLOCK_N):
        o_j = start + tl.arange(0, BLOCK_N).to(tl.int64)
        o_t = lp + o_j
        m_t = (o_j < S) & (o_t < length)
        b_c = _load_values(sc_ptr + i_b * s_scb, s_sct, o_j, m_t, D_C, D_CP)
        b_r = _load_values(sr_ptr + i_b * s_srb, s_srt, o_j, m_t, D_R, D_RP)
        b_s = _scores(qc_hi, qc_lo, b_c, KDT, EXACT, False) + _scores(qr_hi, qr_lo, b_r, KDT, EXACT, False)
        m_valid = m_m[:, None] & m_t[None, :] & (o_t[None, :] < lim_m[:, None])
        m_i, l_i, acc = _online_update(b_s * qk_scale, m_valid, m_i, l_i, acc, b_c, KDT, EXACT)
    # ... and the recent ring (positions [length - R, length) past the sink, slot p % R).
    r_lo = tl.maximum(hi, 0)
    r_hi = tl.where(is_dense, length, r_lo)
    for start in range(r_lo, r_hi, BLOCK_N):
        o_t = start + tl.arange(0, BLOCK_N).to(tl.int64)
        m_t = (o_t < r_hi) & (o_t >= lo_valid)
        o_slot = o_t % R
        b_c = _load_values(rc_ptr + i_b * s_rcb, s_rct, o_slot, m_t, D_C, D_CP)
        b_r = _load_values(rr_ptr + i_b * s_rrb, s_rrt, o_slot, m_t, D_R, D_RP)
        b_s = _scores(qc_hi, qc_lo, b_c, KDT, EXACT, False) + _scores(qr_hi, qr_lo, b_r, KDT, EXACT, False)
        m_valid = m_m[:, None] & m_t[None, :] & (o_t[None, :] < lim_m[:, None])
        m_i, l_i, acc = _online_update(b_s * qk_scale, m_valid, m_i, l_i, acc, b_c, KDT, EXACT)

    # Partial results: o normalised by this split's sum, lse in natural log (-inf for an empty split).
    has = l_i > 0
    inv_l = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
    b_lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    o_row = (i_b * M + o_m) * (num_splits + 1) + i_s  # [BM] index of (b, m, split)
    tl.store(o_ptr + o_row[:, None] * D_C + o_c[None, :], acc * inv_l[:, None], mask=m_qc)
    tl.store(lse_ptr + o_row, b_lse, mask=m_m)


@triton.jit(do_not_specialize=["NSP"])
def mla_decode_combine_kernel(o_part_ptr, lse_part_ptr, o_ptr, lse_ptr, NSP, D_C: tl.constexpr,
                              BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    # One program per (batch row, query row) and block of d_c.
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
    p = o_part_ptr + (i_bm * NSP + o_s[:, None]) * D_C + o_d[None, :]
    b_o = tl.load(p, mask=m_s[:, None] & m_d[None, :], other=0.0)
    out = tl.sum(b_o * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(o_ptr + i_bm * D_C + o_d, out, mask=m_d)
    if i_d == 0:
        tl.store(lse_ptr + i_bm, tl.where(total > 0, m_use + tl.log(total), float("-inf")))


def _planes(planes: dict[str, torch.Tensor], bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if bits == 16:
        v = planes["values"]
        return v, v, v
    return planes["codes"], planes["scale"], planes["zero"]


def _tiling(fmt_path) -> tuple[int, int]:
    """(groups, group width) of a path; a 16-bit path has no groups (one nominal group)."""
    if fmt_path.quantized:
        return fmt_path.n_groups, fmt_path.group
    return 1, fmt_path.dim


def default_num_splits(batch: int, head_blocks: int, n_packed: int, num_sms: int, block_n: int) -> int:
    """Splits of the packed positions so that about two waves of programs fill the GPU, each split keeping at
    least 4 blocks of tokens (the partial outputs then stay small against the cache bytes read)."""
    want = -(-2 * num_sms // max(1, batch * head_blocks))
    most = max(1, n_packed // (4 * block_n))
    return max(1, min(want, most))


def mla_decode_fwd(
    q_lat, q_rot, content, rope, fmt: CacheFormat, sink_c, sink_r, recent_c, recent_r, left_padding, length,
    scaling, num_splits=None, block_m=None, block_n=None, num_warps=None, num_stages=None,
):
    """Host wrapper: flatten (head, query) rows, pick blocks and splits, launch both kernels."""
    B, H, Tq, D_C = q_lat.shape
    D_R = q_rot.shape[-1]
    M = H * Tq
    q = q_lat.float().reshape(B, M, D_C).contiguous()
    qr = q_rot.float().reshape(B, M, D_R).contiguous()
    S, R = fmt.sink_tokens, fmt.recent_tokens
    GC, GROUP_C = _tiling(fmt.content)
    GR, GROUP_R = _tiling(fmt.rope)
    GCP, GRP = triton.next_power_of_2(GC), triton.next_power_of_2(GR)
    BLOCK_M = block_m or max(16, min(triton.next_power_of_2(M), 16 if D_C >= 256 else 64))
    # Wide latents: 64-token tiles with 8 warps were the fastest of the launches tried on the H200
    # (docs/BENCHMARKS.md, "launch sweep"); narrow (test-size) latents keep small tiles.
    BLOCK_N = block_n or (64 if D_C >= 256 else 16)
    if num_warps is None and D_C >= 256:
        num_warps = 8
    head_blocks = triton.cdiv(M, BLOCK_M)
    n_packed = max(0, length - R - S)
    if num_splits is None:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 8
        num_splits = default_num_splits(B, head_blocks, n_packed, sms, BLOCK_N)
    num_splits = max(1, int(num_splits))
    tps = triton.cdiv(triton.cdiv(max(n_packed, 1), num_splits), BLOCK_N) * BLOCK_N
    NSP = num_splits + 1
    o_part = torch.empty((B, M, NSP, D_C), dtype=torch.float32, device=q.device)
    lse_part = torch.empty((B, M, NSP), dtype=torch.float32, device=q.device)
    c0, c1, c2 = _planes(content, fmt.content.bits)
    r0, r1, r2 = _planes(rope, fmt.rope.bits)
    lp = left_padding.to(device=q.device, dtype=torch.int64).contiguous()
    extra = {k: v for k, v in (("num_warps", num_warps), ("num_stages", num_stages)) if v is not None}
    mla_decode_fwd_kernel[(head_blocks, B, NSP)](
        q, qr, c0, c1, c2, r0, r1, r2, sink_c, sink_r, recent_c, recent_r, lp, o_part, lse_part,
        length, M, Tq, tps, num_splits, scaling * LOG2E,
        q.stride(0), qr.stride(0), c0.stride(0), c0.stride(1), c1.stride(0), c1.stride(1),
        r0.stride(0), r0.stride(1), r1.stride(0), r1.stride(1),
        sink_c.stride(0), sink_c.stride(1), sink_r.stride(0), sink_r.stride(1),
        recent_c.stride(0), recent_c.stride(1), recent_r.stride(0), recent_r.stride(1),
        D_C=D_C, D_CP=GCP * GROUP_C if fmt.content.quantized else triton.next_power_of_2(D_C), GC=GC, GCP=GCP,
        GROUP_C=GROUP_C, C_BITS=fmt.content.bits,
        D_R=D_R, D_RP=GRP * GROUP_R if fmt.rope.quantized else triton.next_power_of_2(D_R), GR=GR, GRP=GRP,
        GROUP_R=GROUP_R, R_BITS=fmt.rope.bits,
        S=S, R=R, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, EXACT=sink_c.dtype == torch.float32, **extra,
    )
    o = torch.empty((B, M, D_C), dtype=torch.float32, device=q.device)
    lse = torch.empty((B, M), dtype=torch.float32, device=q.device)
    BLOCK_D = min(triton.next_power_of_2(D_C), 128)
    mla_decode_combine_kernel[(B * M, triton.cdiv(D_C, BLOCK_D))](
        o_part, lse_part, o, lse, NSP, D_C=D_C, BLOCK_S=max(2, triton.next_power_of_2(NSP)), BLOCK_D=BLOCK_D,
    )
    return o.view(B, H, Tq, D_C), lse.view(B, H, Tq)


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
