"""Plain PyTorch references of the decode kernels (`quantmla_hf/ops/backends.py`'s two operations): the same functions,
read from the same planes, in fp32 (or fp64).

For each batch row b the history is rebuilt position by position exactly as the kernel reads it:

    position p in [lp_b, lp_b + S)          -> sink copy, slot p - lp_b
    position p in [length - R, length)      -> recent ring, slot p % R     (unless already a sink position)
    any other position in [lp_b, length)    -> packed planes, dequantized as `quant_pack_ref.dequantize_ref`
    positions before lp_b                   -> not attended (left padding)

and query t of Tq (rows `[B, H, Tq]`) attends to positions `< length - Tq + t + 1` with one softmax.
"""

from __future__ import annotations

import dataclasses

import torch

from quantmla_hf.format import CacheFormat, PathFormat

from .quant_pack_ref import dequantize_ref

FP16_PARTIAL_SCALE = 2.0**-8  # fp16 split partials hold o_s times this (`mla_decode_combine`'s docstring)


def partial_scale(dtype: torch.dtype) -> float:
    """The factor split partials of `dtype` hold `o_s` multiplied by: `FP16_PARTIAL_SCALE` for fp16, else 1."""
    if dtype not in (torch.float32, torch.float16):
        raise ValueError(f"decode partials are fp32 or fp16, got {dtype}")
    return FP16_PARTIAL_SCALE if dtype == torch.float16 else 1.0


def history_ref(
    planes: dict[str, torch.Tensor], fmt: PathFormat, sink: torch.Tensor, recent: torch.Tensor,
    left_padding: torch.Tensor, length: torch.Tensor, sink_tokens: int, recent_tokens: int, dtype=torch.float32,
    round_packed: bool = False,
) -> torch.Tensor:
    """Every row of one path as attention sees it (the rule above), `[B, N, dim]` over the planes' `N` positions:
    `left_padding: [B]` and `length` (int64 `[1]`) on the planes' device, `sink: [B, S, dim]`, `recent: [B, R, dim]`
    (a path that keeps no copies may hold no rows at all). Positions past the length are zeros; those before the
    left padding are left as stored. `round_packed`: the packed positions' values `(code - z) * s` (exact in fp32)
    rounded once to fp16, to nearest, as the Gluon kernels' score keys are below 8 bits (`score_rounding`)."""
    if fmt.quantized:
        x = dequantize_ref(planes["codes"], planes["scale"], planes["zero"], fmt, torch.float32)
        x = (x.half() if round_packed else x).to(dtype)
    else:
        x = planes["values"].to(dtype)
    B, N, _ = x.shape
    S, R = sink_tokens, recent_tokens
    pos = torch.arange(N, device=x.device)
    n = length.reshape(())
    x = torch.where((pos < n)[None, :, None], x, 0.0)  # positions past the length hold whatever memory held
    if R:
        is_recent = (pos >= n - R) & (pos < n)  # [N]
        x = torch.where(is_recent[None, :, None], recent[:, pos % R].to(dtype), x)
    if S:
        slot = pos[None, :] - left_padding.reshape(B, 1)  # [B, N]
        is_sink = (slot >= 0) & (slot < S) & (pos[None, :] < n)
        gathered = sink.to(dtype).gather(1, slot.clamp(0, S - 1).unsqueeze(-1).expand(-1, -1, sink.shape[-1]))
        x = torch.where(is_sink.unsqueeze(-1), gathered, x)
    return x


def mla_decode_static_ref(q_lat, q_rot, content, rope, fmt: CacheFormat, sink_content, sink_rope, recent_content,
                          recent_rope, left_padding, length, capacity: int, scaling: float, out: tuple | None = None,
                          dtype: torch.dtype = torch.float32,
                          score_rounding: tuple[bool, bool] = (False, False)) -> tuple[torch.Tensor, torch.Tensor]:
    """The function of `ops.backends.mla_decode_static`: the length on the device (int64 `[1]`) and every row at once
    over the static `capacity` positions, so no host synchronisation and no data-dependent shape: it traces into one
    graph (`torch.compile(fullgraph=True)`). Costs `[B, capacity, d_c + d_R]` of `dtype` per call.

    `score_rounding` (content, RoPE): score with packed keys rounded once to fp16 on those paths, the arithmetic of a
    kernel that rounds them (`kernels.mla_decode_gluon_common.score_rounding`); the values stay exact.

    Returns `o_lat: [B, H, Tq, d_c]`, `lse: [B, H, Tq]` (fp32; zeros and `-inf` for a row with nothing visible),
    written into `out` when given.
    """
    B, H, Tq, d_c = q_lat.shape
    S, R = fmt.sink_tokens, fmt.recent_tokens
    c = history_ref(content, fmt.content, sink_content, recent_content, left_padding, length, S, R, dtype)
    c_key = (history_ref(content, fmt.content, sink_content, recent_content, left_padding, length, S, R, dtype,
                         round_packed=True) if score_rounding[0] else c)
    r = history_ref(rope, fmt.rope, sink_rope, recent_rope, left_padding, length, S, R, dtype,
                    round_packed=score_rounding[1])
    c, c_key, r = c[:, :capacity], c_key[:, :capacity], r[:, :capacity]
    scores = (q_lat.to(dtype) @ c_key.unsqueeze(1).transpose(-1, -2)
              + q_rot.to(dtype) @ r.unsqueeze(1).transpose(-1, -2)) * scaling  # [B, H, Tq, capacity]
    pos = torch.arange(c.shape[1], device=c.device)
    limit = length.reshape(()) - Tq + 1 + torch.arange(Tq, device=c.device)  # [Tq]
    visible = (pos[None, None, :] >= left_padding.reshape(B, 1, 1)) & (pos[None, None, :] < limit[None, :, None])
    scores = scores.masked_fill(~visible.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)  # a row with nothing visible: zeros, lse -inf
    o, lse = (probs @ c.unsqueeze(1)).float(), lse.float()
    if out is not None:
        out[0].copy_(o)
        out[1].copy_(lse)
        return out[0], out[1]
    return o, lse


