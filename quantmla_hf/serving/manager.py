"""`PagedBatchingManager`: continuous batching on the paged QuantMLA cache (`ContinuousBatcher` stepping on a
`BatcherThread`) behind the interface of transformers' `ContinuousBatchingManager`, the object
`model.init_continuous_batching()` returns.

Two callers drive it through that interface alone:

- transformers' `generate_batch` and `continuous_batching_context_manager` (`init_continuous_batching`,
  `warmup`, `start`, `add_requests`, `get_result`, `is_running`, `stop`, `destroy`), on a QuantMLA model whose
  `init_continuous_batching` returns this manager (`continuous_api.init_continuous_batching`);
- transformers' server from 5.25 (its `CBGenerateRunner`, in the model's process: `warmup`, `start`, `add_request`,
  `cancel_request`, `get_result`, `logit_processor.supported_keys`, `batch_processor`,
  `background_thread_status`), on the models `loader.PagedModelLoader` loads.

Outputs are transformers' `GenerationOutput`s: a streaming request's carry its tokens so far, the last one all of
them. A request is checked when it is added, on the caller's thread (`ContinuousBatcher.check_request`): an empty
prompt or one too long for the cache raises `ValueError`, which the server answers with a 400.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers.generation.continuous_batching.requests import GenerationOutput, RequestStatus
from transformers.utils import logging

from ..cache.allocator import CacheBudgetExceeded, pages_for_budget
from ..cache.paged import PagedQuantMLACache
from ..config import QuantMLAConfig
from ..format import CacheFormat
from ..mla import mla_dims
from .batching import ContinuousBatcher, Sampling

# Under transformers' serving logger, so that `quantmla serve` shows these lines at the server's log level.
logger = logging.get_logger("transformers.cli.serving.quantmla")

# the per-request sampling settings the manager takes, with their types (the runner converts the request's values)
SUPPORTED_SAMPLING = {"temperature": float, "top_k": int, "top_p": float}


@dataclass
class CacheOptions:
    """How a server's (or a manager's) paged cache is sized and warmed: `budget_gib` of cache memory (or
    `num_pages`), `page_size` tokens per page, `max_requests` running at once, `max_batch_tokens` per forward; the
    warm-up before the first request (`ContinuousBatcher.warmup`: `warmup_batch_sizes` and `warmup_context`, None
    for its defaults), or none with `warmup=False`."""

    budget_gib: float | None = None
    num_pages: int | None = None
    page_size: int = 64
    max_requests: int = 64
    max_batch_tokens: int = 2048
    warmup: bool = True
    warmup_batch_sizes: tuple[int, ...] | None = None
    warmup_context: int | None = None


def quantmla_config_of(model) -> QuantMLAConfig:
    """The `QuantMLAConfig` of a model (or of its `PretrainedConfig`), or a `ValueError` saying why it cannot be
    served on the packed cache."""
    config = getattr(model, "config", model)
    qc = getattr(config, "quantization_config", None)
    if isinstance(qc, dict) and qc.get("quant_method") == "quantmla":
        qc = QuantMLAConfig.from_dict(qc)
    if not isinstance(qc, QuantMLAConfig):
        raise ValueError(
            f"{type(model).__name__} is not a QuantMLA checkpoint (no quantization_config with quant_method "
            "'quantmla'): quantize it first (quantmla quantize / quantmla_hf.quantize) and serve the result; "
            "quantmla serve does not fall back to an ordinary cache"
        )
    return qc


def cache_pages(config, options: CacheOptions, dtype: torch.dtype) -> int:
    """The pages of the paged cache `options` give a model of `config` computing in `dtype`: `num_pages`, or those
    a budget of `budget_gib` (default 1) holds once the sink/recent rows are paid (`pages_for_budget`)."""
    if options.num_pages is not None:
        return options.num_pages
    qc, dims = quantmla_config_of(config), mla_dims(config)
    fmt = CacheFormat.from_config(dims.kv_lora_rank, dims.rope_dim, qc)
    budget = int((options.budget_gib or 1.0) * 2**30)
    return pages_for_budget(budget, fmt, dims.num_cache_layers, options.page_size, options.max_requests + 1, dtype)


def request_token_limit(config, options: CacheOptions, dtype: torch.dtype) -> int:
    """`ContinuousBatcher.max_request_tokens` of the batcher `options` give a model of `config` in `dtype`,
    computed from the config alone (what a server checks prompts against before they reach the model)."""
    limit = (cache_pages(config, options, dtype) - 1) * options.page_size
    context = getattr(config.get_text_config(decoder=True), "max_position_embeddings", None)
    return limit if context is None else min(limit, context)


def paged_cache_for(model, options: CacheOptions, announce: bool = True) -> PagedQuantMLACache:
    """The paged QuantMLA cache `options` size for `model` (a `ValueError` for a model that is not a QuantMLA
    checkpoint), its size logged (at warning level with `announce`, as a server's start-up line, else info)."""
    qc = quantmla_config_of(model)
    cache = PagedQuantMLACache(model.config, qc, page_size=options.page_size, max_requests=options.max_requests,
                               num_pages=cache_pages(model.config, options, model.dtype), dtype=model.dtype,
                               device=model.device)
    (logger.warning if announce else logger.info)(
        f"QuantMLA paged cache: {cache.format.name}, {cache.num_pages} pages x {cache.page_size} tokens "
        f"({cache.capacity_tokens()} tokens, {cache.nbytes() / 2**20:.1f} MiB)"
    )
    return cache


@dataclass
class EndTokens:
    """A request's end tokens and stop strings, as one value: transformers' server passes a request's
    `eos_token_id` on to the manager and drops its `stop` (`server.PromptChecks` puts the stop strings here)."""

    eos_token_id: int | list[int] | None
    stop_strings: tuple[str, ...] = ()


class StopStrings:
    """Ends a request once its text contains one of `strings` (the token that completes it is kept, as
    `generate(stop_strings=...)` keeps it): called on the generated token ids after each new token, it decodes
    only their tail, long enough to hold the longest string."""

    def __init__(self, tokenizer, strings: Sequence[str]):
        if tokenizer is None:
            raise ValueError("stop strings need the model's tokenizer: give the manager one (tokenizer=...)")
        self.tokenizer, self.strings = tokenizer, tuple(s for s in strings if s)
        self.tail = 2 * max((len(s) for s in self.strings), default=0) + 2

    def __call__(self, generated: list[int]) -> bool:
        text = self.tokenizer.decode(generated[-self.tail:], skip_special_tokens=False)
        return any(s in text for s in self.strings)


class BatcherThread:
    """A `ContinuousBatcher` stepping on its own thread; requests arrive and leave from any thread."""

    def __init__(self, batcher: ContinuousBatcher):
        self.batcher = batcher
        self._inbox: queue.Queue = queue.Queue()
        self._callbacks: dict[str, tuple] = {}
        self._stop = threading.Event()
        self._flush = False
        self.error: Exception | None = None
        self._thread = threading.Thread(target=self._run, name="quantmla-batcher", daemon=True)
        self._thread.start()

    def submit(self, request_id: str, input_ids: list[int], max_new_tokens: int | None, eos_token_id,
               sampling: Sampling, on_token, on_done, stop=None) -> None:
        """Queue a request; `on_token(token)` runs for each new token and `on_done(tokens, error)` once at the end,
        both on the batcher thread. A request the batcher refuses (`ContinuousBatcher.check_request`) raises its
        `ValueError` here, on the caller's thread, and is not queued."""
        if self.error is not None:
            raise RuntimeError(f"the batcher stopped on an error: {self.error}; restart the server")
        if not self.alive():
            raise RuntimeError("the batcher is stopped: start the manager before adding requests")
        max_new_tokens = self.batcher.check_request(request_id, input_ids, max_new_tokens)
        self._inbox.put(("add", request_id, input_ids, max_new_tokens, eos_token_id, sampling, on_token, on_done,
                         stop))

    def cancel(self, request_id: str) -> None:
        self._inbox.put(("cancel", request_id))

    def alive(self) -> bool:
        """Stepping and taking requests (not stopped, nor asked to stop)."""
        return self._thread.is_alive() and not self._stop.is_set()

    def exited(self) -> bool:
        """The thread has returned: nothing of the batcher is in use any more."""
        return not self._thread.is_alive()

    def stop(self, flush: bool = False, timeout: float | None = 5) -> None:
        """Stop stepping: at once, failing the requests in flight, or with `flush` once they finished."""
        self._flush = flush
        self._stop.set()
        self._inbox.put(("stop",))
        self._thread.join(timeout=timeout)

    def _drain(self, block: bool) -> None:
        while True:
            try:
                item = self._inbox.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return
            block = False
            if item[0] == "add":
                _, rid, ids, n, eos, sampling, on_token, on_done, stop = item
                try:
                    self.batcher.add_request(rid, ids, n, self.batcher.stats.steps, eos, sampling, stop)
                    self._callbacks[rid] = (on_token, on_done)
                except ValueError as e:
                    on_done([], e)
            elif item[0] == "cancel":
                self.batcher.cancel(item[1])
                callbacks = self._callbacks.pop(item[1], None)
                if callbacks is not None:
                    callbacks[1]([], None)

    def _run(self) -> None:
        with self.batcher.paged_attention_mode():  # the model serves through the batcher only
            self._loop()
        stopped = RuntimeError("the batching manager was stopped before this request finished")
        for rid, (_, on_done) in list(self._callbacks.items()):  # stopped at once with requests in flight
            self.batcher.cancel(rid)
            on_done([], stopped)
        self._callbacks.clear()
        while not self._inbox.empty():  # and those that were still arriving
            item = self._inbox.get_nowait()
            if item[0] == "add":
                item[7]([], stopped)

    def _loop(self) -> None:
        while True:
            self._drain(block=not self.batcher.has_work() and not self._stop.is_set())
            if self._stop.is_set() and not (self._flush and (self.batcher.has_work() or not self._inbox.empty())):
                return
            if not self.batcher.has_work():
                continue
            try:
                produced = self.batcher.step()
            except CacheBudgetExceeded as e:  # a request larger than the whole cache: fail it, keep serving
                req = self.batcher.waiting.popleft()
                self._callbacks.pop(req.request_id, (None, lambda *a: None))[1]([], e)
                continue
            except Exception as e:  # a failed forward: every request in flight fails, the server says why
                self.error = e
                for rid, (_, on_done) in list(self._callbacks.items()):
                    on_done([], e)
                self._callbacks.clear()
                return
            for rid, token in produced:
                callbacks = self._callbacks.get(rid)
                if callbacks is not None:
                    callbacks[0](token)
            for rid in [r for r in self._callbacks if r in self.batcher.finished]:
                req = self.batcher.finished.pop(rid)
                self._callbacks.pop(rid)[1](req.generated, None)


class TokenPrefix:
    """The first `count` tokens of a request's growing token list, without copying them: the runner reads each
    streamed output's new tail (`[sent:]`) and length, so a copy per token would cost quadratic time in the answer's
    length. Tokens are only ever appended, so the prefix never changes."""

    def __init__(self, tokens: list[int], count: int):
        self._tokens, self._count = tokens, count

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self._tokens[slice(*index.indices(self._count))]
        return self._tokens[range(self._count)[index]]

    def __iter__(self):
        return iter(self._tokens[: self._count])

    def __eq__(self, other) -> bool:
        return list(self) == list(other) if isinstance(other, (list, TokenPrefix)) else NotImplemented


@dataclass
class _LogitProcessor:
    supported_keys: dict = field(default_factory=lambda: dict(SUPPORTED_SAMPLING))


@dataclass
class _ThreadStatus:
    fatal_error: str | None = None


class PagedBatchingManager:
    """Continuous batching of `model` on a paged QuantMLA cache sized by `options`, driven as transformers drives its
    `ContinuousBatchingManager` (module docstring).

    Args:
        model: a QuantMLA MLA causal LM (a `ValueError` otherwise).
        options: the cache's size and the warm-up (`CacheOptions`).
        generation_config: the defaults of a request that sets nothing (`max_new_tokens`, end tokens, sampling);
            default the model's.
        tokenizer: decodes the tails that stop strings are matched against (`EndTokens`); needed only for those.
        announce: log the cache's size and the warm-up at warning level (a server's start-up lines), else info.
    """

    def __init__(self, model, options: CacheOptions, generation_config=None, tokenizer=None, announce: bool = True):
        self.model, self.options, self.tokenizer = model, options, tokenizer
        self.generation_config = generation_config if generation_config is not None else model.generation_config
        self._log = logger.warning if announce else logger.info
        self.cache = paged_cache_for(model, options, announce)
        self.batcher = ContinuousBatcher(model, self.cache, options.max_batch_tokens)
        self.thread: BatcherThread | None = None
        self.logit_processor = _LogitProcessor()
        self.batch_processor = None  # the runner's stats line then reports no queue
        self.warmed_up = False
        self.warmup_report = None
        self._results: queue.Queue = queue.Queue()
        self._handlers: dict[str, tuple] = {}
        self._handlers_lock = threading.Lock()
        self._counter = itertools.count()
        model._quantmla_paged_manager = self  # for `paged_cache_state`

    @property
    def background_thread_status(self) -> _ThreadStatus:
        error = self.thread.error if self.thread is not None else None
        return _ThreadStatus(None if error is None else f"{type(error).__name__}: {error}")

    # ---- life cycle -------------------------------------------------------------------------------------------
    def warmup(self) -> None:
        """Compile the kernels and capture the decode graphs before the first request (`ContinuousBatcher.warmup`
        with the options' batch sizes and context), unless `options.warmup` is False; logs the time it took."""
        if self.options.warmup and not self.warmed_up:
            self.warmup_report = self.batcher.warmup(self.options.warmup_batch_sizes, self.options.warmup_context)
            self._log(f"QuantMLA continuous batching {self.warmup_report}")
        self.warmed_up = True

    def is_running(self) -> bool:
        return self.thread is not None and self.thread.alive()

    def start(self) -> None:
        if not self.is_running():
            self.thread = BatcherThread(self.batcher)

    def stop(self, block: bool = True, timeout: float | None = None, keep_for_next_session: bool = False,
             hard_stop: bool = False) -> None:
        """Stop the batcher thread once the requests in flight finished (`hard_stop`: at once, failing them);
        `block` waits up to `timeout` seconds for it. `keep_for_next_session` keeps the manager (cache, graphs) for
        the model's next `init_continuous_batching`; otherwise its decode graphs are released."""
        if self.thread is not None:
            self.thread.stop(flush=not hard_stop, timeout=timeout if block else 0)
        if keep_for_next_session:
            self.model._cached_continuous_batching_manager = self
        elif self.batcher.graphs is not None and (self.thread is None or self.thread.exited()):
            self.batcher.graphs.release()  # (a stop that did not wait leaves them to `destroy`)

    def destroy(self) -> None:
        """Stop (at once) and release the decode graphs; the manager is not used again."""
        if self.thread is not None and not self.thread.exited():
            self.stop(hard_stop=True)
        if self.batcher.graphs is not None and (self.thread is None or self.thread.exited()):
            self.batcher.graphs.release()
        for name in ("_quantmla_paged_manager", "_cached_continuous_batching_manager"):
            if self.model.__dict__.get(name) is self:
                del self.model.__dict__[name]

    # ---- requests ---------------------------------------------------------------------------------------------
    def _sampling(self, kwargs: dict) -> Sampling:
        """A request's sampling: its own temperature/top-k/top-p where it sets any (`top_k=1` alone is greedy, as
        transformers' server sends it), else the generation config's."""
        if not any(kwargs.get(k) is not None for k in SUPPORTED_SAMPLING):
            return Sampling.from_generation_config(self.generation_config)
        top_k = kwargs.get("top_k")
        return Sampling(top_k != 1, float(kwargs.get("temperature") or 1.0), top_k if top_k != 1 else None,
                        kwargs.get("top_p"))

    def _end(self, eos_token_id) -> tuple[list[int], StopStrings | None]:
        stop = None
        if isinstance(eos_token_id, EndTokens):
            stop = StopStrings(self.tokenizer, eos_token_id.stop_strings) if eos_token_id.stop_strings else None
            eos_token_id = eos_token_id.eos_token_id
        if eos_token_id is None:
            eos_token_id = self.generation_config.eos_token_id
        ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or [])
        return [i for i in ids if i >= 0], stop  # transformers writes -1 for "no end token"

    def _deliver(self, output: GenerationOutput) -> None:
        with self._handlers_lock:
            handler = self._handlers.get(output.request_id)
            if handler is not None and output.is_finished():
                del self._handlers[output.request_id]
        if handler is None:
            self._results.put(output)
        else:
            callback, loop = handler
            loop.call_soon_threadsafe(callback, output)

    def add_request(self, input_ids, request_id: str | None = None, max_new_tokens: int | None = None,
                    streaming: bool = False, record_timestamps: bool = False, eos_token_id=None,
                    **logit_processor_kwargs) -> str:
        """Queue a prompt (`input_ids`: a token list, or a `[1, T]` tensor); its outputs arrive through `get_result`
        (or the handler `register_result_handler` set). `max_new_tokens` None: the generation config's, else as
        many as the request can hold; `eos_token_id` None: the generation config's (an `EndTokens` also carries
        stop strings). Raises `ValueError` for a prompt the batcher refuses (empty, or too long for the cache)."""
        if self.thread is None:
            raise RuntimeError("the manager is not started: call start() before adding requests")
        if request_id is None:
            request_id = f"req_{next(self._counter)}"
        prompt = prompt_ids({"input_ids": input_ids})
        if max_new_tokens is None:
            max_new_tokens = self.generation_config.max_new_tokens
        eos, stop = self._end(eos_token_id)
        tokens: list[int] = []
        stamps: list[float] | None = [] if record_timestamps else None
        created = time.perf_counter()

        def output(generated, status, error=None) -> GenerationOutput:
            return GenerationOutput(request_id, prompt, generated, error=error, status=status, created_time=created,
                                    lifespan=(created, time.perf_counter()) if status >= RequestStatus.FINISHED
                                    else (-1, -1), timestamps=stamps)

        def on_token(token: int) -> None:
            tokens.append(token)
            if stamps is not None:
                stamps.append(time.perf_counter())
            if streaming:  # a request that does not stream is read once, at its end
                self._deliver(output(TokenPrefix(tokens, len(tokens)), RequestStatus.DECODING))

        def on_done(generated, error) -> None:
            if error is None:
                self._deliver(output(list(generated) or list(tokens), RequestStatus.FINISHED))
            else:
                self._deliver(output(list(tokens), RequestStatus.FAILED, str(error)))

        self.thread.submit(request_id, prompt, max_new_tokens, eos, self._sampling(logit_processor_kwargs), on_token,
                           on_done, stop)
        return request_id

    def add_requests(self, inputs: list[list[int]], max_new_tokens: int | None = None, streaming: bool = False,
                     record_timestamps: bool = False, **logit_processor_kwargs) -> list[str]:
        """`add_request` for each prompt, in order; returns their ids."""
        return [self.add_request(ids, max_new_tokens=max_new_tokens, streaming=streaming,
                                 record_timestamps=record_timestamps, **logit_processor_kwargs) for ids in inputs]

    def cancel_request(self, request_id: str) -> None:
        if self.thread is not None:
            self.thread.cancel(request_id)

    def get_result(self, request_id: str | None = None, timeout: float | None = None) -> GenerationOutput | None:
        """The next output (of `request_id` only, when given: another one goes back to the queue and None is
        returned), waiting up to `timeout` seconds (None: until one comes); None at once when none is queued and the
        batcher is stopped."""
        if self._results.empty() and (self.thread is None or not self.thread.alive()):
            return None
        try:
            result = self._results.get(block=True, timeout=timeout)
        except queue.Empty:
            return None
        if request_id is not None and result.request_id != request_id:
            self._results.put(result)
            return None
        return result

    def __iter__(self):
        while self.is_running():
            result = self.get_result(timeout=0.1)
            if result is not None:
                yield result

    def request_id_iter(self, request_id: str):
        while self.is_running():
            result = self.get_result(request_id=request_id, timeout=0.1)
            if result is not None:
                yield result
                if result.is_finished():
                    return

    def register_result_handler(self, request_id: str, callback) -> None:
        """Deliver the outputs of `request_id` to `callback` on the running event loop (instead of `get_result`);
        dropped once the request finished."""
        with self._handlers_lock:
            self._handlers[request_id] = (callback, asyncio.get_running_loop())


