"""The one attention mask the QuantMLA decode kernels apply themselves: left padding + causal.

The kernels take each row's left padding (`[B]`) and the number of cached positions, not a mask. A decode step may
therefore skip the mask only when the mask it was given is exactly that one; `mask_is_padding_causal` is the check
(the growing cache's eager step, the static cache's eager step and, once per generation, the CUDA-graph step all
make it here).
"""

from __future__ import annotations

import torch


def expected_mask(left_padding: torch.Tensor, q_len: int, kv_len: int) -> torch.Tensor:
    """Bool `[B, q_len, kv_len]`: row b, query t sees positions `[left_padding[b], kv_len - q_len + t]`."""
    pos = torch.arange(kv_len, device=left_padding.device)
    limit = kv_len - q_len + 1 + torch.arange(q_len, device=left_padding.device)
    return (pos[None, None, :] >= left_padding[:, None, None]) & (pos[None, None, :] < limit[None, :, None])


def mask_is_padding_causal(left_padding: torch.Tensor, max_left_padding: int, attention_mask, q_len: int,
                           kv_len: int) -> bool:
    """Whether `attention_mask` (`[B, 1, q_len, K]` bool with `K >= kv_len`, or None) is left padding + causal over
    the first `kv_len` key positions and hides every position past them (a static cache's mask spans its whole
    capacity). None means causal without padding. Synchronises with the device once."""
    if attention_mask is None:
        return max_left_padding == 0
    if (
        attention_mask.dtype != torch.bool or attention_mask.dim() != 4 or attention_mask.shape[-1] < kv_len
        or attention_mask.shape[-2] not in (1, q_len)
    ):
        return False
    want = expected_mask(left_padding.to(attention_mask.device), q_len, kv_len)
    rows = attention_mask[:, 0]
    if attention_mask.shape[-1] == kv_len:
        return bool(torch.equal(rows.expand_as(want), want))
    return bool(torch.equal(rows[..., :kv_len].expand_as(want), want)) and not bool(rows[..., kv_len:].any())


def layer_mask_is_padding_causal(state, layer, attention_mask, q_len: int, kv_len: int) -> bool:
    """`mask_is_padding_causal` for a cache `layer` (its left padding, `kv_len` positions), checked once per
    forward: the answer is kept in `state` (the `QuantMLAState` the MLA modules of a model share: `mask_key`,
    `mask_is_padding_causal`) for the other layers, keyed by the mask tensor, its version, the length and the
    padding tensor."""
    if attention_mask is None or state is None:
        return mask_is_padding_causal(layer.left_padding, layer.max_left_padding, attention_mask, q_len, kv_len)
    key = (attention_mask.data_ptr(), attention_mask._version, tuple(attention_mask.shape), kv_len,
           layer.left_padding.data_ptr(), layer.max_left_padding)
    if state.mask_key != key:
        state.mask_key = key
        state.mask_is_padding_causal = mask_is_padding_causal(
            layer.left_padding, layer.max_left_padding, attention_mask, q_len, kv_len
        )
    return state.mask_is_padding_causal
