"""Triton kernel: absorbed MLA attention of several requests read from the paged QuantMLA cache.

Same function and arguments as `mla_decode_paged_ref.mla_decode_paged_ref` (see its docstring for the read rule):
requests of different lengths in one launch, packed without padding (`cu_seqlens_q`), each token read by
indirection (its page from the request's `page_table` row, its slot `p % page_size`).

One program per (query token, block of heads, split of the history) walks its share of the request's visible
positions in blocks of `BLOCK_N`:
each position's page comes from the page table, its packed bytes, scale and zero point are loaded from that page and
dequantized in fp32 as `quant_pack_ref.dequantize_ref` does (`(q - z) * s`), sink and recent positions are read from
their model-dtype copies instead, and the scores and the weighted sum are fp32 IEEE dots with an online softmax.
That is the reference's arithmetic in a streaming order (equal up to fp32 rounding of the softmax); the splits' partial
results are merged by their log-sum-exp. Page planes must
be contiguous `[P, page_size, width]`; offsets are int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantmla_hf.format import CacheFormat, PathFormat

LOG2E = 1.4426950408889634


@triton.jit
def _load_path(p0, p1, p2, slot, m_n, pos, row, p_sink, p_recent, S, R, length,
               D: tl.constexpr, DP: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, G: tl.constexpr):
    """Positions `pos` (`[BN]`, page slots `slot`) of one path as attention reads them: `[BN, DP]` fp32."""
    o_d = tl.arange(0, DP)
    m_d = o_d < D
    m = m_n[:, None] & m_d[None, :]
    if BITS == 16:
        x = tl.load(p0 + slot[:, None] * D + o_d[None, :], mask=m, other=0.0).to(tl.float32)
    else:
        CB: tl.constexpr = D * BITS // 8
        HALF: tl.constexpr = 1 << (BITS - 1)
        QMAX: tl.constexpr = (1 << BITS) - 1
        byte = tl.load(p0 + slot[:, None] * CB + (o_d * BITS // 8)[None, :], mask=m, other=0).to(tl.int32)
        q = ((byte >> ((o_d * BITS) % 8)[None, :]) & QMAX).to(tl.float32)
        g = o_d // GROUP
        s = tl.load(p1 + slot[:, None] * G + g[None, :], mask=m, other=0.0).to(tl.float32)
        z = tl.load(p2 + slot[:, None] * G + g[None, :], mask=m, other=0).to(tl.float32) + HALF
        x = (q - z) * s
    is_recent = m_n & (pos >= length - R)
    rec = tl.load(p_recent + (row * R + pos % tl.maximum(R, 1))[:, None] * D + o_d[None, :],
                  mask=is_recent[:, None] & m_d[None, :], other=0.0).to(tl.float32)
    x = tl.where(is_recent[:, None], rec, x)
    is_sink = m_n & (pos < S)
    snk = tl.load(p_sink + (row * S + pos)[:, None] * D + o_d[None, :], mask=is_sink[:, None] & m_d[None, :],
                  other=0.0).to(tl.float32)
    return tl.where(is_sink[:, None], snk, x)


@triton.jit(do_not_specialize=["S", "R", "max_pages", "scaling", "split_len"])
def mla_decode_paged_kernel(
    q_lat_ptr, q_rot_ptr, o_ptr, lse_ptr,
    c0, c1, c2, r0, r1, r2,
    sink_c_ptr, sink_r_ptr, recent_c_ptr, recent_r_ptr,
    page_table_ptr, rows_ptr, cu_q_ptr, seq_lens_ptr, token_request_ptr,
    S, R, max_pages, scaling, H, Nq, split_len,
    PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    D_C: tl.constexpr, D_CP: tl.constexpr, BITS_C: tl.constexpr, GROUP_C: tl.constexpr, G_C: tl.constexpr,
    D_R: tl.constexpr, D_RP: tl.constexpr, BITS_R: tl.constexpr, GROUP_R: tl.constexpr, G_R: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    h0 = tl.program_id(1) * BLOCK_H
    split = tl.program_id(2).to(tl.int64)
    i_req = tl.load(token_request_ptr + tok).to(tl.int64)
    q_start = tl.load(cu_q_ptr + i_req)
    q_len = tl.load(cu_q_ptr + i_req + 1) - q_start
    length = tl.load(seq_lens_ptr + i_req)
    row = tl.load(rows_ptr + i_req).to(tl.int64)
    limit = length - q_len + (tok - q_start) + 1  # positions < limit are visible

    o_h = h0 + tl.arange(0, BLOCK_H)
    m_h = o_h < H
    o_c = tl.arange(0, D_CP)
    o_r = tl.arange(0, D_RP)
    q_c = tl.load(q_lat_ptr + (tok * H + o_h)[:, None] * D_C + o_c[None, :],
                  mask=m_h[:, None] & (o_c[None, :] < D_C), other=0.0).to(tl.float32)
    q_r = tl.load(q_rot_ptr + (tok * H + o_h)[:, None] * D_R + o_r[None, :],
                  mask=m_h[:, None] & (o_r[None, :] < D_R), other=0.0).to(tl.float32)

    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, D_CP), tl.float32)
    qk_scale = scaling * 1.4426950408889634
    # This program's share of the positions: [split * split_len, (split + 1) * split_len) (a multiple of BLOCK_N).
    lo = split * split_len
    hi = tl.minimum(limit, lo + split_len)
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N).to(tl.int64)
        m_n = pos < hi
        page = tl.load(page_table_ptr + i_req * max_pages + pos // PAGE, mask=m_n, other=0).to(tl.int64)
        slot = page * PAGE + pos % PAGE
        b_c = _load_path(c0, c1, c2, slot, m_n, pos, row, sink_c_ptr, recent_c_ptr, S, R, length,
                         D_C, D_CP, BITS_C, GROUP_C, G_C)
        b_r = _load_path(r0, r1, r2, slot, m_n, pos, row, sink_r_ptr, recent_r_ptr, S, R, length,
                         D_R, D_RP, BITS_R, GROUP_R, G_R)
        s = tl.dot(q_c, tl.trans(b_c), input_precision="ieee") + tl.dot(q_r, tl.trans(b_r), input_precision="ieee")
        s = tl.where(m_n[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, b_c, input_precision="ieee")
        m_i = m_new
    # An empty split (past its token's limit) stores o = 0 and lse = -inf, which the combine weighs by zero.
    out = tl.where(l_i[:, None] > 0, acc / tl.maximum(l_i, 1e-30)[:, None], 0.0)
    row = split * Nq * H + tok * H + o_h
    tl.store(o_ptr + row[:, None] * D_C + o_c[None, :], out, mask=m_h[:, None] & (o_c[None, :] < D_C))
    lse = tl.where(l_i > 0, (m_i + tl.log2(tl.maximum(l_i, 1e-30))) / 1.4426950408889634, float("-inf"))
    tl.store(lse_ptr + row, lse, mask=m_h)


def _path_args(planes: dict[str, torch.Tensor], fmt: PathFormat) -> tuple:
    for name, plane in planes.items():
        if not plane.is_contiguous():
            raise ValueError(f"page plane {name!r} must be contiguous [P, page_size, width]")
    if fmt.quantized:
        return (planes["codes"], planes["scale"], planes["zero"])
    return (planes["values"],) * 3


def mla_decode_paged(
    q_lat: torch.Tensor,
    q_rot: torch.Tensor,
    content: dict[str, torch.Tensor],
    rope: dict[str, torch.Tensor],
    fmt: CacheFormat,
    sink_content: torch.Tensor,
    sink_rope: torch.Tensor,
    recent_content: torch.Tensor,
    recent_rope: torch.Tensor,
    page_table: torch.Tensor,
    rows: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scaling: float,
    token_request: torch.Tensor | None = None,
    block_n: int | None = None,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See `mla_decode_paged_ref.mla_decode_paged_ref`; returns `o_lat: [Nq, H, d_c]`, `lse: [Nq, H]` (fp32).

    `token_request` (int32 `[Nq]`, each query token's request) is derived from `cu_seqlens_q` when not given (the
    paged cache's `PagedStep.token_request` is that tensor). Long histories are split: `num_splits` programs per
    (token, head block) each take a contiguous share of the positions and their partial results are merged by
    their log-sum-exp (default: enough splits for about 4 programs per SM, shares of at least 256 positions).
    `max_seq_len` (the longest `seq_lens`) saves reading it back from the device.
    """
    Nq, H, d_c = q_lat.shape
    if q_rot.shape != (Nq, H, fmt.rope.dim) or d_c != fmt.content.dim:
        raise ValueError(
            f"expected q_lat [Nq, H, {fmt.content.dim}] and q_rot [Nq, H, {fmt.rope.dim}], got "
            f"{tuple(q_lat.shape)} and {tuple(q_rot.shape)}"
        )
    n = seq_lens.shape[0]
    if cu_seqlens_q.shape != (n + 1,) or page_table.dim() != 2 or page_table.shape[0] != n or rows.shape != (n,):
        raise ValueError(
            f"cu_seqlens_q must be [n + 1], page_table [n, max_pages] and rows [n] for n = {n} requests, got "
            f"{tuple(cu_seqlens_q.shape)}, {tuple(page_table.shape)} and {tuple(rows.shape)}"
        )
    if sink_content.shape[1] and sink_content.shape[0] == 0:
        raise ValueError("sink copies are [rows, S, d]: give one row per request row in use")
    if token_request is None:
        counts = cu_seqlens_q[1:].long() - cu_seqlens_q[:-1].long()
        token_request = torch.repeat_interleave(torch.arange(n, device=q_lat.device), counts)
    if Nq == 0:
        return (torch.empty((0, H, d_c), dtype=torch.float32, device=q_lat.device),
                torch.empty((0, H), dtype=torch.float32, device=q_lat.device))
    page_size = next(iter(content.values())).shape[1]
    wide = fmt.content.dim >= 256  # a [BLOCK_N, d_c] fp32 tile per step: keep it small at DeepSeek widths
    if block_n is None:
        block_n = 16 if wide else 32
    block_h = max(16, min(64, triton.next_power_of_2(H)))
    head_blocks = triton.cdiv(H, block_h)
    longest = int(seq_lens.max()) if max_seq_len is None else max_seq_len
    if num_splits is None:
        programs = 4 * (torch.cuda.get_device_properties(q_lat.device).multi_processor_count
                        if q_lat.is_cuda else 4)
        num_splits = max(1, min(triton.cdiv(programs, Nq * head_blocks), triton.cdiv(longest, 256)))
    split_len = triton.cdiv(triton.cdiv(max(longest, 1), num_splits), block_n) * block_n
    num_splits = triton.cdiv(max(longest, 1), split_len)
    o = torch.empty((num_splits, Nq, H, d_c), dtype=torch.float32, device=q_lat.device)
    lse = torch.empty((num_splits, Nq, H), dtype=torch.float32, device=q_lat.device)
    grid = (Nq, head_blocks, num_splits)
    S, R = sink_content.shape[1], recent_content.shape[1]
    # An empty copy tensor has no storage to point at: pass the queries (never read, the masks are all false).
    sinks = [t if t.numel() else q_lat for t in (sink_content, sink_rope, recent_content, recent_rope)]
    mla_decode_paged_kernel[grid](
        q_lat.contiguous(), q_rot.contiguous(), o, lse,
        *_path_args(content, fmt.content), *_path_args(rope, fmt.rope),
        *[t.contiguous() for t in sinks],
        page_table.to(torch.int32).contiguous(), rows.to(torch.int32).contiguous(),
        cu_seqlens_q.to(torch.int32).contiguous(), seq_lens.to(torch.int32).contiguous(),
        token_request.to(torch.int32).contiguous(),
        S, R, page_table.shape[1], float(scaling), H, Nq, split_len,
        PAGE=page_size, BLOCK_H=block_h, BLOCK_N=block_n,
        D_C=fmt.content.dim, D_CP=triton.next_power_of_2(fmt.content.dim), BITS_C=fmt.content.bits,
        GROUP_C=fmt.content.group, G_C=max(fmt.content.n_groups, 1),
        D_R=fmt.rope.dim, D_RP=triton.next_power_of_2(fmt.rope.dim), BITS_R=fmt.rope.bits,
        GROUP_R=fmt.rope.group, G_R=max(fmt.rope.n_groups, 1),
        num_warps=8 if wide else 4,
    )
    if num_splits == 1:
        return o[0], lse[0]
    total = torch.logsumexp(lse, dim=0)  # [Nq, H]; every token sees position 0, so it is finite
    weights = torch.exp(lse - total.unsqueeze(0)).nan_to_num(0.0)
    return (weights.unsqueeze(-1) * o).sum(0), total
