"""Capture the inputs of one MLA attention module and replay the module on them.

`capture_inputs` runs the model on the calibration windows until the module's forward pre-hook fires, keeps the
hidden states `[N, T, hidden]` (and the other call arguments: RoPE tables, mask) and stops the forward there, so
only one module's activations are ever held. Fusion preserves the function, so capturing module `k` after modules
`< k` were fused gives the same inputs as before.

`AttentionRunner` replays the module on captured inputs through its own forward (so every family's projections, RoPE
layout and scalings are the stock code), optionally with overridden weights (`torch.func.functional_call`) and a
`LatentHook` standing in for the cache: it sees, and may replace, the latent and RoPE key the module would cache.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from .offload import execution_device


class _Stop(Exception):
    pass


@dataclass
class CapturedInputs:
    """Inputs of one attention module on the calibration windows.

    Attributes:
        hidden: `[N, T, hidden]` hidden states entering the module, on its device, stored in the dtype the model
            computed them in (a bf16 model's activations are bf16 values: keeping them so halves their memory and
            loses nothing); `batches` and `select` hand them out in `compute_dtype`.
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
    compute_dtype: torch.dtype = torch.float32

    def select(self, rows: torch.Tensor) -> torch.Tensor:
        """`hidden[rows]` in `compute_dtype`: `[len(rows), T, hidden]`."""
        return self.hidden[rows.to(self.hidden.device)].to(self.compute_dtype)

    def batches(self, index: torch.Tensor | None = None):
        """Yield `(rows, hidden [b, T, hidden])` over `index` (all windows by default) in batches."""
        index = torch.arange(self.hidden.shape[0]) if index is None else index
        for i in range(0, index.numel(), self.batch_size):
            rows = index[i : i + self.batch_size]
            yield rows, self.select(rows)

    def call(self, module: torch.nn.Module, hidden: torch.Tensor, **extra):
        """`module(hidden, *args, **kwargs, **extra)` with the captured arguments sliced to `hidden`'s rows."""
        b = hidden.shape[0]
        args = _slice_rows(self.args, b, self.batch_size)
        kwargs = {k: _slice_rows(v, b, self.batch_size) for k, v in self.kwargs.items()}
        kwargs.update(extra)
        if self.hidden_in_kwargs:
            return module(*args, hidden_states=hidden, **kwargs)
        return module(hidden, *args, **kwargs)


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
    """`cache` (transformers >= 5.24) or `past_key_values` (earlier), as the module's forward spells it."""
    params = inspect.signature(module.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _keep_call(store: dict, hidden: list, device, dtype):
    """A forward pre-hook that stores the hidden states (and, once, the other arguments) and stops the forward."""

    def hook(mod, args, kwargs):
        h = args[0] if args else kwargs["hidden_states"]
        hidden.append(h.detach().to(device=device, dtype=dtype or h.dtype))
        if not store:
            kw = {k: v for k, v in kwargs.items() if k not in ("cache", "past_key_values", "hidden_states", "use_cache")}
            store.update(args=tuple(args[1:]), kwargs=kw, in_kwargs=not args, batch=h.shape[0])
        raise _Stop

    return hook


def _captured(module, hidden: list, first: dict, device, what: str) -> CapturedInputs:
    """The `CapturedInputs` of `module` from what `_keep_call` kept; `what` names the module in errors."""
    if not hidden:
        raise ValueError(f"the model never called {type(module).__name__} ({what}) on the calibration data")
    h = torch.cat(hidden, 0)
    if not torch.isfinite(h).all():
        raise ValueError(f"the inputs of {what} contain NaN or inf; check the model weights and dtype (fp16 "
                         "overflow?) before calibrating")
    # Floating arguments (RoPE tables, masks) follow the stored hidden states' dtype; compute casts them again.
    return CapturedInputs(
        hidden=h,
        args=_to(first["args"], device, h.dtype),
        kwargs={k: _to(v, device, h.dtype) for k, v in first["kwargs"].items()},
        batch_size=first["batch"],
        cache_kwarg=cache_kwarg_name(module),
        hidden_in_kwargs=first["in_kwargs"],
    )


def _inputs_of(module: torch.nn.Module, device, dtype, batches, run, what: str) -> CapturedInputs:
    """Call `run(batch)` for every batch of `batches` with a hook on `module` that keeps its inputs (hidden
    states on `device` in `dtype`, or their own dtype when None) and stops the forward there."""
    hidden, first = [], {}
    handle = module.register_forward_pre_hook(_keep_call(first, hidden, device, dtype), with_kwargs=True)
    try:
        for batch in batches:
            try:
                run(batch)
            except _Stop:
                pass
    finally:
        handle.remove()
    return _captured(module, hidden, first, device, what)


@torch.no_grad()
def capture_inputs(model: torch.nn.Module, module: torch.nn.Module, token_ids: torch.Tensor, batch_size: int,
                   dtype: torch.dtype | None = torch.float32, device: torch.device | None = None) -> CapturedInputs:
    """Run `model` on `token_ids: [N, T]` in batches of `batch_size` and keep `module`'s inputs (stopping there).

    `dtype=None` keeps the hidden states in the dtype the model computed them in; `device` defaults to the
    execution device of `module`'s `kv_a_proj_with_mqa` (an attention module) or of `module`'s first parameter.
    """
    device = device if device is not None else module_device(module)
    embed_device = execution_device(model.get_input_embeddings())
    return _inputs_of(module, device, dtype, token_ids.split(batch_size),
                      lambda ids: model(input_ids=ids.to(embed_device), use_cache=False),
                      f"layer_idx={getattr(module, 'layer_idx', '?')}")


@torch.no_grad()
def capture_within(layer: torch.nn.Module, layer_inputs: CapturedInputs, module: torch.nn.Module) -> CapturedInputs:
    """Run decoder `layer` on its captured inputs, batch by batch, until `module` (inside it) is called; keep
    `module`'s inputs in the layer inputs' dtype (`[N, T, hidden]`) on `module`'s execution device."""
    return _inputs_of(module, module_device(module), None, layer_inputs.hidden.split(layer_inputs.batch_size),
                      lambda h: layer_inputs.call(layer, h),
                      f"attention layer {getattr(module, 'layer_idx', '?')}")


@torch.no_grad()
def propagate(layer: torch.nn.Module, layer_inputs: CapturedInputs) -> torch.Tensor:
    """The outputs `[N, T, hidden]` of decoder `layer` on its captured inputs, batch by batch, in their dtype:
    the next layer's inputs."""
    out = []
    for i in range(0, layer_inputs.hidden.shape[0], layer_inputs.batch_size):
        o = layer_inputs.call(layer, layer_inputs.hidden[i : i + layer_inputs.batch_size])
        o = o[0] if isinstance(o, tuple) else o
        out.append(o.to(device=layer_inputs.hidden.device, dtype=layer_inputs.hidden.dtype))
    h = torch.cat(out, 0)
    if not torch.isfinite(h).all():
        raise ValueError("a decoder layer's outputs on the calibration data contain NaN or inf; check the model "
                         "weights and dtype (fp16 overflow?) before calibrating")
    return h


def module_device(module: torch.nn.Module) -> torch.device:
    """The execution device of an attention module (its `kv_a_proj_with_mqa`) or of any module's first weight."""
    if hasattr(module, "kv_a_proj_with_mqa"):
        return execution_device(module.kv_a_proj_with_mqa)
    hook = getattr(module, "_hf_hook", None)
    if getattr(hook, "execution_device", None) is not None:
        return torch.device(hook.execution_device)
    for sub in module.modules():
        h = getattr(sub, "_hf_hook", None)
        if getattr(h, "execution_device", None) is not None:
            return torch.device(h.execution_device)
    p = next(module.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


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
        # Replays compute in `dtype`: the captured RoPE tables and masks too, and the hidden states per batch.
        device = self.inputs.hidden.device
        self.inputs = replace(self.inputs, args=_to(self.inputs.args, device, self.dtype),
                              kwargs={k: _to(v, device, self.dtype) for k, v in self.inputs.kwargs.items()},
                              compute_dtype=self.dtype)

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


def decoder_layers(model: torch.nn.Module, modules: list[torch.nn.Module]) -> list[tuple[torch.nn.Module, list]]:
    """`[(decoder layer, [its MLA attention modules in call order])]` for the layers that hold `modules`.

    The layers are the elements of the model's `ModuleList` that contains every module of `modules`
    (`model.model.layers` in every supported family; LongCat's two attention modules sit in one layer).
    """
    names = {id(m): name for name, m in model.named_modules()}
    wanted = [names[id(m)] for m in modules]
    for name, sub in model.named_modules():
        if isinstance(sub, torch.nn.ModuleList) and all(w.startswith(f"{name}.") for w in wanted):
            out = []
            for i, layer in enumerate(sub):
                inside = [m for m, w in zip(modules, wanted) if w.startswith(f"{name}.{i}.")]
                if inside:
                    out.append((layer, inside))
            return out
    raise ValueError(f"{type(model).__name__}: its MLA attention modules are not inside one list of decoder layers "
                     "(model.model.layers); layer-by-layer calibration cannot run on it")
