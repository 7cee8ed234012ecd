"""`quantmla serve`: transformers' OpenAI-compatible server, generating through continuous batching on the paged
QuantMLA cache.

transformers' server (`transformers serve`, `transformers.cli.serving`) offers no hook for an out-of-tree
quantization method's cache: it never imports this package, and its continuous batching allows only "paged|eager",
"sdpa" and flash attention on a K/V page layout MLA does not have. So `build_app` keeps every piece of that server
(app, routes, handlers, chat templates, SSE streaming, model loading) and replaces one, `ContinuousBatcher` stepping
on a background thread (`BatcherThread`) in its place:

- up to 5.24 the server hands each request to the generation manager its `GenerationState` returns: here
  `PagedGenerateManager` (`make_generation_state`);
- from 5.25 it runs each model in a process of its own that drives `model.init_continuous_batching()`'s manager:
  there the model is loaded by `serving_loader.PagedModelLoader`, whose models return
  `serving_manager.PagedBatchingManager`.

A model that is not a QuantMLA MLA checkpoint is refused, never served with an ordinary cache.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import queue
import threading
from dataclasses import dataclass

import torch

from ..config import QuantMLAConfig
from .allocator import CacheBudgetExceeded
from .batching import ContinuousBatcher, Sampling
from .cache import PagedQuantMLACache


def _serving():
    try:
        from transformers.cli.serving import utils
    except ImportError as e:  # fastapi, uvicorn or openai missing
        raise ImportError(
            "quantmla serve needs transformers' server and its dependencies: "
            "pip install 'quantmla-hf[serve]' (fastapi, uvicorn, openai)"
        ) from e
    return utils


@dataclass
class CacheOptions:
    """How the server's paged cache is sized: `budget_gib` of cache memory (or `num_pages`), `page_size` tokens per
    page, `max_requests` running at once, `max_batch_tokens` per forward."""

    budget_gib: float | None = None
    num_pages: int | None = None
    page_size: int = 64
    max_requests: int = 64
    max_batch_tokens: int = 2048


def quantmla_config_of(model) -> QuantMLAConfig:
    """The model's `QuantMLAConfig`, or a `ValueError` saying why it cannot be served on the packed cache."""
    qc = getattr(model.config, "quantization_config", None)
    if isinstance(qc, dict) and qc.get("quant_method") == "quantmla":
        qc = QuantMLAConfig.from_dict(qc)
    if not isinstance(qc, QuantMLAConfig):
        raise ValueError(
            f"{type(model).__name__} is not a QuantMLA checkpoint (no quantization_config with quant_method "
            "'quantmla'): quantize it first (quantmla quantize / quantmla_hf.quantize) and serve the result; "
            "quantmla serve does not fall back to an ordinary cache"
        )
    return qc


def paged_cache_for(model, options: CacheOptions) -> PagedQuantMLACache:
    """The paged QuantMLA cache `options` size for `model` (a `ValueError` for a model that is not a QuantMLA
    checkpoint), its size logged by the server's logger."""
    qc = quantmla_config_of(model)
    sizing = ({"num_pages": options.num_pages} if options.num_pages is not None else
              {"budget_bytes": int((options.budget_gib or 1.0) * 2**30)})
    cache = PagedQuantMLACache(model.config, qc, page_size=options.page_size, max_requests=options.max_requests,
                               dtype=model.dtype, device=model.device, **sizing)
    _serving().logger.warning(
        f"QuantMLA paged cache: {cache.format.name}, {cache.num_pages} pages x {cache.page_size} tokens "
        f"({cache.capacity_tokens()} tokens, {cache.nbytes() / 2**20:.1f} MiB)"
    )
    return cache


