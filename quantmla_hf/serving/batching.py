"""Continuous batching of greedy generation on the paged QuantMLA cache.

Every step runs one forward of the stock transformers model over the new tokens of several requests packed in one
row (`[1, N]`, positions per token): decode steps of running requests and prefill chunks of new ones, of different
lengths, without padding. The policy is the one of transformers' own continuous batching (FIFO) and vLLM's:

- running requests first, one token each (or their next prefill chunk), then waiting requests in arrival order,
  admitted while the step's token budget (`max_batch_tokens`) and the cache's pages allow: a request is admitted
  only when the pages left hold all its tokens and its next one (then chunks of a long prompt do not run out of
  pages half-way). A prompt that fits one forward is prefilled whole (it waits for a step with room), so its tokens
  attend to exact latents as in `generate`; only a prompt longer than `max_batch_tokens` is chunked, and then, in a
  quantized format, a chunk reads the earlier chunks from the cache (dequantized outside the sink and recent
  window), which a one-shot `generate` prefill does not;
- when the running requests' next tokens do not fit the pages left, the most recently admitted request is preempted:
  its pages are freed and it waits again at the head of the queue, to be recomputed from its prompt and the tokens
  it already generated (`preemptions` counts these); a step that preempted admits no one (vLLM's rule);
- a request is refused when it is added (`RequestTooLong`, a `ValueError`) when its prompt leaves no room for an
  answer in what one request can hold (`max_request_tokens`: the cache's pages less one, kept free for the padding
  rows of captured decode steps, and the model's context); its answer is cut at that length.

`warmup()` runs, before the first request, the steps a server meets (prefills, eager decode steps, the captured
decode steps of every batch bucket and page-table width) on scratch requests and frees them, so that no kernel is
compiled and no graph captured while requests wait.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from ..attention.paged import PAGED_ATTN_IMPLEMENTATION, PagedForward, native_request, register_paged_attention
from ..attention.state import mla_attention_modules
from ..cache.allocator import CacheBudgetExceeded
from ..cache.growing import CACHE_KWARG
from ..cache.paged import PagedQuantMLACache
from ..ops.decode import NATIVE_MAX_QUERY
from .graphs import PagedDecodeGraphs, bucket, request_bucket, unsupported_reason

logger = logging.getLogger(__name__)



class RequestTooLong(ValueError):
    """A prompt that leaves no room for an answer in what one request can hold (`max_request_tokens`): the
    request's fault, refused when it is added (a server answers it with a 4xx)."""


@dataclass
class GenerationRequest:
    """One request: its prompt, what it generated, and how much of `prompt + generated` the cache holds."""

    request_id: str
    prompt: list[int]
    max_new_tokens: int
    arrival_step: int = 0
    eos: frozenset = frozenset()
    sampling: "Sampling | None" = None
    stop: Callable[[list[int]], bool] | None = None  # ends the request when it returns True on `generated`
    generated: list[int] = field(default_factory=list)
    cached: int = 0
    preemptions: int = 0
    finished: bool = False
    tokens: list[int] = field(init=False, repr=False)  # prompt + generated, kept as one list (read every step)

    def __post_init__(self) -> None:
        self.tokens = self.prompt + self.generated

    def add_token(self, token: int) -> None:
        self.generated.append(token)
        self.tokens.append(token)


