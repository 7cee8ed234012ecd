"""Decode steps replayed from CUDA graphs: what plain `generate()` runs on CUDA (one device, a tensor-parallel rank, a
device map over several GPUs), with no compiler.

`generate` asks the model for a compiled forward (`get_compiled_call`) when its cache is compileable; a QuantMLA
model answers with a `DecodeGraphStep` instead of `torch.compile` when `plan_decode` says the call can be captured
(`QuantMLAConfig(advanced={"decode_graphs": "auto"})`, the default: a model on CUDA devices without offloaded
weights, "quantmla" attention, a recent window, greedy or sampling, no `compile_config`). For every decode step the
step object:

1. checks on the host, without synchronising, that the step fits the cache (growing it in place in buckets when
   it does not, `StaticQuantMLACache.grow_for`) and, once per generation, that the attention mask is left padding +
   causal (one synchronisation);
2. looks up the captured graph of the step's signature (batch size, chunk length, cache capacity, the shapes of
   every tensor argument, the other arguments' values) in the graphs of the cache (an LRU, `GraphPool`);
3. on a miss: warms up twice on a side stream (each warm-up leaves no trace: the device counters are rewound and the
   replay rewrites the same slots), then captures `model(**inputs)` with static copies of the inputs, the cache's
   synchronising checks off (`host_checked_steps`: they were made in 1.): into one `torch.cuda.CUDAGraph` on one
   device (or tensor-parallel rank, its collectives inside the graph), into one graph per device segment under a
   device map (`quantmla_hf.generation.segments`, replayed in order with the hidden states handed over between them);
4. copies the step's inputs into the static ones, replays, advances the cache's host-side length, and returns the
   captured output (its logits are the graph's tensor: overwritten by the next replay; `generate` copies them).

`generate` builds a 4D mask before every step of a compileable cache (`create_masks_for_generate`); a replay reads
none (the kernels mask left padding and causality themselves, checked in 1.), so once a cache's step has replayed,
the model's `create_masks_for_generate` (`masks_for_generate`) hands the next one-token step the mask tensor its
graph was captured with instead of building one. That build is host time the GPU waits for: generate synchronises
at the end of every step, then prepares the next step's inputs before the replay is launched.

Anything else (prefill and long chunks, a cache that is not a `StaticQuantMLACache`, attention weights or hidden
states asked for, a mask that is not left padding + causal, a failed capture) runs the eager forward, saying why
once in the log. Beam search (it reorders the cache every step), assisted generation and the other modes keep the
growing cache and the eager step (`plan_decode`).

Memory: a graph holds its own pool of the step's intermediate tensors (measured per graph as `nbytes`, the growth
of the reserved memory during its capture); the caches generate builds are kept on the model in a `GraphPool` keyed
by (batch size, first length bucket, graphs or compiled), least recently used first out past `max_entries` or `max_bytes`
(cache bytes + their graphs' bytes).

Release: `release_decode_graphs` drops captured graphs and the caches a model keeps. A graph captured while a process
group exists may hold NCCL collectives, which keep their communicator from being destroyed: such graphs are released
before any process group is destroyed and at exit (`distributed.release_before_shutdown`).
"""

from __future__ import annotations

import gc
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
import torch.distributed

from ..attention.masks import mask_is_padding_causal
from ..cache.growing import CACHE_KWARGS, cache_argument
from ..cache.static import StaticQuantMLACache
from ..distributed import collective_backends, release_before_shutdown, uncapturable_collectives
from ..log import get_logger
from ..ops.decode import native_chunk
from .segments import capture_segments, model_segment_plan

logger = get_logger(__name__)

WARMUP_STEPS = 2
GRAPHS_PER_CACHE = 8
CACHES_PER_MODEL = 4
POOL_MAX_BYTES = 8 << 30
# Modes whose cache keeps its batch order from step to step (others reorder or crop it: eager).
CAPTURABLE_MODES = ("greedy_search", "sample")


# ------------------------------------------------------------------------------------------------ the decision
@dataclass(frozen=True)
class DecodePlan:
    """Whether this `generate` call replays decode steps from CUDA graphs; `reason` says why not (None when the
    call simply does not ask for them: CPU, decode_graphs=False, a compile_config)."""

    graphs: bool
    reason: str | None = None


