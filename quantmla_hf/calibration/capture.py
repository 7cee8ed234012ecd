"""Capture the inputs of one MLA attention module and replay the module on them.

`capture_inputs` runs the model on the calibration windows until the module's forward pre-hook fires, keeps the
hidden states `[N, T, hidden]` (and the other call arguments: RoPE tables, mask) and stops the forward there, so
only one module's activations are ever held. Fusion preserves the function, so capturing module `k` after modules
`< k` were fused gives the same inputs as before.

`run_attention` replays the module on captured inputs through its own forward (so every family's projections, RoPE
layout and scalings are the stock code), optionally with overridden weights (`torch.func.functional_call`) and a
`LatentHook` standing in for the cache: it sees, and may replace, the latent and RoPE key the module would cache.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable

import torch

from .offload import execution_device


class _Stop(Exception):
    pass


@dataclass
class CapturedInputs:
    """Inputs of one attention module on the calibration windows.

    Attributes:
        hidden: `[N, T, hidden]` hidden states entering the attention module (module device, fp32).
        args: positional arguments after the hidden states, from the first batch.
        kwargs: keyword arguments (RoPE tables `position_embeddings`, `attention_mask`, ...) of the first batch,
            rows sliced to the batch being replayed; the cache argument is removed.
        batch_size: windows per replayed batch (the first capture batch's size).
        cache_kwarg: the name under which the module's forward takes its cache.
    """

    hidden: torch.Tensor
    args: tuple
    kwargs: dict
    batch_size: int
    cache_kwarg: str
    hidden_in_kwargs: bool = False

    def batches(self, index: torch.Tensor | None = None):
        """Yield `(rows, hidden [b, T, hidden])` over `index` (all windows by default) in batches."""
        index = torch.arange(self.hidden.shape[0]) if index is None else index
        for i in range(0, index.numel(), self.batch_size):
            rows = index[i : i + self.batch_size]
            yield rows, self.hidden[rows.to(self.hidden.device)]


def _slice_rows(x, b: int, full: int):
    if isinstance(x, torch.Tensor):
        return x[:b] if x.dim() > 0 and x.shape[0] == full and b < full else x
    if isinstance(x, tuple):
        return tuple(_slice_rows(t, b, full) for t in x)
    return x


def _to(x, device, dtype):
    if isinstance(x, torch.Tensor):
        return x.to(device=device, dtype=dtype) if x.is_floating_point() else x.to(device)
    if isinstance(x, tuple):
        return tuple(_to(t, device, dtype) for t in x)
    return x


def cache_kwarg_name(module: torch.nn.Module) -> str:
    """`cache` (transformers >= 5.18) or `past_key_values` (5.17), as the module's forward spells it."""
    params = inspect.signature(module.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def module_device(module: torch.nn.Module) -> torch.device:
    return execution_device(module.kv_a_proj_with_mqa)


@torch.no_grad()
def capture_inputs(model: torch.nn.Module, module: torch.nn.Module, token_ids: torch.Tensor, batch_size: int,
                   dtype: torch.dtype = torch.float32) -> CapturedInputs:
    """Run `model` on `token_ids: [N, T]` in batches of `batch_size` and keep `module`'s inputs (stopping there)."""
    device = module_device(module)
    hidden, first = [], {}

    def hook(mod, args, kwargs):
        h = args[0] if args else kwargs["hidden_states"]
        hidden.append(h.detach().to(device=device, dtype=dtype))
        if not first:
            kw = {k: v for k, v in kwargs.items() if k not in ("cache", "past_key_values", "hidden_states", "use_cache")}
            first.update(args=tuple(args[1:]), kwargs=kw, in_kwargs=not args, batch=h.shape[0])
        raise _Stop

    handle = module.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        embed_device = execution_device(model.get_input_embeddings())
        for i in range(0, token_ids.shape[0], batch_size):
            try:
                model(input_ids=token_ids[i : i + batch_size].to(embed_device), use_cache=False)
            except _Stop:
                pass
    finally:
        handle.remove()
    if not hidden:
        raise ValueError(f"the model never called {type(module).__name__} (layer_idx={module.layer_idx}) on the calibration data")
    h = torch.cat(hidden, 0)
    if not torch.isfinite(h).all():
        raise ValueError(f"the inputs of attention layer {module.layer_idx} contain NaN or inf; check the model "
                         "weights and dtype (fp16 overflow?) before calibrating")
    return CapturedInputs(
        hidden=h,
        args=_to(first["args"], device, dtype),
        kwargs={k: _to(v, device, dtype) for k, v in first["kwargs"].items()},
        batch_size=first["batch"],
        cache_kwarg=cache_kwarg_name(module),
        hidden_in_kwargs=first["in_kwargs"],
    )


class LatentHook:
    """Stands in for the cache during a replay: `update(latent [B,1,T,d_c], k_rot [B,1,T,d_R], layer_idx)` records
    what the module would cache and returns `fn(latent, k_rot)` (identity by default) as the history."""

    def __init__(self, fn: Callable | None = None):
        self.fn = fn
        self.latent = self.k_rot = None

    def update(self, latent, k_rot, *args, **kwargs):
        self.latent, self.k_rot = latent, k_rot
        return (latent, k_rot) if self.fn is None else self.fn(latent, k_rot)


@dataclass
class AttentionRunner:
    """Replays one attention module on captured inputs in `dtype` (fp32 by default), with optional weights.

    Attributes:
        module: the MLA attention module.
        inputs: its captured inputs.
        params: fp32 copies of all the module's parameters (the base that overrides replace).
    """

    module: torch.nn.Module
    inputs: CapturedInputs
    dtype: torch.dtype = torch.float32
    params: dict = field(default_factory=dict)

    def __post_init__(self):
        self.params = {k: v.detach().to(self.dtype) for k, v in self.module.named_parameters()}

    def __call__(self, hidden: torch.Tensor, overrides: dict | None = None, hook: LatentHook | None = None,
                 attention_mask: torch.Tensor | None = None):
        """Attention output after `o_proj`, `[b, T, hidden]`, for `hidden: [b, T, hidden]`.

        `attention_mask` (additive, `[1, 1, T, kv_len]`) replaces the captured mask, for a hook whose history is
        not the plain causal one (the protection-aware content objective, `protection.py`).
        """
        b, full = hidden.shape[0], self.inputs.batch_size
        args = _slice_rows(self.inputs.args, b, full)
        kwargs = {k: _slice_rows(v, b, full) for k, v in self.inputs.kwargs.items()}
        if attention_mask is not None:
            if "attention_mask" not in kwargs:
                raise ValueError(f"{type(self.module).__name__} takes no attention_mask keyword; the protection-aware "
                                 "objective cannot run on it (calibrate with calibration_protection off)")
            kwargs["attention_mask"] = attention_mask.expand(b, -1, -1, -1)
        kwargs[self.inputs.cache_kwarg] = hook
        if self.inputs.hidden_in_kwargs:
            kwargs["hidden_states"] = hidden
            call_args = args
        else:
            call_args = (hidden, *args)
        params = {**self.params, **(overrides or {})}
        out = torch.func.functional_call(self.module, params, call_args, kwargs)
        return out[0] if isinstance(out, tuple) else out
