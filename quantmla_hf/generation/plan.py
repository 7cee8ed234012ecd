"""Which cache `generate` builds for a QuantMLA model, and how its decode steps run.

`generate` with no cache and no `cache_implementation` gets
- a `StaticQuantMLACache` whose decode steps replay from CUDA graphs (`quantmla_hf.generation.graphs`) where
  `plan_decode` says so: the default on CUDA (one device, a tensor-parallel rank, or a device map over several GPUs
  without offloaded layers; `QuantMLAConfig(advanced={"decode_graphs": "auto"})`);
- a `StaticQuantMLACache` compiled by transformers (`torch.compile`, reduce-overhead) when the call passes
  `compile_config=...` (or `QuantMLAConfig(advanced={"static_cache": True})` without graphs): `static_cache_wanted`;
- the growing `QuantMLACache` otherwise (CPU, CPU/disk offload, beam search, assisted generation,
  `advanced={"decode_graphs": False}`, ...).

Sizes (`first_cache_length`): a CUDA-graph cache starts at the bucket of `min(needed, prompt + max(prompt, 4096))`
positions (`needed`: what the call may reach, `max_length - 1`) and grows in place, in buckets, up to `needed`
(each growth re-captures the step once); a compiled cache cannot grow inside a compiled step, so it is allocated for
the bucket of `needed` at once. `generate(max_new_tokens=100_000)` on a 4K prompt therefore starts with 8192
positions and grows (16K, 32K, 64K, ...) only as far as the generation goes.

The caches generate builds are kept on the model (`graphs.cache_pool`, least recently used out) and reused,
reset in place, by a later call of the same batch size, first length bucket, dtype and device, so repeated calls of
one shape replay the same graphs.
"""

from __future__ import annotations

from ..attention.state import is_mla_attention
from ..cache.growing import QuantMLACache, cache_argument
from ..cache.static import StaticQuantMLACache, cache_length_bucket
from ..config import QuantMLAConfig
from .graphs import DecodePlan, cache_pool, graph_bytes, log_fallback, plan_decode

FIRST_ROOM = 4096  # new positions a CUDA-graph cache holds from the start (at least the prompt's length)


def model_qconfig(model) -> QuantMLAConfig:
    """The `QuantMLAConfig` of a prepared model (`model.config.quantization_config`, a dict converted)."""
    qconfig = getattr(model.config, "quantization_config", None)
    if isinstance(qconfig, dict):
        qconfig = QuantMLAConfig.from_dict(qconfig)
    if not isinstance(qconfig, QuantMLAConfig):
        raise ValueError(
            f"{type(model).__name__} carries no QuantMLAConfig (quantization_config={qconfig!r}); load it with "
            "from_pretrained(..., quantization_config=QuantMLAConfig(...)) or call quantmla_hf.apply_quantmla(model, config)"
        )
    return qconfig


def static_cache_wanted(model, qconfig: QuantMLAConfig, generation_config=None) -> bool:
    """The compiled (inductor) static cache: `QuantMLAConfig(advanced={"static_cache": True/False})` decides; by
    default ("auto") it is used when the call passes a `compile_config` and it is safe: a model on one CUDA device (no
    CPU/disk offload), the "quantmla" attention implementation and a recent window of at least one token."""
    choice = qconfig.advanced.static_cache  # validated by QuantMLAConfig: "auto", True or False
    if choice is False:
        return False
    usable = qconfig.recent_tokens >= 1 and model.config._attn_implementation == "quantmla"
    if choice is True:
        if not usable:
            raise ValueError(
                "advanced static_cache=True needs recent_tokens >= 1 and attn_implementation='quantmla' "
                f"(got recent_tokens={qconfig.recent_tokens}, attn_implementation="
                f"{model.config._attn_implementation!r})"
            )
        return True
    devices = set(getattr(model, "hf_device_map", {}).values()) if hasattr(model, "hf_device_map") else set()
    offloaded = bool(devices & {"cpu", "disk"})
    asked = generation_config is not None and getattr(generation_config, "compile_config", None) is not None
    return asked and usable and model.device.type == "cuda" and not offloaded


def first_cache_length(needed: int, prompt_length: int | None, growable: bool) -> int:
    """Positions a static cache is built with for a call that may reach `needed` positions (see the module
    docstring)."""
    if not growable:
        return cache_length_bucket(needed)
    room = FIRST_ROOM if prompt_length is None else prompt_length + max(prompt_length, FIRST_ROOM)
    return cache_length_bucket(min(needed, room))


