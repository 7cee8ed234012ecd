"""Latent-space attention of a multi-token chunk with a per-query recent window (speculative decoding = greedy).

One-token decoding at position `p` reads the sink tokens and the positions `[p + 1 - R, p]` from their model-dtype
copies and everything else from the packed low-bit copies. A chunk of `Tq` tokens (assisted generation, prompt
lookup and any draft verification feed `k + 1` tokens at once) must give each of its queries exactly that view, or
verification accepts tokens the model would not have produced one at a time. The cache's recent ring only holds the
window of the LAST position, so `QuantMLALayer.update` keeps, for chunks of at most `CHUNK_WINDOW_MAX_QUERY` tokens,
the model-dtype rows of positions `[max(0, start - R), start + Tq)` (`QuantMLALayer.chunk_window`: the ring before the
chunk was written plus the chunk itself). Here each query `t` (position `p_t = start + t`) then sees

    position j in [lp, lp + S)                 -> sink copy                      (as one-token decoding)
    position j in [p_t + 1 - R, p_t]           -> model-dtype row of chunk_window (its own recent window)
    any other position j in [lp, p_t]          -> packed copy, dequantized as the decode kernels read it
    j < lp (left padding) or j > p_t           -> not attended

with one fp32 softmax per query, as `kernels/mla_decode_ref.mla_decode_ref` computes a single-token step.
This is plain PyTorch (one batch row at a time, `[Tq, L]` scores per head); it serves verification chunks, which are
short, and leaves single-token decoding and long prefill chunks to the kernels and SDPA.
"""

from __future__ import annotations

import torch

from ..kernels.mla_decode_ref import history_ref
from .decode import expand_latent, latent_query, latent_weights


def chunk_window_attention(module, layer, query: torch.Tensor, scaling: float) -> torch.Tensor:
    """Absorbed attention of `query: [B, H, Tq, d_nope + d_R]` for the chunk `layer` just stored; `[B, Tq, H, d_v]`.

    `layer.chunk_window` is `(lo, content [B, L - lo, d_c], rope [B, L - lo, d_R])` in the model dtype (rope rows as
    stored, i.e. rotated when the layer has `rope_rotation`); the caller checked that the mask is left padding +
    causal (`attention._mask_is_padding_causal`).
    """
    lo, win_c, win_r = layer.chunk_window
    B, H, Tq, _ = query.shape
    L, fmt = layer.length, layer.fmt
    S, R = fmt.sink_tokens, fmt.recent_tokens
    q_nope, q_rot, w_uk, w_uv = latent_weights(module, query)
    # As `attention.latent_decode_attention`: the latent query in the model dtype, the rotated RoPE query.
    q_lat, q_rot = latent_query(layer, q_nope, q_rot, w_uk)
    q_lat, q_rot = q_lat.float(), q_rot.float()  # [B, H, Tq, d_c], [B, H, Tq, d_R]
    pos = torch.arange(L, device=query.device)
    query_pos = L - Tq + torch.arange(Tq, device=query.device)  # p_t
    # Positions each query reads from the model-dtype window: [p_t + 1 - R, p_t]; with R = 0 one-token decoding
    # still reads its own token exactly (it is the new token, not yet read back from the cache).
    own_window = (pos[None, :] > query_pos[:, None] - max(R, 1)) & (pos[None, :] >= lo)  # [Tq, L]
    o_lat = torch.zeros((B, H, Tq, fmt.content.dim), dtype=torch.float32, device=query.device)
    length = torch.tensor([L], device=query.device)
    paths = ((layer.content.planes, fmt.content, layer.sink_content, layer.recent_content),
             (layer.rope.planes, fmt.rope, layer.sink_rope, layer.recent_rope))
    for b in range(B):
        lp, row = int(layer.left_padding[b]), slice(b, b + 1)
        # Packed copies with the sink overlaid (no recent ring: R=0), exactly as the decode reference reads them.
        c, r = (history_ref({k: v[row, :L] for k, v in planes.items()}, path_fmt, sink_copy[row], ring[row],
                            layer.left_padding[row], length, S, 0)[0] for planes, path_fmt, sink_copy, ring in paths)
        c_win, r_win = c.clone(), r.clone()
        c_win[lo:L], r_win[lo:L] = win_c[b].float(), win_r[b].float()
        sink = (pos >= lp) & (pos < lp + S)
        # Sink positions read the sink copy whatever the window says (one-token decoding does the same).
        use_window = own_window & ~sink[None, :]  # [Tq, L]
        scores_packed = q_lat[b] @ c.T + q_rot[b] @ r.T  # [H, Tq, L]
        scores_window = q_lat[b] @ c_win.T + q_rot[b] @ r_win.T
        scores = torch.where(use_window, scores_window, scores_packed) * scaling
        visible = (pos[None, :] >= lp) & (pos[None, :] <= query_pos[:, None])  # [Tq, L]
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # an all-padding row attends to nothing
        o_lat[b] = (probs * ~use_window) @ c + (probs * use_window) @ c_win
    return expand_latent(o_lat, w_uv, query.dtype)