def mla_decode_ref(q_lat, q_rot, content, rope, fmt: CacheFormat, sink_content, sink_rope, recent_content, recent_rope,
                   left_padding, length: int, scaling: float, dtype: torch.dtype = torch.float32,
                   score_rounding: tuple[bool, bool] = (False, False)) -> tuple[torch.Tensor, torch.Tensor]:
    """`mla_decode_static_ref` with the length a host int, one batch row at a time over its first `length`
    positions, so a long context costs `[length, d_c + d_R]` of `dtype`, not `[B, length, ...]`."""
    B, H, Tq, d_c = q_lat.shape
    o = torch.empty((B, H, Tq, d_c), dtype=torch.float32, device=q_lat.device)
    lse = torch.empty((B, H, Tq), dtype=torch.float32, device=q_lat.device)
    n = torch.tensor([length], device=q_lat.device)
    left_padding = left_padding.to(q_lat.device)
    for b in range(B):
        row = slice(b, b + 1)
        planes = [{k: v[row, :length] for k, v in p.items()} for p in (content, rope)]
        copies = [t[row] for t in (sink_content, sink_rope, recent_content, recent_rope)]
        mla_decode_static_ref(q_lat[row], q_rot[row], *planes, fmt, *copies, left_padding[row], n, length, scaling,
                              out=(o[row], lse[row]), dtype=dtype, score_rounding=score_rounding)
    return o, lse


def mla_decode_paged_ref(q_lat, q_rot, content, rope, fmt: CacheFormat, sink_content, sink_rope, recent_content,
                         recent_rope, page_table, rows, cu_seqlens_q, seq_lens, scaling: float,
                         dtype: torch.dtype = torch.float32,
                         score_rounding: tuple[bool, bool] = (False, False)) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of every query token of a paged step, its requests packed without padding: request i has the query
    rows `[cu_seqlens_q[i], cu_seqlens_q[i + 1])` and `seq_lens[i]` cached tokens (its new ones included), read by
    the rule above with no left padding, `S = sink.shape[1]`, `R = recent.shape[1]` (0 for a cache that keeps no
    copies, C16R16), copies from row `rows[i]` and packed position p from slot `p % page_size` of page
    `page_table[i, p // page_size]`: `mla_decode_ref` of each request's positions gathered from its pages.

    Args:
        q_lat: `[Nq, H, d_c]` absorbed content queries; q_rot: `[Nq, H, d_R]` RoPE queries.
        content, rope: page planes `[P, page_size, width]` of one layer (byte layout: `quantmla_hf/format.py`).
        sink_*: `[rows, S, d]`, recent_*: `[rows, R, d]` model-dtype copies.
        page_table: int32 `[n, max_pages]`; rows: int32 `[n]`; cu_seqlens_q: int32 `[n + 1]`; seq_lens: int32 `[n]`.

    Returns `o_lat: [Nq, H, d_c]` and `lse: [Nq, H]` (natural log of the scaled scores), both fp32.
    `score_rounding`: as `mla_decode_static_ref`'s.
    """
    Nq, H, d_c = q_lat.shape
    o_out = torch.zeros((Nq, H, d_c), dtype=torch.float32, device=q_lat.device)
    lse_out = torch.full((Nq, H), float("-inf"), dtype=torch.float32, device=q_lat.device)
    page_size = next(iter(content.values())).shape[1]
    step_fmt = dataclasses.replace(fmt, sink_tokens=sink_content.shape[1], recent_tokens=recent_content.shape[1])
    no_padding = torch.zeros(1, dtype=torch.int64)
    cu = cu_seqlens_q.tolist()
    for i, (q0, q1, length, row) in enumerate(zip(cu, cu[1:], seq_lens.tolist(), rows.tolist())):
        if q1 == q0:
            continue
        pos = torch.arange(length, device=q_lat.device)
        slots = page_table[i].long()[pos // page_size] * page_size + pos % page_size
        planes = [{k: v.reshape(-1, v.shape[-1])[slots][None] for k, v in p.items()} for p in (content, rope)]
        copies = [t[row : row + 1] for t in (sink_content, sink_rope, recent_content, recent_rope)]
        o, lse = mla_decode_ref(q_lat[q0:q1].transpose(0, 1)[None], q_rot[q0:q1].transpose(0, 1)[None], *planes,
                                step_fmt, *copies, no_padding, length, scaling, dtype, score_rounding)
        o_out[q0:q1], lse_out[q0:q1] = o[0].transpose(0, 1), lse[0].transpose(0, 1)
    return o_out, lse_out


def combine_ref(o_part: torch.Tensor, lse_part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`mla_decode_combine.combine` (shapes: its module docstring, fp16 partials scaled as it says); zeros and -inf
    where every split is empty."""
    lse_part = lse_part.float()
    lse = torch.logsumexp(lse_part, dim=-1)
    w = torch.exp(lse_part - lse.unsqueeze(-1)).nan_to_num(0.0)
    return (w.unsqueeze(-1) * o_part.float()).sum(-2) / partial_scale(o_part.dtype), lse
