"""Every method QuantMLA overrides on a transformers model, and why: the class of a prepared model.

`attach(model)` gives a model the class `quantmla_class(type(model))`: a subclass of its own class, with the same
name (so `save_pretrained` writes the same architecture into config.json), whose methods below call transformers'
and change only what their line says; `detach(model)` gives it its own class back (`model.dequantize()`).

`generate` and its continuous-batching API:

    _prepare_cache_for_generation  Where every release from 5.17 decides the cache of a `generate` call. With no
                                   cache given, no `use_cache=False` and no `cache_implementation`, the cache is
                                   QuantMLA's: static with decode steps replayed from CUDA graphs, static compiled by
                                   transformers, or growing (`generation.plan.generation_cache` decides).
    get_compiled_call              The decode forward `generate` runs on a compileable cache: the replayed
                                   `generation.graphs.DecodeGraphStep` where the call's plan chose graphs, else
                                   transformers' `torch.compile`.
    create_masks_for_generate      `generate` builds a 4D mask before every step of a compileable cache; a replayed
                                   step reads none (the kernels mask padding and causality), so it gets the mask its
                                   graph holds instead of a new one (`generation.graphs.masks_for_generate`).
    _get_candidate_generator       Assisted generation and prompt lookup: the only place that sees where a
                                   verification's drafts start. Refuses what cannot equal greedy decoding and has the
                                   generator mark each verification on the cache (`generation.speculative`).
    init_continuous_batching,      `generate_batch` and `continuous_batching_context_manager` get their manager here:
    destroy_cached_continuous_     the paged packed cache's (`serving.continuous_api`) in the releases whose API it
      batching_manager             serves; outside them these and the two below refuse, naming `quantmla serve`.
    generate_batch,
    continuous_batching_context_manager

Saving and dtype:

    save_pretrained, push_to_hub   atomic writes with the QuantMLA model card, uploading exactly what a save wrote
                                   (`saving.hub`).
    half, float, bfloat16          as `.to(dtype)`: the weights are ordinary tensors (transformers refuses these
                                   casts for every quantized model, since most quantize the weights).

Not a method: the forward pre-hook that hands each forward's cache to the attention modules
(`attention.state.install_cache_hooks`), and the attention function itself ("quantmla", `attention.interface`).
"""

from __future__ import annotations

import inspect

import torch
from transformers.masking_utils import create_masks_for_generate

from .cache.growing import CACHE_KWARG, QuantMLACache, cache_argument
from .generation.graphs import compiled_call, masks_for_generate
from .generation.plan import check_static_cache_length, generation_cache, plan_for_given_cache
from .generation.speculative import check_draft_verification, mark_verifications
from .saving import hub
from .serving import continuous_api


class QuantMLAModel:
    """The overrides of a prepared model's class (see the module docstring); first in its bases."""

    # ---------------------------------------------------------------------------------------- generate
    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        self.__dict__.pop("_quantmla_graph_step", None)  # the previous call's step object: its masks are not ours
        ours = None
        if (
            model_kwargs.get(CACHE_KWARG) is None
            and generation_config.use_cache is not False
            and generation_config.cache_implementation is None
        ):
            check_static_cache_length(self, generation_config, args, kwargs)
            ours = model_kwargs[CACHE_KWARG] = generation_cache(self, generation_config, model_kwargs, args, kwargs)
        else:
            # A cache the caller passes: CUDA graphs for a StaticQuantMLACache where the call allows them.
            self._quantmla_decode_plan = plan_for_given_cache(self, generation_config, model_kwargs, args, kwargs)
        out = super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        if ours is not None:
            # The stock code marks any cache it finds as the caller's, which only changes when generate may stop
            # early without syncing; ours is generate's own, as a DynamicCache would be.
            ours._is_user_defined = False
        return out

    def get_compiled_call(self, compile_config):
        return compiled_call(self, super().get_compiled_call, compile_config)

    def create_masks_for_generate(self, **kwargs):
        # The model class's own mask builder (a method or a staticmethod), else transformers' function.
        stock = getattr(super(), "create_masks_for_generate", None) or create_masks_for_generate
        return masks_for_generate(self, stock, **kwargs)

    def _get_candidate_generator(self, *args, **kwargs):
        call = inspect.signature(super()._get_candidate_generator).bind(*args, **kwargs).arguments
        cache = cache_argument(call.get("model_kwargs") or {})
        if not isinstance(cache, QuantMLACache):
            return super()._get_candidate_generator(*args, **kwargs)
        check_draft_verification(self, cache, call["generation_config"])
        return mark_verifications(super()._get_candidate_generator(*args, **kwargs), cache)

    def init_continuous_batching(self, generation_config=None, continuous_batching_config=None, workload_hints=None,
                                 **kwargs):
        continuous_api.check_supported("init_continuous_batching")
        return continuous_api.init_continuous_batching(self, generation_config, continuous_batching_config,
                                                       workload_hints)

    def destroy_cached_continuous_batching_manager(self) -> None:
        continuous_api.destroy_cached_manager(self)

    def generate_batch(self, *args, **kwargs):
        continuous_api.check_supported("generate_batch")
        return super().generate_batch(*args, **kwargs)

    def continuous_batching_context_manager(self, *args, **kwargs):
        continuous_api.check_supported("continuous_batching_context_manager")
        return super().continuous_batching_context_manager(*args, **kwargs)

    # ---------------------------------------------------------------------------------------- saving, dtype
    def save_pretrained(self, save_directory, *args, **kwargs):
        return hub.save_pretrained(self, super().save_pretrained, save_directory, *args, **kwargs)

    def push_to_hub(self, repo_id: str, **kwargs):
        return hub.push_to_hub(self, super().save_pretrained, repo_id, **kwargs)

    def half(self):
        return torch.nn.Module.half(self)

    def float(self):
        return torch.nn.Module.float(self)

    def bfloat16(self):
        return torch.nn.Module.bfloat16(self)


_CLASSES: dict[type, type] = {}


def quantmla_class(cls: type) -> type:
    """The class of a prepared `cls` model: `QuantMLAModel` first, then `cls`, named as `cls` (made once per class)."""
    if issubclass(cls, QuantMLAModel):
        return cls
    if cls not in _CLASSES:
        _CLASSES[cls] = type(cls.__name__, (QuantMLAModel, cls),
                             {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "_stock_class": cls})
    return _CLASSES[cls]


def attach(model) -> None:
    """Give `model` its QuantMLA class (in place; once)."""
    model.__class__ = quantmla_class(type(model))


def detach(model) -> None:
    """Give `model` its own class back, destroying a continuous-batching manager kept on it."""
    if isinstance(model, QuantMLAModel):
        continuous_api.destroy_cached_manager(model)
        model.__class__ = type(model)._stock_class