def plan_decode(model, qconfig, generation_config, generation_mode=None) -> DecodePlan:
    """Decide whether a `generate` call on `model` decodes through CUDA graphs.

    `qconfig.advanced.decode_graphs`: False never; "auto" where it is safe (below); True insists, raising a `ValueError`
    where the model cannot be captured (device, attention, recent window), while per-call choices (beam search,
    assisted generation, attention weights) still fall back to eager with a log line.
    Safe: no `compile_config` (that selects inductor) and no `disable_compile`, `advanced.static_cache` not False, the
    model on CUDA devices (one, or several under a device map: `segments.model_segment_plan`; no CPU/disk
    offload; tensor-parallel collectives over NCCL), the "quantmla" attention, at least one recent token, greedy or
    sampling, no attention weights or hidden states returned.
    """
    choice = qconfig.advanced.decode_graphs
    if choice is False:
        return DecodePlan(False)
    if getattr(generation_config, "compile_config", None) is not None:
        return DecodePlan(False)  # the caller selected inductor
    if getattr(generation_config, "disable_compile", False):
        return DecodePlan(False)  # the caller asked for an eager decode
    segments = model_segment_plan(model)
    model_reasons = []
    if not segments.segments:
        if segments.reason is None and choice == "auto":
            return DecodePlan(False)  # a CPU model: nothing to capture, nothing to say
        model_reasons.append(segments.reason or "the model is on the CPU, not on CUDA devices")
    elif (collectives := uncapturable_collectives(collective_backends(model))) is not None:
        model_reasons.append(collectives)
    if model.config._attn_implementation != "quantmla":
        model_reasons.append(f"the attention implementation is {model.config._attn_implementation!r}, not 'quantmla'")
    if qconfig.recent_tokens < 1:
        model_reasons.append("recent_tokens is 0 (decode steps write through the recent window)")
    if qconfig.advanced.static_cache is False:
        model_reasons.append("advanced static_cache=False (the captured step needs the static cache)")
    if model_reasons:
        reason = "; ".join(model_reasons)
        if choice is True:
            raise ValueError(f"advanced decode_graphs=True cannot be honoured: {reason}. Use "
                             "advanced={'decode_graphs': 'auto'} or False")
        return DecodePlan(False, reason)
    mode = getattr(generation_mode, "value", generation_mode)
    if mode is not None and mode not in CAPTURABLE_MODES:
        what = {
            "beam_search": "beam search reorders the cache every step",
            "beam_sample": "beam sampling reorders the cache every step",
            "assisted_generation": "assisted generation verifies draft chunks and crops the cache",
        }.get(mode, f"generation mode {mode!r} is not captured")
        return DecodePlan(False, what)
    if getattr(generation_config, "output_attentions", False) or getattr(generation_config, "output_hidden_states", False):
        return DecodePlan(False, "attention weights or hidden states are returned (computed eagerly)")
    return DecodePlan(True)


def log_fallback(reason: str | None) -> None:
    """Say once (per distinct reason) that decode steps run eagerly."""
    if reason:
        logger.warning_once(f"QuantMLA: decode steps run eagerly, not from CUDA graphs: {reason}.")


def uncapturable(args: tuple, kwargs: dict, device_type: str = "cuda") -> str | None:
    """Why the forward `model(*args, **kwargs)` cannot be a replayed decode step ("" for an ordinary eager step
    such as the prefill, which is not worth a log line), or None when it can."""
    cache = cache_argument(kwargs)
    if not isinstance(cache, StaticQuantMLACache):
        return "" if cache is None else f"the cache is a {type(cache).__name__}, not a StaticQuantMLACache"
    if args:
        return "the forward got positional arguments"
    input_ids = kwargs.get("input_ids")
    if kwargs.get("inputs_embeds") is not None or not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        return "the step is given embeddings, not [B, T] input ids"
    if not cache.holds_tokens():
        return ""  # the prefill
    if not native_chunk(input_ids.shape[1], cache.format.recent_tokens):
        return ""  # a prefill chunk: eager (SDPA)
    if kwargs.get("output_attentions") or kwargs.get("output_hidden_states"):
        return "attention weights or hidden states are asked for"
    if input_ids.device.type != device_type:
        return f"the inputs are on {input_ids.device}, not a {device_type} device"
    mask = kwargs.get("attention_mask")
    if mask is not None and not (isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.dtype == torch.bool):
        return "the attention mask is not a 4D bool tensor"
    for name, value in kwargs.items():
        if name in CACHE_KWARGS or value is None or isinstance(value, (torch.Tensor, bool, int, float, str)):
            continue
        return f"argument {name!r} is a {type(value).__name__} (only tensors and plain values are captured)"
    return None


