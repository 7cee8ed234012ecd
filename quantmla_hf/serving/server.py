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
  there the model is loaded by `loader.PagedModelLoader`, whose models return `manager.PagedBatchingManager`.

A model that is not a QuantMLA MLA checkpoint is refused, never served with an ordinary cache.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import time

import torch

from .batching import ContinuousBatcher, Sampling
from .manager import (
    BatcherThread,
    CacheOptions,
    EndTokens,
    StopStrings,
    paged_cache_for,
    paged_cache_state,
    prompt_ids,
    quantmla_config_of,
)

__all__ = ["CacheOptions", "build_app", "quantmla_config_of", "serve", "serve_main"]


def _serving():
    try:
        from transformers.cli.serving import utils
    except ImportError as e:  # fastapi, uvicorn or openai missing
        raise ImportError(
            "quantmla serve needs transformers' server and its dependencies: "
            "pip install 'quantmla-hf[serve]' (fastapi, uvicorn, openai)"
        ) from e
    return utils


class PromptChecks:
    """What a request handler checks before the model sees the request, mixed into transformers' handlers: a
    request without its prompt field (`prompt_field`) or with an empty prompt is refused with a `ValueError` (a 400,
    where transformers answers a missing field with a 500), before anything streams; from 5.25 the request's `stop`
    strings travel to the manager as `EndTokens` (transformers' continuous-batching runner passes a request's end
    tokens on and drops its `stop`)."""

    prompt_field = "messages"

    def _validate_request(self, body: dict) -> None:
        super()._validate_request(body)
        prompt = body.get(self.prompt_field)
        if prompt is None or (isinstance(prompt, list) and not prompt):
            raise ValueError(f"the request has no {self.prompt_field!r}: give the prompt there (a non-empty "
                             f"{self.prompt_field})")

    def _check_prompt_length(self, engine, inputs: dict) -> None:
        if not len(prompt_ids(inputs)):
            raise ValueError("the prompt is empty (no token): give at least one token of prompt")
        super()._check_prompt_length(engine, inputs)

    def _build_generation_kwargs(self, body: dict, model_generation_config) -> dict:
        kwargs = super()._build_generation_kwargs(body, model_generation_config)
        stop = kwargs.pop("stop_strings", None)
        if stop:
            kwargs["eos_token_id"] = EndTokens(kwargs["eos_token_id"], (stop,) if isinstance(stop, str) else
                                               tuple(stop))
        return kwargs


def checked(handler: type, prompt_field: str) -> type:
    """`handler` (one of transformers' handler classes) with `PromptChecks` (up to 5.24 its handlers call only
    `_validate_request` of them; the batcher refuses empty and too long prompts there, also with a 400)."""
    return type(f"Checked{handler.__name__}", (PromptChecks, handler), {"prompt_field": prompt_field})