class BatcherThread:
    """A `ContinuousBatcher` stepping on its own thread; requests arrive and leave from any thread."""

    def __init__(self, batcher: ContinuousBatcher):
        self.batcher = batcher
        self._inbox: queue.Queue = queue.Queue()
        self._callbacks: dict[str, tuple] = {}
        self._stop = threading.Event()
        self.error: Exception | None = None
        self._thread = threading.Thread(target=self._run, name="quantmla-batcher", daemon=True)
        self._thread.start()

    def submit(self, request_id: str, input_ids: list[int], max_new_tokens: int, eos_token_id, sampling: Sampling,
               on_token, on_done) -> None:
        """Queue a request; `on_token(token)` runs for each new token and `on_done(tokens, error)` once at the end,
        both on the batcher thread."""
        if self.error is not None:
            raise RuntimeError(f"the batcher stopped on an error: {self.error}; restart the server")
        self._inbox.put(("add", request_id, input_ids, max_new_tokens, eos_token_id, sampling, on_token, on_done))

    def cancel(self, request_id: str) -> None:
        self._inbox.put(("cancel", request_id))

    def stop(self) -> None:
        self._stop.set()
        self._inbox.put(("stop",))
        self._thread.join(timeout=5)

    def _drain(self, block: bool) -> None:
        while True:
            try:
                item = self._inbox.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return
            block = False
            if item[0] == "add":
                _, rid, ids, n, eos, sampling, on_token, on_done = item
                try:
                    self.batcher.add_request(rid, ids, n, self.batcher.stats.steps, eos, sampling)
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

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._drain(block=not self.batcher.has_work())
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


def prompt_ids(inputs) -> list[int]:
    """The one prompt's token ids from the server's `inputs["input_ids"]`: a `[1, T]` tensor, `[[...]]` or `[...]`."""
    ids = inputs["input_ids"]
    if isinstance(ids, torch.Tensor):
        return ids[0].tolist()
    return list(ids[0] if ids and isinstance(ids[0], list) else ids)


def make_generation_state(options: CacheOptions):
    """transformers' `GenerationState` whose every request goes to the paged QuantMLA continuous batcher."""
    utils = _serving()

    class PagedGenerateManager(utils.BaseGenerateManager):
        """Continuous batching on the paged QuantMLA cache behind transformers' generation-manager interface."""

        def __init__(self):
            self.thread: BatcherThread | None = None
            self.cache: PagedQuantMLACache | None = None

        def init_cb(self, model, gen_config) -> None:
            if self.thread is not None:
                return
            self.cache = paged_cache_for(model, options)
            self.thread = BatcherThread(ContinuousBatcher(model, self.cache, options.max_batch_tokens))

        def _submit(self, inputs, gen_config, request_id, on_token, on_done) -> None:
            ids = prompt_ids(inputs)
            self.thread.submit(request_id, ids, gen_config.max_new_tokens or 256, gen_config.eos_token_id,
                               Sampling.from_generation_config(gen_config), on_token, on_done)

        def generate_streaming(self, model, processor, inputs, gen_config, request_id, response_parser=None):
            self.init_cb(model, gen_config)
            loop = asyncio.get_running_loop()
            text_queue: asyncio.Queue = asyncio.Queue()
            rust_tokenizer = getattr(processor, "tokenizer", processor)._tokenizer
            streamer = utils.DirectStreamer(rust_tokenizer, loop, text_queue, response_parser=response_parser)
            streamer.put(torch.tensor([0]))  # the prompt slot DirectStreamer skips

            def on_token(token: int) -> None:
                try:
                    streamer.put(torch.tensor([token]))
                except utils._GenerationCancelled:
                    self.thread.cancel(request_id)

            def on_done(tokens, error) -> None:
                if error is not None:
                    loop.call_soon_threadsafe(text_queue.put_nowait, utils._StreamError(str(error)))
                else:
                    streamer.end()

            self._submit(inputs, gen_config, request_id, on_token, on_done)
            return text_queue, streamer

        async def generate_non_streaming(self, model, processor, inputs, gen_config, request_id):
            self.init_cb(model, gen_config)
            loop = asyncio.get_running_loop()
            future = loop.create_future()

            def on_done(tokens, error) -> None:
                def resolve():
                    if not future.done():
                        future.set_exception(RuntimeError(str(error))) if error else future.set_result(tokens)
                loop.call_soon_threadsafe(resolve)

            self._submit(inputs, gen_config, request_id, lambda token: None, on_done)
            tokens = await future
            return processor.decode(tokens, skip_special_tokens=True), len(prompt_ids(inputs)), tokens

        def stop(self) -> None:
            if self.thread is not None:
                self.thread.stop()

    class PagedGenerationState(utils.GenerationState):
        """Every request of every model through `PagedGenerateManager` (one per model)."""

        def __init__(self):
            super().__init__(continuous_batching=True)
            self.managers: dict[str, PagedGenerateManager] = {}

        def use_continuous_batching(self, model, modality) -> bool:
            quantmla_config_of(model)  # refuse a model the packed cache cannot serve
            return True

        def get_manager(self, model_id: str, use_cb: bool = False):
            if model_id not in self.managers:
                self.managers[model_id] = PagedGenerateManager()
            return self.managers[model_id]

        def shutdown(self) -> None:
            for manager in self.managers.values():
                manager.stop()
            self.managers.clear()

        def is_cb_alive(self) -> bool:
            return all(m.thread is None or m.thread.error is None for m in self.managers.values())

    return PagedGenerationState()


