"""Plain PyTorch reference of `mla_decode.py`: the same function, read from the same planes, in fp32 (or fp64).

For each batch row b the history is rebuilt position by position exactly as the kernel reads it:

    position p in [lp_b, lp_b + S)          -> sink copy, slot p - lp_b
    position p in [length - R, length)      -> recent ring, slot p % R     (unless already a sink position)
    any other position in [lp_b, length)    -> packed planes, dequantized as `quant_pack_ref.dequantize_ref`
    positions before lp_b                   -> not attended (left padding)

and query t of Tq (rows `[B, H, Tq]`) attends to positions `< length - Tq + t + 1` with one softmax.
"""

from __future__ import annotations

import torch

from quantmla_hf.format import CacheFormat, PathFormat

from .quant_pack_ref import dequantize_ref


def _read_path(planes: dict[str, torch.Tensor], fmt: PathFormat, b: int, length: int, dtype) -> torch.Tensor:
    if not fmt.quantized:
        return planes["values"][b, :length].to(dtype)
    p = planes
    return dequantize_ref(p["codes"][b, :length], p["scale"][b, :length], p["zero"][b, :length], fmt, dtype)


def history_ref(
    planes: dict[str, torch.Tensor], fmt: PathFormat, sink: torch.Tensor, recent: torch.Tensor, b: int, lp: int,
    length: int, sink_tokens: int, recent_tokens: int, dtype=torch.float32,
) -> torch.Tensor:
    """Row `b` of one path as attention sees it: `[length, dim]` (positions before `lp` are left as stored)."""
    x = _read_path(planes, fmt, b, length, dtype).clone()
    S, R = sink_tokens, recent_tokens
    rlo = max(0, length - R)
    if R:
        pos = torch.arange(rlo, length, device=x.device)
        x[rlo:length] = recent[b, pos % R].to(dtype)
    n_sink = max(0, min(S, length - lp))
    if n_sink:
        x[lp : lp + n_sink] = sink[b, :n_sink].to(dtype)
    return x


def mla_decode_ref(
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
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same arguments and results as `mla_decode.mla_decode`: `o_lat: [B, H, Tq, d_c]`, `lse: [B, H, Tq]` (fp32).

    One batch row at a time, so a long context costs `[length, d_c + d_R]` of `dtype`, not `[B, length, ...]`.
    """
    B, H, Tq, d_c = q_lat.shape
    S, R = fmt.sink_tokens, fmt.recent_tokens
    o_out = torch.zeros((B, H, Tq, d_c), dtype=torch.float32, device=q_lat.device)
    lse_out = torch.full((B, H, Tq), float("-inf"), dtype=torch.float32, device=q_lat.device)
    lps = left_padding.tolist()
    for b in range(B):
        lp = int(lps[b])
        c = history_ref(content, fmt.content, sink_content, recent_content, b, lp, length, S, R, dtype)
        r = history_ref(rope, fmt.rope, sink_rope, recent_rope, b, lp, length, S, R, dtype)
        scores = (q_lat[b].to(dtype) @ c.T + q_rot[b].to(dtype) @ r.T) * scaling  # [H, Tq, length]
        pos = torch.arange(length, device=c.device)
        limit = length - Tq + 1 + torch.arange(Tq, device=c.device)
        visible = (pos[None, :] >= lp) & (pos[None, :] < limit[:, None])  # [Tq, length]
        scores = scores.masked_fill(~visible, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
        o_out[b] = (probs @ c).float()
        lse_out[b] = lse.float()
    return o_out, lse_out
