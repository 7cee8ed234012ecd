"""Reference MLA attention in the absorbed latent space (plain PyTorch, fp32 arithmetic).

Stock transformers expands every cached latent into per-head keys and values through `kv_b_proj`. Absorption
instead folds `W_UK` into the query and `W_UV` into the output, so the cached latent is read as it is:

    q_lat[b, h, t]  = W_UK[h]^T q_nope[b, h, t]                                  [B, H, Tq, d_c]
    score[b, h, t, j] = (q_lat . c[b, j] + q_rot[b, h, t] . k_R[b, j]) * scaling
    p = softmax_j(score + mask)                                                  one softmax over all tokens
    o_lat[b, h, t]  = sum_j p[b, h, t, j] c[b, j]                                [B, H, Tq, d_c]
    out[b, t, h]    = W_UV[h] o_lat[b, h, t]                                     [B, Tq, H, d_v]

`kv_b_proj.weight` is `[H * (d_nope + d_v), d_c]`; per head its first `d_nope` rows are `W_UK[h]` and the
remaining `d_v` rows `W_UV[h]`.
"""

from __future__ import annotations

import torch


def split_kv_b(kv_b_weight: torch.Tensor, num_heads: int, nope_dim: int, v_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`kv_b_proj.weight: [H * (d_nope + d_v), d_c]` -> `W_UK: [H, d_nope, d_c]`, `W_UV: [H, d_v, d_c]`."""
    w = kv_b_weight.view(num_heads, nope_dim + v_dim, -1)
    return w[:, :nope_dim], w[:, nope_dim:]


def causal_mask(q_len: int, kv_len: int, device) -> torch.Tensor:
    """Bool mask `[1, 1, q_len, kv_len]`: query t (the last q_len positions) sees keys up to its own position."""
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    return (torch.arange(kv_len, device=device)[None, :] <= q_pos)[None, None]


def absorbed_attention_ref(
    q_nope: torch.Tensor,
    q_rot: torch.Tensor,
    content: torch.Tensor,
    k_rot: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scaling: float,
    attention_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of `Tq` queries over `N` cached tokens, computed in the latent space.

    Args:
        q_nope: `[B, H, Tq, d_nope]` content part of the queries.
        q_rot: `[B, H, Tq, d_R]` post-RoPE part of the queries.
        content: `[B, N, d_c]` cached content latents (as attention must see them: protected or dequantized).
        k_rot: `[B, N, d_R]` cached post-RoPE keys.
        w_uk, w_uv: `[H, d_nope, d_c]`, `[H, d_v, d_c]` from `split_kv_b`.
        scaling: softmax scale (the module's `scaling`, YaRN mscale included).
        attention_mask: `[B or 1, 1, Tq, N]`, bool (True = attend) or additive float; `None` means causal.

    Returns:
        `out: [B, Tq, H, d_v]` in the dtype of `q_nope`, and `lse: [B, H, Tq]` (fp32, natural log, of the scaled
        scores), the log-sum-exp a split-K kernel combines partial results with.
    """
    B, H, Tq, _ = q_nope.shape
    N = content.shape[1]
    c, r = content.float(), k_rot.float()
    q_lat = torch.einsum("bhtn,hnc->bhtc", q_nope.float(), w_uk.float())
    scores = (torch.einsum("bhtc,bjc->bhtj", q_lat, c) + torch.einsum("bhtr,bjr->bhtj", q_rot.float(), r)) * scaling
    mask = causal_mask(Tq, N, scores.device) if attention_mask is None else attention_mask[..., -N:]
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    else:
        scores = scores + mask.float()
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)  # a fully masked row (padding) gives zeros
    o_lat = torch.einsum("bhtj,bjc->bhtc", probs, c)
    out = torch.einsum("bhtc,hvc->bthv", o_lat, w_uv.float())
    return out.to(q_nope.dtype), lse