def step_signature(cache: StaticQuantMLACache, kwargs: dict) -> tuple:
    """What a captured graph is specialised to: the cache's buffers and capacity, whether its step writes sink
    slots, each tensor argument's shape, dtype and device, every other argument's value."""
    parts = []
    for name in sorted(kwargs):
        if name in CACHE_KWARGS:
            continue
        value = kwargs[name]
        if isinstance(value, torch.Tensor):
            parts.append((name, tuple(value.shape), value.dtype, str(value.device)))
        else:
            parts.append((name, value))
    return (cache.buffers_version, cache.max_cache_len, cache.layers[0].sink_written(), tuple(parts))


def step_mask_is_padding_causal(cache: StaticQuantMLACache, mask: torch.Tensor | None, n_new: int) -> bool:
    """Whether the step's `mask: [B, 1, n_new, K]` is the left padding + causal mask the kernels apply over the
    `cache.host_length() + n_new` positions of the step (`masks.mask_is_padding_causal`, one synchronisation)."""
    layer = cache.layers[0]
    return mask_is_padding_causal(layer.left_padding, layer.max_left_padding, mask, n_new, cache.host_length() + n_new)


# ------------------------------------------------------------------------------------------------ the pools
@dataclass
class GraphPool:
    """A least-recently-used map with a count and a byte cap: `put` evicts the oldest entries (never the one just
    put) while there are more than `max_entries` or their bytes exceed `max_bytes`."""

    max_entries: int
    max_bytes: int | None = None
    entries: OrderedDict = field(default_factory=OrderedDict)
    sizes: dict = field(default_factory=dict)

    def get(self, key):
        item = self.entries.get(key)
        if item is not None:
            self.entries.move_to_end(key)
        return item

    def put(self, key, item, nbytes: int) -> list:
        """Insert (or refresh) `key`; returns the evicted items."""
        self.entries[key] = item
        self.entries.move_to_end(key)
        self.sizes[key] = int(nbytes)
        evicted = []
        while len(self.entries) > 1 and (
            len(self.entries) > self.max_entries or (self.max_bytes is not None and self.nbytes() > self.max_bytes)
        ):
            old_key, old = self.entries.popitem(last=False)
            self.sizes.pop(old_key)
            evicted.append(old)
        return evicted

    def resize(self, key, nbytes: int) -> None:
        if key in self.sizes:
            self.sizes[key] = int(nbytes)

    def pop(self, key):
        self.sizes.pop(key, None)
        return self.entries.pop(key, None)

    def nbytes(self) -> int:
        return sum(self.sizes.values())

    def __len__(self) -> int:
        return len(self.entries)


_POOLED_MODELS = weakref.WeakSet()  # models with a cache pool (`cache_pool`)
_GRAPH_CACHES = weakref.WeakSet()  # caches holding captured steps (`graphs_of`)


def cache_pool(model) -> GraphPool:
    """The static caches `generate` built for `model` (with their graphs): `CACHES_PER_MODEL` and `POOL_MAX_BYTES`
    by default; set `max_entries`/`max_bytes` on it to change the caps."""
    pool = getattr(model, "_quantmla_cache_pool", None)
    if pool is None:
        pool = model._quantmla_cache_pool = GraphPool(CACHES_PER_MODEL, POOL_MAX_BYTES)
        _POOLED_MODELS.add(model)
    return pool


def graphs_of(cache: StaticQuantMLACache) -> GraphPool:
    graphs = cache.__dict__.get("_decode_graphs")
    if graphs is None:
        graphs = cache.__dict__["_decode_graphs"] = GraphPool(GRAPHS_PER_CACHE)
        _GRAPH_CACHES.add(cache)
    return graphs