@dataclass(frozen=True)
class Sampling:
    """Sampling of one request (greedy when `do_sample` is False): temperature, then top-k, then top-p."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    @classmethod
    def from_generation_config(cls, gen_config) -> "Sampling":
        return cls(bool(getattr(gen_config, "do_sample", False)), float(getattr(gen_config, "temperature", None) or 1.0),
                   getattr(gen_config, "top_k", None) or None, getattr(gen_config, "top_p", None))

    def choose(self, logits: torch.Tensor) -> int:
        """The next token from `logits: [V]`."""
        if not self.do_sample:
            return int(logits.float().argmax())
        scores = logits.float() / max(self.temperature, 1e-5)
        if self.top_k:
            kth = torch.topk(scores, min(self.top_k, scores.numel())).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if self.top_p is not None and self.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            drop = sorted_p.cumsum(0) - sorted_p > self.top_p
            probs = probs.scatter(0, order, sorted_p.masked_fill(drop, 0.0))
        return int(torch.multinomial(probs / probs.sum(), 1))


@dataclass
class BatchingStats:
    """What a run did: forwards, tokens computed (prefill, recomputation and decode), preemptions."""

    steps: int = 0
    forward_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    cancelled: int = 0
    peak_running: int = 0
    peak_pages: int = 0
    graph_steps: int = 0  # decode steps replayed from a CUDA graph (`graphs.PagedDecodeGraphs`)
    graph_captures: int = 0
    # Wall time of the forwarding steps, replayed and eager apart (each step ends reading its tokens back, so the
    # device's work is inside): where a run's time goes without a profiler.
    graph_seconds: float = 0.0
    eager_seconds: float = 0.0


@dataclass
class WarmupReport:
    """What `ContinuousBatcher.warmup` ran: its wall time, the batch sizes and page-table widths it warmed, the
    steps of its scratch requests, and the decode graphs captured in all (none where steps run eagerly, e.g. on the
    CPU)."""

    seconds: float
    batch_sizes: tuple[int, ...]
    widths: tuple[int, ...]
    steps: int
    graphs: int

    def __str__(self) -> str:
        graphs = f", {self.graphs} decode graphs captured" if self.graphs else ", no decode graphs (eager steps)"
        return (f"warmed up in {self.seconds:.1f} s: {self.steps} steps over batch sizes "
                f"{list(self.batch_sizes)}{graphs}")


# The longest warm-up prompt (the dense prefill path; any length compiles the same kernels).
WARMUP_PROMPT_TOKENS = 256


class ContinuousBatcher:
    """Greedy continuous batching of a transformers MLA model on a `PagedQuantMLACache`.

    Args:
        model: a transformers MLA causal LM (QuantMLA-prepared or not; the cache decides the format).
        cache: the paged cache (its `QuantMLAConfig` gives the format; C16R16 is the BF16-latent baseline).
        max_batch_tokens: most tokens in one forward (decode tokens and prefill chunks together).
        eos_token_id: a token id (or ids) that ends a request, or None.
        decode_graphs: replay decode-only steps from CUDA graphs (`graphs.py`): "auto" (default) where the model and
            cache sit on one CUDA device with the Triton kernels, True (an error where they cannot), or False.
    """

    def __init__(self, model, cache: PagedQuantMLACache, max_batch_tokens: int = 512, eos_token_id=None,
                 decode_graphs: bool | str = "auto"):
        if max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {max_batch_tokens}")
        self.model, self.cache, self.max_batch_tokens = model, cache, max_batch_tokens
        eos = eos_token_id if eos_token_id is not None else []
        self.eos = set([eos] if isinstance(eos, int) else eos)
        self.waiting: deque[GenerationRequest] = deque()
        self.running: list[GenerationRequest] = []
        self.finished: dict[str, GenerationRequest] = {}
        self.stats = BatchingStats()
        self.modules = mla_attention_modules(model)
        if not self.modules:
            raise ValueError("continuous batching on the paged QuantMLA cache needs an MLA model")
        register_paged_attention()
        if not (decode_graphs == "auto" or isinstance(decode_graphs, bool)):
            raise ValueError(f"decode_graphs must be 'auto', True or False, got {decode_graphs!r}")
        self.graphs = None
        if decode_graphs is not False:
            reason = unsupported_reason(model, cache)
            if reason is not None and decode_graphs is True:
                raise ValueError(f"decode_graphs=True, but {reason}; pass decode_graphs='auto' or False")
            if reason is None:
                self.graphs = PagedDecodeGraphs(cache, self._forward)
        text_config = model.config.get_text_config(decoder=True)
        self.context_length: int | None = getattr(text_config, "max_position_embeddings", None)
        self.vocab_size: int = text_config.vocab_size

    @property
    def max_request_tokens(self) -> int:
        """Tokens one request can hold, prompt and answer: the cache's pages less one (kept free for the padding
        rows of captured decode steps, whether or not this batcher captures any, so that the limit depends on the
        cache alone), capped by the model's context (`max_position_embeddings`)."""
        pages = (self.cache.num_pages - 1) * self.cache.page_size
        return pages if self.context_length is None else min(pages, self.context_length)

    def check_request(self, request_id: str, input_ids: Sequence[int], max_new_tokens: int | None) -> int:
        """The tokens request `request_id` may generate: `max_new_tokens` (None: as many as fit) cut to what
        `max_request_tokens` leaves after its prompt. Raises `ValueError` for an empty prompt or a `max_new_tokens`
        below 1, and `RequestTooLong` for a prompt that leaves no room for an answer. Reads nothing the stepping
        thread changes, so a server can call it on the thread that receives the request."""
        if not len(input_ids):
            raise ValueError(f"request {request_id!r} has an empty prompt; give at least one input token")
        if max_new_tokens is not None and max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        limit = self.max_request_tokens
        if len(input_ids) >= limit:
            cache = self.cache
            raise RequestTooLong(
                f"request {request_id!r} has a prompt of {len(input_ids)} tokens, but a request holds at most {limit} "
                f"tokens, prompt and answer (the cache's {cache.num_pages} pages of {cache.page_size} tokens less "
                f"one, and the model's context of {self.context_length}): shorten the prompt or give the cache a "
                "larger budget"
            )
        room = limit - len(input_ids)
        return room if max_new_tokens is None else min(max_new_tokens, room)

    def add_request(self, request_id: str, input_ids: list[int], max_new_tokens: int | None, arrival_step: int = 0,
                    eos_token_id=None, sampling: Sampling | None = None,
                    stop: Callable[[list[int]], bool] | None = None) -> None:
        """Queue a request; it may be admitted from step `arrival_step` on. `max_new_tokens` (None: until an end
        token or `max_request_tokens`) is cut as `check_request` says, which also says what is refused.
        `eos_token_id` (an id or ids) adds to the batcher's own end tokens; `sampling` defaults to greedy; `stop`,
        called on the generated tokens after each new one, ends the request when it returns True (stop strings)."""
        max_new_tokens = self.check_request(request_id, input_ids, max_new_tokens)
        known = {r.request_id for r in self.waiting} | {r.request_id for r in self.running} | set(self.finished)
        if request_id in known:
            raise ValueError(f"request id {request_id!r} is already in use; give each request its own id")
        eos = set(self.eos)
        if eos_token_id is not None:
            eos |= {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)
        self.waiting.append(GenerationRequest(request_id, list(input_ids), max_new_tokens, arrival_step,
                                              frozenset(eos), sampling, stop))

    def cancel(self, request_id: str) -> bool:
        """Drop a waiting or running request (its pages return to the cache). False when it is not queued."""
        for queue in (self.waiting, self.running):
            for req in list(queue):
                if req.request_id == request_id:
                    queue.remove(req)
                    if request_id in self.cache.requests:
                        self.cache.free_request(request_id)
                    self.stats.cancelled += 1
                    return True
        return False

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- scheduling -------------------------------------------------------------------------------------------
    def _pages(self, plan: list[tuple[GenerationRequest, int]]) -> int:
        return sum(self.cache.pages_needed(r.request_id if r.request_id in self.cache.requests else None, q)
                   for r, q in plan)

    def _preempt(self, req: GenerationRequest) -> None:
        self.running.remove(req)
        if req.request_id in self.cache.requests:
            self.cache.free_request(req.request_id)
        req.cached = 0
        req.preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(req)

    def _schedule(self) -> list[tuple[GenerationRequest, int]]:
        budget = self.max_batch_tokens
        plan: list[tuple[GenerationRequest, int]] = []
        for req in list(self.running):
            if budget == 0:
                break
            plan.append((req, min(len(req.tokens) - req.cached, budget)))
            budget -= plan[-1][1]
        # Running requests that no longer fit: preempt the most recently admitted until the others do.
        preempted = False
        while plan and self._pages(plan) > self.cache.allocator.num_free:
            victim = self.running[-1]
            budget += sum(q for r, q in plan if r is victim)
            plan = [(r, q) for r, q in plan if r is not victim]
            self._preempt(victim)
            preempted = True
        if preempted:
            return plan  # no admission in a step that preempted (vLLM's rule): the pages went to running requests
        rows_free = self.cache.free_rows
        while self.waiting and budget > 0 and rows_free > 0 and self.waiting[0].arrival_step <= self.stats.steps:
            req = self.waiting[0]
            if budget < len(req.tokens) <= self.max_batch_tokens:
                break  # a prompt that fits one forward is prefilled whole, in a later step
            q = min(len(req.tokens), budget)
            # Admitted only when all its tokens (and its next one) fit beside this step's: a long prompt let in chunk
            # by chunk without room to finish would be preempted and recomputed over and over.
            whole = self.cache.pages_needed(None, len(req.tokens) + 1)
            if self._pages(plan) + whole > self.cache.allocator.num_free:
                if not plan and not self.running:
                    raise CacheBudgetExceeded(
                        f"request {req.request_id!r} ({len(req.tokens)} tokens and its next one) does not fit the "
                        f"empty cache ({self.cache.num_pages} pages of {self.cache.page_size} tokens); build the "
                        "cache with a larger budget or shorten the request"
                    )
                break
            self.waiting.popleft()
            self.running.append(req)
            plan.append((req, q))
            budget -= q
            rows_free -= 1
        return plan

    # ---- one forward ------------------------------------------------------------------------------------------
    @contextmanager
    def _paged_attention(self, ctx: PagedForward):
        previous = self.model.config._attn_implementation
        if previous != PAGED_ATTN_IMPLEMENTATION:
            self.model.set_attn_implementation(PAGED_ATTN_IMPLEMENTATION)
        for m in self.modules:
            m._quantmla_paged = ctx
        try:
            yield
        finally:
            for m in self.modules:
                m._quantmla_paged = None
            if previous != PAGED_ATTN_IMPLEMENTATION:
                self.model.set_attn_implementation(previous)

    def _forward(self, ctx: PagedForward, input_ids, position_ids, last) -> torch.Tensor:
        """Logits `[n, V]` of the rows `last` of one forward over `input_ids: [1, N]` on the paged cache."""
        with self._paged_attention(ctx):
            return self.model(input_ids=input_ids, position_ids=position_ids, use_cache=True, logits_to_keep=last,
                              **{CACHE_KWARG: ctx}).logits[0]

    @torch.inference_mode()
    def step(self) -> list[tuple[str, int]]:
        """Run one forward; return the `(request_id, token)` pairs generated by it."""
        plan = self._schedule()
        if not plan:
            if self.waiting:  # nothing admitted yet (arrival in the future): let time pass
                self.stats.steps += 1
            return []
        start = time.perf_counter()
        cache, device = self.cache, self.cache.device
        step = cache.begin_step([r.request_id for r, _ in plan], [q for _, q in plan])
        logits = None
        if self.graphs is not None and self.graphs.eligible(plan):
            logits = self.graphs.run(plan, step)
            self.stats.graph_steps += logits is not None
            self.stats.graph_captures = self.graphs.captures
        replayed = logits is not None
        if logits is None:
            ids = [t for r, q in plan for t in r.tokens[r.cached : r.cached + q]]
            positions = [p for r, q in plan for p in range(r.cached, r.cached + q)]
            native = [i for i, (_, q) in enumerate(plan) if native_request(cache, q)]
            dense = [i for i, (_, q) in enumerate(plan) if not native_request(cache, q)]
            cu = [0]
            for _, q in plan:
                cu.append(cu[-1] + q)
            ctx = PagedForward(cache, step, native, dense)
            if native:
                ctx.native_step = cache.sub_step(step, native)
                ctx.native_tokens = torch.cat([torch.arange(cu[i], cu[i + 1]) for i in native]).to(device)
            input_ids = torch.tensor([ids], dtype=torch.long, device=device)
            position_ids = torch.tensor([positions], dtype=torch.long, device=device)
            # Only each request's last token can produce a new token: the LM head runs on those rows alone.
            last = torch.tensor([cu[i + 1] - 1 for i in range(len(plan))], device=device)
            logits = self._forward(ctx, input_ids, position_ids, last)
        cache.end_step(step)
        self.stats.steps += 1
        self.stats.forward_tokens += sum(q for _, q in plan)
        self.stats.peak_running = max(self.stats.peak_running, len(plan))
        self.stats.peak_pages = max(self.stats.peak_pages, cache.allocator.num_used)
        greedy = logits.float().argmax(-1).tolist()  # one read-back for the whole step
        seconds = time.perf_counter() - start
        if replayed:
            self.stats.graph_seconds += seconds
        else:
            self.stats.eager_seconds += seconds
        out = []
        for i, (req, q) in enumerate(plan):
            req.cached += q
            if req.cached < len(req.tokens):
                continue  # prefill (or recomputation) not done yet
            sampled = req.sampling is not None and req.sampling.do_sample
            token = req.sampling.choose(logits[i]) if sampled else greedy[i]
            req.add_token(token)
            self.stats.generated_tokens += 1
            out.append((req.request_id, token))
            if (len(req.generated) >= req.max_new_tokens or token in req.eos
                    or (req.stop is not None and req.stop(req.generated))):
                req.finished = True
                self.running.remove(req)
                cache.free_request(req.request_id)
                self.finished[req.request_id] = req
        return out

    @contextmanager
    def paged_attention_mode(self):
        """Keep the model on the "quantmla_paged" attention across several steps (each step otherwise switches it
        and back, ~1 ms at 27 layers); the previous implementation is restored on exit."""
        previous = self.model.config._attn_implementation
        self.model.set_attn_implementation(PAGED_ATTN_IMPLEMENTATION)
        try:
            yield
        finally:
            self.model.set_attn_implementation(previous)

    def run(self) -> dict[str, list[int]]:
        """Step until every request finished; return each request's generated tokens."""
        with self.paged_attention_mode():
            try:
                while self.has_work():
                    self.step()
            finally:
                if self.graphs is not None:
                    self.graphs.release()
        return {rid: req.generated for rid, req in self.finished.items()}

    # ---- warm-up ----------------------------------------------------------------------------------------------
    def default_warmup_batch_sizes(self) -> tuple[int, ...]:
        """The batch sizes `warmup` runs by default: where decode steps are captured, one per graph bucket up to
        the cache's `max_requests` (1-8, then powers of two; a bucket above `max_requests` is warmed with
        `max_requests` requests); where they run eagerly, 1 and `max_requests` (what differs between batch sizes
        then is only the shapes of eager launches)."""
        top = self.cache.max_requests
        if self.graphs is None:
            return tuple(sorted({1, top}))
        return tuple(sorted({min(request_bucket(n), top) for n in range(1, top + 1)}))

    def warmup(self, batch_sizes: Sequence[int] | None = None, max_context: int | None = None) -> WarmupReport:
        """Run, before the first request, the steps serving meets, so that no kernel is compiled and no decode graph
        captured while requests wait; return what ran (`WarmupReport`).

        On scratch requests (freed at the end; the batcher's stats start again from zero): one prompt of up to
        `WARMUP_PROMPT_TOKENS` tokens (a prefill through the dense path) decoding past the sink window, then for
        each of `batch_sizes` (default `default_warmup_batch_sizes()`) that many requests admitted together, of
        one-token prompts and of latent-path chunks (`NATIVE_MAX_QUERY` tokens) alternately, decoding through the
        sink window (eager steps) and past it (captured steps). Where decode steps are captured, the graph of
        every batch size and page-table width bucket up to `max_context` tokens (default `max_request_tokens`) is
        then captured on scratch requests holding that many pages (`PagedDecodeGraphs.warm`). Raises `ValueError`
        when a request is queued or a batch size is not between 1 and the cache's `max_requests`."""
        if self.has_work() or self.cache.requests:
            raise ValueError("warmup runs before any request: this batcher has requests queued or running")
        sizes = tuple(sorted(set(batch_sizes))) if batch_sizes is not None else self.default_warmup_batch_sizes()
        bad = [b for b in sizes if not 1 <= b <= self.cache.max_requests]
        if bad or not sizes:
            raise ValueError(f"warm-up batch sizes must be between 1 and the cache's max_requests "
                             f"({self.cache.max_requests}), got {list(batch_sizes or [])}")
        start = time.perf_counter()
        limit = self.max_request_tokens
        new_tokens = min(max(1, self.cache.sink_tokens) + 2, limit - 1)
        longest = max(1, min(self.max_batch_tokens, WARMUP_PROMPT_TOKENS, limit - new_tokens))
        chunk = min(NATIVE_MAX_QUERY, self.cache.recent_tokens or NATIVE_MAX_QUERY, longest)
        rounds = [[longest]] + [[1 if i % 2 == 0 else chunk for i in range(b)] for b in sizes]
        widths: tuple[int, ...] = ()
        with self.paged_attention_mode(), torch.inference_mode():
            for number, prompt_lens in enumerate(rounds):
                self._warm_round(number, prompt_lens, new_tokens)
            steps = self.stats.steps
            if self.graphs is not None:
                context = limit if max_context is None else max(1, min(max_context, limit))
                top = bucket(-(-context // self.cache.page_size))
                widths = tuple(1 << k for k in range(top.bit_length()))
                for b in sizes:
                    for w in widths:
                        self.graphs.warm(b, w)
        graphs = self.graphs.captures if self.graphs is not None else 0
        self.stats = BatchingStats(graph_captures=graphs)
        report = WarmupReport(time.perf_counter() - start, sizes, widths, steps, graphs)
        logger.info("quantmla continuous batching %s", report)
        return report

    def _warm_round(self, number: int, prompt_lens: list[int], new_tokens: int) -> None:
        """Scratch requests of `prompt_lens` tokens, admitted together, each generating `new_tokens` (greedy, no
        end token), stepped to the end and dropped from `finished`."""
        ids = [f"<warm-up {number}.{i}>" for i in range(len(prompt_lens))]
        for rid, n in zip(ids, prompt_lens):
            prompt = [(7 * i + 1) % self.vocab_size for i in range(n)]
            self.waiting.append(GenerationRequest(rid, prompt, new_tokens, self.stats.steps))
        while self.has_work():
            self.step()
        for rid in ids:
            self.finished.pop(rid, None)


def generate_batch(
    model, prompts: list[list[int]], max_new_tokens: int = 32, cache: PagedQuantMLACache | None = None,
    arrival_steps: list[int] | None = None, max_batch_tokens: int = 512, eos_token_id=None, generation_config=None,
    **cache_kwargs,
) -> tuple[list[list[int]], BatchingStats]:
    """Continuous batching of `prompts` (token id lists); returns each prompt's new tokens and the stats.

    Greedy by default; a transformers `GenerationConfig` sets `max_new_tokens`, `eos_token_id` and the sampling
    (`do_sample`, `temperature`, `top_k`, `top_p`) instead. Without `cache`, a `PagedQuantMLACache` is built from the
    model's `quantization_config` with `cache_kwargs` (`num_pages` or `budget_bytes`, `page_size`, `max_requests`).
    """
    sampling = None
    if generation_config is not None:
        max_new_tokens = generation_config.max_new_tokens or max_new_tokens
        eos_token_id = generation_config.eos_token_id if eos_token_id is None else eos_token_id
        sampling = Sampling.from_generation_config(generation_config)
    if cache is None:
        cache_kwargs.setdefault("max_requests", max(1, len(prompts)))
        if "num_pages" not in cache_kwargs and "budget_bytes" not in cache_kwargs:
            page = cache_kwargs.setdefault("page_size", 64)
            # every prompt and its answer, and the page a request leaves free (`max_request_tokens`)
            cache_kwargs["num_pages"] = sum(-(-(len(p) + max_new_tokens) // page) for p in prompts) + 1
        cache = PagedQuantMLACache(model.config, dtype=model.dtype, device=model.device, **cache_kwargs)
    batcher = ContinuousBatcher(model, cache, max_batch_tokens, eos_token_id)
    for i, p in enumerate(prompts):
        batcher.add_request(str(i), p, max_new_tokens, arrival_steps[i] if arrival_steps else 0, sampling=sampling)
    results = batcher.run()
    return [results[str(i)] for i in range(len(prompts))], batcher.stats
