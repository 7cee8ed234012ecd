"""Which cache `generate` builds for a QuantMLA model, and when decode is compiled (issue #10).

`generate` with no cache and no `cache_implementation` gets
- a `StaticQuantMLACache` of `max_length - 1` positions (rounded up to 256) when `static_cache_wanted` says so:
  then transformers compiles the decode step itself (`is_compileable`), as for its own static cache, on CUDA, or
  wherever `compile_config._compile_all_devices` is set; `compile_config=CompileConfig(...)` tunes it and
  `disable_compile=True` keeps the static cache eager (still without host synchronisation per step);
- the growing `QuantMLACache` otherwise.

By default ("auto") the static cache is used when the call asks for compilation (`compile_config=...`) and it is
safe (one CUDA device, "quantmla" attention, a recent window). It is not the default for every call: compiled,
a 27-layer C4R4 step takes 4.1 ms at B1 4K against 65-74 ms eager (docs/BENCHMARKS.md), but every new batch size
or length bucket compiles again (~40 s at that depth), which a single or varying-shape call does not earn back.
`QuantMLAConfig(static_cache=True)` (a config option, validated and saved) makes every call use it (and compile on
CUDA).

The static cache of the last call is kept on the model and reused (reset in place) when the batch size, dtype and
device match and it is long enough, so repeated calls of one shape replay the same compiled graph.
"""

from __future__ import annotations

import torch

from .config import QuantMLAConfig
from .static_cache import StaticQuantMLACache

LENGTH_ROUNDING = 256


def _qconfig(model) -> QuantMLAConfig:
    from .integration import _model_qconfig

    return _model_qconfig(model)


def static_cache_wanted(model, qconfig: QuantMLAConfig, generation_config=None) -> bool:
    """`QuantMLAConfig(static_cache=True/False)` decides; by default ("auto") the static cache is used when the
    call passes a `compile_config` and it is safe: a model on one CUDA device (no CPU/disk offload), the
    "quantmla" attention implementation and a recent window of at least one token."""
    choice = qconfig.static_cache  # validated by QuantMLAConfig: "auto", True or False
    if choice is False:
        return False
    usable = qconfig.recent_tokens >= 1 and model.config._attn_implementation == "quantmla"
    if choice is True:
        if not usable:
            raise ValueError(
                "static_cache=True needs recent_tokens >= 1 and attn_implementation='quantmla' "
                f"(got recent_tokens={qconfig.recent_tokens}, attn_implementation="
                f"{model.config._attn_implementation!r})"
            )
        return True
    devices = set(getattr(model, "hf_device_map", {}).values()) if hasattr(model, "hf_device_map") else set()
    offloaded = bool(devices & {"cpu", "disk"})
    asked = generation_config is not None and getattr(generation_config, "compile_config", None) is not None
    return asked and usable and model.device.type == "cuda" and not offloaded


def generation_cache(model, generation_config, args: tuple, kwargs: dict):
    """The cache `generate` uses when the caller gives none (see the module docstring)."""
    from .integration import build_cache

    qconfig = _qconfig(model)
    if not static_cache_wanted(model, qconfig, generation_config):
        return build_cache(model)
    # transformers calls _prepare_cache_for_generation(generation_config, model_kwargs, generation_mode,
    # batch_size, max_cache_length) in every release from 5.17 on.
    batch_size = kwargs.get("batch_size", args[1] if len(args) > 1 else None)
    needed = kwargs.get("max_cache_length", args[2] if len(args) > 2 else generation_config.max_length)
    if batch_size is None:
        return build_cache(model)
    length = -(-int(needed) // LENGTH_ROUNDING) * LENGTH_ROUNDING
    cache = getattr(model, "_quantmla_static_cache", None)
    if (
        isinstance(cache, StaticQuantMLACache)
        and cache.max_cache_len >= length
        and cache.quantization_config is qconfig
        and _compatible(cache, batch_size, model)
    ):
        cache.reset()
        return cache
    cache = StaticQuantMLACache(
        config=model.config.get_text_config(decoder=True), quantization_config=qconfig, max_cache_len=length
    )
    model._quantmla_static_cache = cache
    return cache


def _compatible(cache: StaticQuantMLACache, batch_size: int, model) -> bool:
    layer = cache.layers[0]
    if not layer.is_initialized:
        return True
    return layer.content.batch_size == batch_size and layer.dtype == model.dtype and layer.device == model.device