def release_decode_graphs(model=None) -> int:
    """Drop the captured decode steps of `model`'s caches (of every cache when `model` is None) and empty the pools
    of static caches the model(s) keep for later `generate` calls; returns the number of graphs dropped.

    Graphs hold device memory and, under tensor parallel, NCCL collectives that keep their communicator alive: this
    runs before a process group is destroyed and at exit (`distributed.release_before_shutdown`). Later `generate`
    calls build their caches and capture again.
    """
    models = list(_POOLED_MODELS) if model is None else [model]
    pools = [owner.__dict__.get("_quantmla_cache_pool") or GraphPool(0) for owner in models]
    caches = list(_GRAPH_CACHES) if model is None else [
        *pools[0].entries.values(), *filter(None, [model.__dict__.get("_quantmla_static_cache")])]
    released = 0
    for cache in caches:
        graphs = cache.__dict__.pop("_decode_graphs", None)
        released += len(graphs) if graphs is not None else 0
        _GRAPH_CACHES.discard(cache)
    for owner, pool in zip(models, pools):
        pool.entries.clear()
        pool.sizes.clear()
        for name in ("_quantmla_static_cache", "_quantmla_graph_step"):
            owner.__dict__.pop(name, None)
    return released


def graph_bytes(cache: StaticQuantMLACache) -> int:
    """Bytes the captured graphs of `cache` hold (their private memory pools, as measured at capture)."""
    graphs = cache.__dict__.get("_decode_graphs")
    return graphs.nbytes() if graphs is not None else 0


# ------------------------------------------------------------------------------------------------ capture, replay
@dataclass
class CapturedStep:
    """A forward captured once and replayed: what `generate`'s decode steps (`DecodeGraphStep`) and continuous
    batching's (`serving.graphs.PagedDecodeGraphs`) keep per captured shape.

    `inputs` holds the static tensors the graph reads (a replay first copies the step's own values into them) and
    the other objects the forward was called with; `output` is the forward's output, whose tensors the graph
    overwrites at each replay; `nbytes` the memory the capture took (0 where graphs share one pool)."""

    graph: object | None  # torch.cuda.CUDAGraph, or the ordered graphs of device segments; None until captured
    inputs: dict
    output: object = None
    nbytes: int = 0