def _prompt_length(model_kwargs: dict) -> int | None:
    mask = model_kwargs.get("attention_mask")
    return int(mask.shape[-1]) if mask is not None and hasattr(mask, "shape") and mask.dim() == 2 else None


def generation_cache(model, generation_config, model_kwargs: dict, args: tuple, kwargs: dict):
    """The cache `generate` uses when the caller gives none (see the module docstring); records the call's
    `DecodePlan` on the model (`model._quantmla_decode_plan`, read by `get_compiled_call`)."""
    qconfig = model_qconfig(model)
    # transformers calls _prepare_cache_for_generation(generation_config, model_kwargs, generation_mode,
    # batch_size, max_cache_length) in every release from 5.17 on.
    generation_mode = kwargs.get("generation_mode", args[0] if args else None)
    batch_size = kwargs.get("batch_size", args[1] if len(args) > 1 else None)
    needed = int(kwargs.get("max_cache_length", args[2] if len(args) > 2 else generation_config.max_length))
    plan = plan_decode(model, qconfig, generation_config, generation_mode)
    log_fallback(plan.reason)
    compiled = not plan.graphs and static_cache_wanted(model, qconfig, generation_config)
    if batch_size is None or not (plan.graphs or compiled):
        model._quantmla_decode_plan = DecodePlan(False, plan.reason)
        return QuantMLACache(config=model.config.get_text_config(decoder=True), quantization_config=qconfig)
    model._quantmla_decode_plan = plan
    first = first_cache_length(needed, _prompt_length(model_kwargs), growable=plan.graphs)
    pool = cache_pool(model)
    key = (int(batch_size), first, plan.graphs)
    cache = pool.get(key)
    if cache is not None and cache.quantization_config is qconfig and _compatible(cache, batch_size, model):
        cache.reset()
        cache.length_limit = max(needed, cache.max_cache_len)
    else:
        cache = StaticQuantMLACache(
            config=model.config.get_text_config(decoder=True), quantization_config=qconfig, max_cache_len=first,
            length_limit=needed if plan.graphs else first,
        )
        cache._pool_key = key
        pool.pop(key)
    pool.put(key, cache, cache.nbytes() + graph_bytes(cache))
    model._quantmla_static_cache = cache
    return cache


def plan_for_given_cache(model, generation_config, model_kwargs: dict, args: tuple, kwargs: dict) -> DecodePlan:
    """The plan of a `generate` call given its own cache (`_prepare_cache_for_generation`'s arguments): CUDA graphs
    only for a `StaticQuantMLACache` (transformers compiles any other compileable cache itself)."""
    cache = cache_argument(model_kwargs)
    if not isinstance(cache, StaticQuantMLACache):
        return DecodePlan(False)
    plan = plan_decode(model, model_qconfig(model), generation_config, kwargs.get("generation_mode", args[0] if args else None))
    log_fallback(plan.reason)
    return plan


def _compatible(cache: StaticQuantMLACache, batch_size: int, model) -> bool:
    layer = cache.layers[0]
    if not layer.is_initialized:
        return True
    # The first layer's planes live where its latents are computed: under a device map not always `model.device`.
    attention = next(m for m in model.modules() if is_mla_attention(m))
    return (layer.content.batch_size == batch_size and layer.dtype == model.dtype
            and layer.device == attention.kv_a_proj_with_mqa.weight.device)


def check_static_cache_length(model, generation_config, args: tuple, kwargs: dict) -> None:
    """Refuse a `generate` call whose static cache would be preallocated past the model's position range.

    A `StaticQuantMLACache` reserves `max_length` positions up front (prompt + `max_new_tokens`); a huge
    `max_new_tokens` would allocate far beyond anything the model can attend to, and be killed for memory.
    `args`/`kwargs` are those of `_prepare_cache_for_generation` (generation_mode, batch_size, max_cache_length).
    """
    if not static_cache_wanted(model, model_qconfig(model), generation_config):
        return
    needed = int(kwargs.get("max_cache_length", args[2] if len(args) > 2 else generation_config.max_length))
    limit = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    if limit is not None and needed > limit:
        raise ValueError(
            f"the static QuantMLA cache would preallocate {needed} positions (prompt + max_new_tokens), more than "
            f"this model's max_position_embeddings={limit}; lower max_new_tokens to at most {limit} minus the prompt "
            "length, or use QuantMLAConfig(advanced={'static_cache': False}) for a cache that grows"
        )
