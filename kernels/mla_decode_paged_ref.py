"""Plain PyTorch reference of `mla_decode_paged.py`: absorbed MLA attention of several requests read from pages.

The requests of one step are packed without padding (varlen): request i has `q_i` query tokens, rows
`[cu_seqlens_q[i], cu_seqlens_q[i + 1])` of `q_lat: [Nq, H, d_c]` and `q_rot: [Nq, H, d_R]`, and `seq_lens[i]` cached
tokens (its new tokens included, already written). Position p of request i is read, as in `mla_decode_ref.py`
(left padding 0), from

    p < S                         -> sink copy `sink[rows[i], p]`
    p >= seq_lens[i] - R          -> recent ring `recent[rows[i], p % R]`          (unless a sink position)
    otherwise                     -> page `page_table[i, p // page_size]`, slot `p % page_size`, dequantized

with `S = sink.shape[1]` and `R = recent.shape[1]` (0 for a cache that keeps no copies, C16R16). Query t of request
i attends to positions `p < seq_lens[i] - q_i + t + 1` with one softmax. Page planes are `[P, page_size, width]`,
the byte layout of `quantmla_hf/format.py`.
"""

from __future__ import annotations

import torch

from quantmla_hf.format import CacheFormat, PathFormat

from .mla_decode_ref import attend, overlay_copies, read_path


def gather_paged_path(
    planes: dict[str, torch.Tensor], fmt: PathFormat, pages: torch.Tensor, length: int, dtype=torch.float32
) -> torch.Tensor:
    """Positions `[0, length)` of one request from its pages (`pages: [n_pages]`), dequantized: `[length, dim]`."""
    page_size = next(iter(planes.values())).shape[1]
    pos = torch.arange(length, device=pages.device)
    slots = pages.long()[pos // page_size] * page_size + pos % page_size
    return read_path({k: v.reshape(-1, v.shape[-1])[slots] for k, v in planes.items()}, fmt, dtype)


def paged_history_ref(
    planes: dict[str, torch.Tensor], fmt: PathFormat, sink: torch.Tensor, recent: torch.Tensor, pages: torch.Tensor,
    row: int, length: int, dtype=torch.float32,
) -> torch.Tensor:
    """One path of one request as attention sees it: `[length, dim]` (sink, then recent, then pages)."""
    x = gather_paged_path(planes, fmt, pages, length, dtype).clone()
    return overlay_copies(x, sink, recent, row, 0, sink.shape[1], recent.shape[1])


def mla_decode_paged_ref(
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
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of every query token over its request's pages.

    Args:
        q_lat: `[Nq, H, d_c]` absorbed content queries; q_rot: `[Nq, H, d_R]` RoPE queries.
        content, rope: page planes `[P, page_size, width]` of one layer.
        sink_*: `[rows, S, d]`, recent_*: `[rows, R, d]` model-dtype copies.
        page_table: int32 `[n, max_pages]`; rows: int32 `[n]`; cu_seqlens_q: int32 `[n + 1]`; seq_lens: int32 `[n]`.

    Returns `o_lat: [Nq, H, d_c]` and `lse: [Nq, H]` (natural log of the scaled scores), both fp32.
    """
    Nq, H, d_c = q_lat.shape
    o_out = torch.zeros((Nq, H, d_c), dtype=torch.float32, device=q_lat.device)
    lse_out = torch.full((Nq, H), float("-inf"), dtype=torch.float32, device=q_lat.device)
    cu, lens, rws = cu_seqlens_q.tolist(), seq_lens.tolist(), rows.tolist()
    for i, length in enumerate(lens):
        q0, q1 = cu[i], cu[i + 1]
        if q1 == q0:
            continue
        c = paged_history_ref(content, fmt.content, sink_content, recent_content, page_table[i], rws[i], length, dtype)
        r = paged_history_ref(rope, fmt.rope, sink_rope, recent_rope, page_table[i], rws[i], length, dtype)
        ql, qr = q_lat[q0:q1].to(dtype).transpose(0, 1), q_rot[q0:q1].to(dtype).transpose(0, 1)  # [H, q, d]
        scores = (ql @ c.T + qr @ r.T) * scaling  # [H, q, length]
        pos = torch.arange(length, device=c.device)
        limit = length - (q1 - q0) + 1 + torch.arange(q1 - q0, device=c.device)
        o, lse = attend(scores.masked_fill(~(pos[None, :] < limit[:, None]), float("-inf")), c)
        o_out[q0:q1], lse_out[q0:q1] = o.transpose(0, 1), lse.transpose(0, 1)
    return o_out, lse_out