def build_app(model: str, options: CacheOptions | None = None, device: str = "auto", dtype: str = "auto"):
    """transformers' FastAPI app serving `model` (a QuantMLA checkpoint: a hub id or a local folder) with the
    packed paged cache; returns `(app, state)`, `state.shutdown()` stopping the batcher (up to transformers 5.24 the
    `GenerationState`, whose `managers` hold each model's `PagedGenerateManager`; from 5.25 the `ModelManager`,
    which has started the model's process, loaded by `PagedModelLoader` and never stopped for being idle)."""
    from transformers.cli.serving.chat_completion import ChatCompletionHandler
    from transformers.cli.serving.completion import CompletionHandler
    from transformers.cli.serving.model_manager import ModelManager
    from transformers.cli.serving.response import ResponseHandler
    from transformers.cli.serving.server import build_server
    from transformers.cli.serving.transcription import TranscriptionHandler

    options = options or CacheOptions()
    server_args = inspect.signature(build_server).parameters
    if hasattr(_serving(), "BaseGenerateManager"):  # up to 5.24: the model in this process
        state = make_generation_state(options)
        manager = ModelManager(device=device, dtype=dtype, force_model=model)
        transcription = TranscriptionHandler(manager, state)
        extra = {"generation_state": state}
        handle = state
    else:  # from 5.25: a process per model
        from .serving_loader import PagedModelLoader

        state = _serving().GenerationState(continuous_batching=True)
        manager = ModelManager(PagedModelLoader(options, device=device, dtype=dtype), state, model_timeout=-1,
                               force_model=model)
        transcription = TranscriptionHandler(manager)
        extra = {}
        handle = manager
    if "systemone_handler" in server_args:  # transformers >= 5.24
        from transformers.cli.serving.systemone import SystemOneHandler

        extra["systemone_handler"] = SystemOneHandler(model_manager=manager, generation_state=state)
    app = build_server(
        manager,
        ChatCompletionHandler(model_manager=manager, generation_state=state),
        completion_handler=CompletionHandler(model_manager=manager, generation_state=state),
        response_handler=ResponseHandler(model_manager=manager, generation_state=state),
        transcription_handler=transcription,
        **extra,
    )
    return app, handle


def serve(model: str, host: str = "127.0.0.1", port: int = 8000, options: CacheOptions | None = None,
          device: str = "auto", dtype: str = "auto") -> None:
    """Run the server until interrupted (`quantmla serve`)."""
    import uvicorn

    app, state = build_app(model, options, device, dtype)
    try:
        uvicorn.run(app, host=host, port=port, log_level="info")
    finally:
        state.shutdown()


def serve_main(argv: list[str]) -> int:
    """`quantmla serve MODEL [options]`: parse the options and run the server."""
    p = argparse.ArgumentParser(
        prog="quantmla serve",
        description="Serve a QuantMLA checkpoint with transformers' OpenAI-compatible server (chat completions, "
                    "streaming) and continuous batching on the paged packed cache.",
    )
    p.add_argument("model", help="a QuantMLA checkpoint: Hub id or local folder")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="auto, bfloat16, float16 or float32")
    g = p.add_argument_group("paged cache")
    g.add_argument("--cache-gib", type=float, default=None, help="cache memory budget in GiB (default 1)")
    g.add_argument("--num-pages", type=int, default=None, help="pages instead of a budget")
    g.add_argument("--page-size", type=int, default=64, help="tokens per page")
    g.add_argument("--max-requests", type=int, default=64, help="requests running at once")
    g.add_argument("--max-batch-tokens", type=int, default=2048, help="tokens per forward")
    args = p.parse_args(argv)
    if args.cache_gib is not None and args.num_pages is not None:
        raise ValueError("give --cache-gib or --num-pages, not both")
    options = CacheOptions(args.cache_gib, args.num_pages, args.page_size, args.max_requests, args.max_batch_tokens)
    serve(args.model, args.host, args.port, options, args.device, args.dtype)
    return 0
