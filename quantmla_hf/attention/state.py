"""Forward hooks that connect a model to the `QuantMLACache` of the forward in flight.

A pre-hook on the top-level model sees the cache and the 2D attention mask that `generate` (or the user) passes:
- before the first tokens are cached it records each row's left padding, so the sink tokens are the first real
  tokens of every row, not padding;
- it shares the cache with the MLA attention modules, which the "quantmla" attention implementation reads;
- it records whether the forward asks for attention weights (`output_attentions`), which that implementation then
  computes eagerly (latent-space decode off for that forward);
- it forgets the previous forward's mask check (the first MLA layer checks the new mask, once for all layers).
Nothing here synchronises with the device on a decode step: a static cache reports whether it holds tokens from a
host-side flag (only the prefill of a reused static cache reads its new left padding back, once).
A decode step replayed from a CUDA graph (`quantmla_hf.generation.graphs`) runs no hook at all.
The hook sits on the model and on its base model (`model.model`), so a direct call to the latter is seen too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache.growing import QuantMLACache, cache_argument

ATTN_IMPLEMENTATION = "quantmla"


@dataclass
class QuantMLAState:
    """Shared by the MLA modules of one model: the cache of the forward in flight, and whether the attention mask
    of that forward is plain left padding + causal (checked once per forward, not once per layer)."""

    cache: QuantMLACache | None = None
    mask_key: tuple | None = None
    mask_is_padding_causal: bool = False
    # The forward in flight asked for attention weights (`output_attentions`): attend eagerly, return them.
    output_attentions: bool = False


def is_mla_attention(module: torch.nn.Module) -> bool:
    """True for the MLA attention modules of the supported families."""
    return all(hasattr(module, a) for a in ("kv_a_proj_with_mqa", "kv_b_proj", "kv_a_layernorm", "layer_idx"))


def mla_attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if is_mla_attention(m)]


def _pre_forward(model, args, kwargs):
    cache = cache_argument(kwargs)
    state: QuantMLAState = model._quantmla_state
    state.cache = cache if isinstance(cache, QuantMLACache) else None
    state.mask_key = None  # the mask check is made once per forward (masks.layer_mask_is_padding_causal)
    output_attentions = kwargs.get("output_attentions")
    state.output_attentions = bool(
        output_attentions if output_attentions is not None else getattr(model.config, "output_attentions", False)
    )
    if state.cache is None:
        return None
    # Latent-space decode only under the "quantmla" implementation (read at every forward, so switching with
    # set_attn_implementation takes effect at once), and not when attention weights are asked for.
    state.cache.set_native(model.config._attn_implementation == ATTN_IMPLEMENTATION and not state.output_attentions)
    mask = kwargs.get("attention_mask")
    # A static cache answers from a host-side flag: its length lives on the device.
    holds = getattr(state.cache, "holds_tokens", None)
    empty = not holds() if holds is not None else state.cache.get_seq_length() == 0
    if empty and isinstance(mask, torch.Tensor) and mask.dim() == 2:
        state.cache.set_left_padding(mask)
    elif empty and isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.dtype == torch.bool:
        # generate builds the 4D mask itself for compileable (static) caches: the last query row of a left-padded
        # causal mask sees exactly the real tokens, from each row's first one.
        state.cache.set_left_padding(mask[:, 0, -1, :])
    return None


def install_cache_hooks(model: torch.nn.Module) -> QuantMLAState:
    """Install (once) the pre-forward hook on `model` and share its state with every MLA attention module."""
    state = getattr(model, "_quantmla_state", None)
    if state is not None:
        return state
    modules = mla_attention_modules(model)
    if not modules:
        raise ValueError(
            f"{type(model).__name__} has no MLA attention module (with kv_a_proj_with_mqa, kv_a_layernorm and "
            "kv_b_proj); QuantMLA only applies to Multi-head Latent Attention models"
        )
    state = QuantMLAState()
    model._quantmla_state = state
    for m in modules:
        m._quantmla_state = state
    # Also on the base model (`model.model` of a head), which receives the same cache and mask: a direct call to it
    # then updates the state too, instead of leaving the previous forward's cache in it.
    base = getattr(model, "base_model", model)
    for hooked in (model, base) if base is not model else (model,):
        hooked._quantmla_state = state
        hooked.register_forward_pre_hook(_pre_forward, with_kwargs=True)
    return state