def prompt_ids(inputs) -> list[int]:
    """The one prompt's token ids from `inputs["input_ids"]`: a `[1, T]` or `[T]` tensor, `[[...]]` or `[...]`."""
    ids = inputs["input_ids"]
    if isinstance(ids, torch.Tensor):
        return (ids[0] if ids.dim() == 2 else ids).tolist()
    return list(ids[0] if len(ids) and isinstance(ids[0], list) else ids)


def paged_cache_state(model, processor=None) -> dict:
    """What the paged batching manager of `model` holds now: the cache's pages (total, free), the requests
    running and waiting, its counters and the warm-up it ran. A function of `(model, processor)`, as transformers'
    server runs a submitted function in the model's process (`EngineClient.submit`)."""
    manager = model.__dict__.get("_quantmla_paged_manager")
    if manager is None:
        raise ValueError("this model has no paged batching manager: it does not serve through quantmla serve")
    cache, batcher, stats = manager.cache, manager.batcher, manager.batcher.stats
    report = manager.warmup_report
    return {
        "format": cache.format.name, "page_size": cache.page_size, "pages": cache.num_pages,
        "free_pages": cache.allocator.num_free,
        "graph_pages": int(batcher.graphs is not None and batcher.graphs.scratch_page is not None),
        "requests_running": len(batcher.running), "requests_waiting": len(batcher.waiting),
        "max_request_tokens": batcher.max_request_tokens, "generated_tokens": stats.generated_tokens,
        "cancelled": stats.cancelled, "preemptions": stats.preemptions, "graph_captures": stats.graph_captures,
        "warmup": None if report is None else {"seconds": report.seconds, "batch_sizes": list(report.batch_sizes),
                                               "steps": report.steps, "graphs": report.graphs},
    }