def warm_up(run, device, times: int = WARMUP_STEPS, rewind=None) -> None:
    """Call `run()` `times` times on a side stream of `device` before a capture (kernel compilation, library
    workspaces), `rewind()` after each so that the capture sees the state the first call saw."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(times):
            run()
            if rewind is not None:
                rewind()
    torch.cuda.current_stream(device).wait_stream(side)


@dataclass
class GraphStats:
    """What the step objects of one model did: captures, replays, eager steps, capture seconds."""

    captures: int = 0  # CUDA graphs captured
    replays: int = 0  # decode steps replayed from a graph
    eager_steps: int = 0  # decode steps run without one
    capture_seconds: float = 0.0  # wall time of the captures


def graph_stats(model) -> GraphStats:
    stats = getattr(model, "_quantmla_graph_stats", None)
    if stats is None:
        stats = model._quantmla_graph_stats = GraphStats()
    return stats


class DecodeGraphStep:
    """The forward `generate` calls for each decode step of one call (see the module docstring)."""

    device_type = "cuda"  # where steps are captured (`_capture` and `_record` say how)

    def __init__(self, model):
        self.model = model
        self.stats = graph_stats(model)
        self.checked_masks: set[int] = set()  # caches whose mask was checked in this call
        self.eager_caches: set[int] = set()  # caches this call decodes eagerly (a mask the kernels cannot apply)
        self.replay_masks: dict[int, torch.Tensor] = {}  # cache -> the mask its last replayed graph holds
        model._quantmla_graph_step = self  # read by `masks_for_generate`; cleared when a generate call starts

    def __call__(self, *args, **kwargs):
        why = uncapturable(args, kwargs, self.device_type)
        cache = cache_argument(kwargs)
        if why is not None or id(cache) in self.eager_caches:
            log_fallback(why)
            self.stats.eager_steps += 1
            return self.model(*args, **kwargs)
        n_new = kwargs["input_ids"].shape[1]
        cache.moved_buffers()
        if not cache.room_for(n_new):
            cache.grow_for(cache.host_length() + n_new)
        if id(cache) not in self.checked_masks:
            if not step_mask_is_padding_causal(cache, kwargs.get("attention_mask"), n_new):
                log_fallback("the attention mask is not left padding + causal (the kernels' own masking)")
                self.eager_caches.add(id(cache))
                self.stats.eager_steps += 1
                return self.model(**kwargs)
            self.checked_masks.add(id(cache))
        graphs = graphs_of(cache)
        key = step_signature(cache, kwargs)
        step = graphs.get(key)
        if step is None:
            try:
                step = self._capture(cache, kwargs)
            except RuntimeError as err:
                log_fallback(f"capturing the decode step failed ({err})")
                self.eager_caches.add(id(cache))
                self.stats.eager_steps += 1
                return self.model(**kwargs)
            graphs.put(key, step, step.nbytes)
            cache_pool(self.model).resize(getattr(cache, "_pool_key", None), cache.nbytes() + graphs.nbytes())
        for name, value in kwargs.items():
            target = step.inputs.get(name)
            if isinstance(value, torch.Tensor) and target is not value:
                target.copy_(value)
        step.graph.replay()
        cache.advance_host_length(n_new)
        self.stats.replays += 1
        mask = step.inputs.get("attention_mask")
        if isinstance(mask, torch.Tensor):
            self.replay_masks[id(cache)] = mask
        return step.output

    def replay_mask(self, cache, n_new: int, mask_2d: torch.Tensor | None) -> torch.Tensor | None:
        """The 4D mask to give the next step of `cache` (`n_new` tokens, generate's `mask_2d: [B, n + n_new]` or None)
        without building one: the tensor its last replayed graph was captured with, when that step will replay
        the same way (same batch and chunk, room left, the 2D mask covering exactly the cached positions plus the
        new ones); None otherwise (the stock mask is built)."""
        mask = self.replay_masks.get(id(cache))
        if mask is None or id(cache) in self.eager_caches or mask.shape[2] != n_new or not cache.room_for(n_new):
            return None
        if mask_2d is not None and (  # None: no padding (later releases drop an all-ones mask)
            mask_2d.dim() != 2 or mask_2d.shape != (mask.shape[0], cache.host_length() + n_new)
        ):
            return None
        return mask

    def _capture(self, cache: StaticQuantMLACache, kwargs: dict) -> CapturedStep:
        start = time.perf_counter()
        n = cache.host_length()
        inputs = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
        try:
            with cache.host_checked_steps():
                self._warm_up(cache, inputs, n)
                graph, output, nbytes = self._record(inputs)
        finally:
            cache.set_host_length(n)  # warm-ups rewound, and the capture ran no kernel: the counters stay at n
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            release_before_shutdown(release_decode_graphs)  # its collectives must not outlive the process group
        self.stats.captures += 1
        self.stats.capture_seconds += time.perf_counter() - start
        return CapturedStep(graph, inputs, output, nbytes)

    def _warm_up(self, cache: StaticQuantMLACache, inputs: dict, n: int) -> None:
        """The step run before its capture (`warm_up`), the cache rewound to `n` positions after each run: the
        replay then rewrites the same slots with the same values."""
        warm_up(lambda: self.model(**inputs), inputs["input_ids"].device, rewind=lambda: cache.set_host_length(n))

    def _record(self, inputs: dict):
        """Capture `model(**inputs)` into CUDA graphs with their own memory pools, one per device segment
        (`segments.py`); returns (graph, output, bytes the pools took)."""
        plan = model_segment_plan(self.model)
        if not plan.segments:
            raise RuntimeError(plan.reason or "the model is on the CPU")
        gc.collect()
        torch.cuda.empty_cache()  # as torch.cuda.graph does on entry: what reserved memory gains is the pools'
        return capture_segments(self.model, plan.segments, inputs)


def masks_for_generate(model, stock, **kwargs):
    """`model.create_masks_for_generate` on a QuantMLA model (generate's keyword arguments: `inputs_embeds: [B, T,
    0]`, the 2D `attention_mask`, the cache, ...): the captured step's own mask for a step the current
    `DecodeGraphStep` will replay (`DecodeGraphStep.replay_mask`), `stock(**kwargs)` for every other step."""
    step = model.__dict__.get("_quantmla_graph_step")
    cache = cache_argument(kwargs)  # `past_key_values` (5.17) or `cache` (later releases)
    embeds = kwargs.get("inputs_embeds")
    if step is not None and isinstance(cache, StaticQuantMLACache) and embeds is not None:
        mask = step.replay_mask(cache, embeds.shape[1], kwargs.get("attention_mask"))
        if mask is not None:
            return mask
    return stock(**kwargs)


def compiled_call(model, stock_get_compiled_call, compile_config):
    """`model.get_compiled_call` of a QuantMLA model: this call's `DecodeGraphStep` where `plan_decode` chose CUDA
    graphs, transformers' own (`torch.compile`) otherwise."""
    plan = getattr(model, "_quantmla_decode_plan", None)
    if plan is not None and plan.graphs:
        return DecodeGraphStep(model)
    return stock_get_compiled_call(compile_config)