def make_generation_state(options: CacheOptions):
    """transformers' `GenerationState` (up to 5.24) whose every request goes to the paged QuantMLA continuous
    batcher."""
    utils = _serving()

    class PagedGenerateManager(utils.BaseGenerateManager):
        """Continuous batching on the paged QuantMLA cache behind transformers' generation-manager interface."""

        def __init__(self):
            self.thread: BatcherThread | None = None
            self.cache = self.batcher = self.warmup_report = self.tokenizer = None

        def init_cb(self, model, gen_config, processor=None) -> None:
            """Build the cache and the batcher, warm them up (`options.warmup`) and start stepping (once)."""
            if self.thread is not None:
                return
            self.cache = paged_cache_for(model, options)
            self.batcher = ContinuousBatcher(model, self.cache, options.max_batch_tokens)
            if options.warmup:
                self.warmup_report = self.batcher.warmup(options.warmup_batch_sizes, options.warmup_context)
                utils.logger.warning(f"QuantMLA continuous batching {self.warmup_report}")
            if processor is not None:
                self.tokenizer = getattr(processor, "tokenizer", processor)
            model._quantmla_paged_manager = self  # for `paged_cache_state`
            self.thread = BatcherThread(self.batcher)

        def _submit(self, inputs, gen_config, request_id, on_token, on_done) -> None:
            stop = getattr(gen_config, "stop_strings", None)
            stop = StopStrings(self.tokenizer, [stop] if isinstance(stop, str) else stop) if stop else None
            self.thread.submit(request_id, prompt_ids(inputs), gen_config.max_new_tokens, gen_config.eos_token_id,
                               Sampling.from_generation_config(gen_config), on_token, on_done, stop)

        def generate_streaming(self, model, processor, inputs, gen_config, request_id, response_parser=None):
            self.init_cb(model, gen_config, processor)
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
            self.init_cb(model, gen_config, processor)
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
    packed paged cache, built, loaded and warmed up (`options.warmup`) before it returns; returns `(app, state)`,
    `state.shutdown()` stopping the batcher (up to transformers 5.24 the `GenerationState`, whose `managers` hold
    each model's `PagedGenerateManager`; from 5.25 the `ModelManager`, which has started the model's process,
    loaded by `PagedModelLoader` and never stopped for being idle).

    Besides transformers' routes, `GET /quantmla/cache` answers what the paged cache holds
    (`manager.paged_cache_state`: pages free, requests running and waiting, the warm-up)."""
    from transformers.cli.serving.chat_completion import ChatCompletionHandler
    from transformers.cli.serving.completion import CompletionHandler
    from transformers.cli.serving.model_manager import ModelManager
    from transformers.cli.serving.response import ResponseHandler
    from transformers.cli.serving.server import JSONResponse, build_server
    from transformers.cli.serving.transcription import TranscriptionHandler

    async def bad_request(_request, exc: ValueError):
        """A request's `ValueError` (an empty or too long prompt, a setting the batcher cannot take): a 400."""
        return JSONResponse({"detail": str(exc)}, status_code=400)

    options = options or CacheOptions()
    server_args = inspect.signature(build_server).parameters
    if hasattr(_serving(), "BaseGenerateManager"):  # up to 5.24: the model in this process
        state = make_generation_state(options)
        manager = ModelManager(device=device, dtype=dtype, force_model=model)  # loads the model
        repo, gguf_file = _serving().split_model_id(model)
        model_id = manager.process_model_name(repo)
        loaded, processor = manager.load_model_and_processor(model_id, gguf_file=gguf_file)
        state.get_manager(model_id).init_cb(loaded, loaded.generation_config, processor)  # warm start
        transcription = TranscriptionHandler(manager, state)
        extra = {"generation_state": state}
        handle = state

        async def cache_state() -> dict:
            return paged_cache_state(loaded)
    else:  # from 5.25: a process per model, started (model loaded and warmed up) by ModelManager
        from .loader import PagedGenerationState, PagedModelLoader

        loader = PagedModelLoader(options, device=device, dtype=dtype)
        state = PagedGenerationState(loader)
        manager = ModelManager(loader, state, model_timeout=-1, force_model=model)
        transcription = TranscriptionHandler(manager)
        extra = {}
        handle = manager

        async def cache_state() -> dict:
            return await manager.get_engine(None).submit(paged_cache_state)
    if "systemone_handler" in server_args:  # transformers >= 5.24
        from transformers.cli.serving.systemone import SystemOneHandler

        extra["systemone_handler"] = SystemOneHandler(model_manager=manager, generation_state=state)
    chat, completion, response = (checked(h, field)(model_manager=manager, generation_state=state) for h, field in (
        (ChatCompletionHandler, "messages"), (CompletionHandler, "prompt"), (ResponseHandler, "input")))
    app = build_server(manager, chat, completion_handler=completion, response_handler=response,
                       transcription_handler=transcription, **extra)
    if ValueError not in app.exception_handlers:  # 5.24 answers a request's ValueError with a 500
        app.add_exception_handler(ValueError, bad_request)
    app.get("/quantmla/cache")(cache_state)
    return app, handle


def serve(model: str, host: str = "127.0.0.1", port: int = 8000, options: CacheOptions | None = None,
          device: str = "auto", dtype: str = "auto") -> None:
    """Run the server until interrupted (`quantmla serve`), logging the time to ready (model loading and warm-up)
    before it accepts requests."""
    import uvicorn

    start = time.perf_counter()
    app, state = build_app(model, options, device, dtype)
    _serving().logger.warning(f"quantmla serve: ready in {time.perf_counter() - start:.1f} s (model loaded, "
                              f"{'warmed up' if (options or CacheOptions()).warmup else 'no warm-up'})")
    try:
        uvicorn.run(app, host=host, port=port, log_level="info")
    finally:
        state.shutdown()


def _batch_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--warmup-batch-sizes takes comma-separated integers, got {text!r}")
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"--warmup-batch-sizes takes integers >= 1, got {text!r}")
    return sizes


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
    w = p.add_argument_group("warm-up (before the first request: kernels compiled, decode graphs captured)")
    w.add_argument("--warmup-batch-sizes", type=_batch_sizes, default=None, metavar="N,N,...",
                   help="batch sizes to warm (default: every decode-graph bucket up to --max-requests where decode "
                        "steps are captured, 1 and --max-requests elsewhere)")
    w.add_argument("--warmup-context", type=int, default=None, metavar="TOKENS",
                   help="capture the decode graphs of page tables up to this many tokens (default: the longest "
                        "request the cache holds)")
    w.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="accept requests at once; kernels compile and graphs are captured on the first requests")
    args = p.parse_args(argv)
    if args.cache_gib is not None and args.num_pages is not None:
        raise ValueError("give --cache-gib or --num-pages, not both")
    options = CacheOptions(args.cache_gib, args.num_pages, args.page_size, args.max_requests, args.max_batch_tokens,
                           args.warmup, args.warmup_batch_sizes, args.warmup_context)
    serve(args.model, args.host, args.port, options, args.device, args.dtype)
    return 0
