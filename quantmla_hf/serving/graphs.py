"""CUDA-graph decode steps of continuous batching: a step whose requests all decode one token is replayed.

An eager forward spends most of a decode step on the host (docs/SERVING.md, "Captured decode steps").
`PagedDecodeGraphs` captures the forward of a decode-only step once per bucket `(requests, exact up to 8 and rounded
up to a power of two above; page-table width rounded up to a power of two)` and replays it:

- the captured step reads static buffers (`[1, nb]` input ids and positions; the `PagedStep` index tensors of `nb`
  one-token requests: lengths, page table, rows, write slots, recent-ring rows), filled before every replay from
  the step `PagedQuantMLACache.begin_step` built (pages are reserved on the host as in an eager step);
- rows past the real requests are padding: a token at position 0 of a scratch request on one page reserved from
  the allocator and the cache's scratch sink/recent row, so it writes and reads only those (its logits are
  dropped);
- the split grid of the paged kernel is fixed by the bucket's page-table width (`max_seq_len` = width x page size;
  the kernel sizes its splits from each request's device-side length);
- prefill chunks, a request whose new token still enters the sink copy, and a step whose capture failed run eagerly
  (the failure is logged once and graphs are off for the batcher).

Graphs share one memory pool (they are replayed one at a time); a capture is two eager warm-up forwards on the
step's own inputs (their cache writes are the ones the replay repeats) and the capture itself. A graph is captured
the first time its bucket occurs, or before any request by `warm` (`ContinuousBatcher.warmup`), on scratch
requests holding the bucket's width in pages.
"""

from __future__ import annotations

import torch

from ..attention.paged import PagedForward
from ..cache.paged import PagedQuantMLACache, PagedStep
from ..generation.graphs import CapturedStep, warm_up
from ..log import get_logger
from ..ops.decode import use_triton

logger = get_logger(__name__)


EXACT_REQUESTS = 8  # request counts up to this get a graph each; above it, powers of two


def bucket(n: int) -> int:
    """The power of two at or above `n` (the page-table width of a captured step)."""
    return 1 << max(0, int(n) - 1).bit_length()


def request_bucket(n: int) -> int:
    """Rows of the graph that serves `n` requests: `n` itself up to `EXACT_REQUESTS` (the paged kernel's split count
    follows the rows it is launched with, and few requests want long splits), else the power of two above."""
    return int(n) if n <= EXACT_REQUESTS else bucket(n)


def device_key(device, current_index: int) -> tuple[str, int | None]:
    """`(type, index)` of a device, a CUDA device without an index read as `current_index` ("cuda" is "cuda:0"
    when device 0 is current)."""
    device = torch.device(device)
    index = device.index if device.index is not None or device.type != "cuda" else current_index
    return device.type, index


def unsupported_reason(model, cache: PagedQuantMLACache) -> str | None:
    """Why decode steps of this model and cache cannot be captured, or None."""
    if cache.device.type != "cuda":
        return f"the paged cache is on {cache.device}, not a CUDA device"
    if not use_triton(cache.kernel, cache.device):
        return f"the paged cache's kernel is {cache.kernel!r}; captured steps need the Triton kernels"
    current = torch.cuda.current_device()
    devices = {device_key(t.device, current) for t in (*model.parameters(), *model.buffers())}
    if devices != {device_key(cache.device, current)}:
        return f"the model's weights are on {sorted(devices)}, not only on the cache's {cache.device}"
    if cache.quantization_config.advanced.decode_graphs is False:
        return "the cache's QuantMLAConfig has advanced decode_graphs=False"
    return None


class PagedDecodeGraphs:
    """The captured decode steps of one `ContinuousBatcher` (its model, cache and forward call)."""

    def __init__(self, cache: PagedQuantMLACache, forward):
        self.cache, self.forward = cache, forward
        self.captured: dict[tuple[int, int], CapturedStep] = {}
        self.pool = None
        self.scratch_page: int | None = None
        self.disabled: str | None = None
        self.captures = 0
        self.replays = 0

    # ---- when -------------------------------------------------------------------------------------------------
    def eligible(self, plan) -> bool:
        """A step of requests that each decode one token past the sink window (prompt fully cached)."""
        if self.disabled is not None:
            return False
        first = max(1, self.cache.sink_tokens)
        return all(q == 1 and r.cached >= first and r.cached == len(r.tokens) - 1 for r, q in plan)

    def _reserve_scratch(self) -> bool:
        """One page for the padding rows, held until `release` (False when none is free: the step runs eagerly)."""
        if self.scratch_page is None:
            if not self.cache.allocator.can_allocate(1):
                return False
            self.scratch_page = self.cache.allocator.allocate(1)[0]
        return True

    def release(self) -> None:
        """Return the scratch page to the cache and drop the graphs (they write to that page)."""
        if self.scratch_page is not None:
            self.cache.allocator.free([self.scratch_page])
            self.scratch_page = None
        self.captured.clear()

    # ---- one step ---------------------------------------------------------------------------------------------
    def run(self, plan, step: PagedStep) -> torch.Tensor | None:
        """Logits `[n, V]` of the decode step `step` (built by `begin_step` for `plan`), replayed from the graph of
        its bucket (captured first when new); None when the step must run eagerly (no scratch room, or capture
        failed)."""
        return self.replay([req.tokens[req.cached] for req, _ in plan], step)

    def replay(self, tokens: list[int], step: PagedStep) -> torch.Tensor | None:
        """`run` for the decode step `step` of `len(tokens)` requests whose new tokens are `tokens`."""
        n = len(tokens)
        key = (request_bucket(n), bucket(step.page_table.shape[1]))
        entry = self.captured.get(key)
        if entry is None:
            if not self._reserve_scratch():
                return None
            entry = self._new_entry(*key)
        self._fill(entry, tokens, step)
        if entry.graph is None:
            try:
                self._capture(entry)
            except Exception as err:  # noqa: BLE001 - any capture failure sends the batcher back to eager steps
                self.disabled = f"capturing a decode step failed ({type(err).__name__}: {err})"
                logger.warning("quantmla continuous batching: %s; decode steps run eagerly from now on",
                               self.disabled)
                torch.cuda.synchronize()
                return None
            self.captured[key] = entry
        entry.graph.replay()
        self.replays += 1
        return entry.output[:n]

    def warm(self, n: int, width: int, token: int = 0) -> bool:
        """Capture the graph that serves `n` decoding requests whose longest holds `width` pages (the buckets of
        both), unless it is captured already, and replay it once: on `n` scratch requests, the first holding pages
        of that width bucket, the others one token past the sink window, whose page contents are not read back
        (they are freed, with their rows, before returning). False when no graph was captured: the cache cannot
        hold such a step (too few free pages or rows), or capturing failed (graphs are then off, as in `run`)."""
        cache, ps = self.cache, self.cache.page_size
        if self.disabled is not None or (request_bucket(n), bucket(width)) in self.captured:
            return False
        if n > cache.free_rows or not self._reserve_scratch():
            return False
        first = max(1, cache.sink_tokens)
        short_pages = -(-(first + 1) // ps)
        long_pages = min(bucket(width), cache.allocator.num_free - (n - 1) * short_pages)
        if long_pages < 1 or bucket(long_pages) != bucket(width) or long_pages * ps - 1 < first:
            return False
        ids = [f"<graph warm-up {i}>" for i in range(n)]
        try:
            for i, rid in enumerate(ids):
                req = cache.add_request(rid)
                pages = long_pages if i == 0 else short_pages
                req.pages += cache.allocator.allocate(pages)
                req.length = pages * ps - 1 if i == 0 else first
            return self.replay([token] * n, cache.begin_step(ids, [1] * n)) is not None
        finally:
            for rid in ids:
                if rid in cache.requests:
                    cache.free_request(rid)

    def _new_entry(self, nb: int, width: int) -> CapturedStep:
        cache, dev = self.cache, self.cache.device
        arange = torch.arange(nb + 1, device=dev, dtype=torch.int32)
        rows = torch.arange(nb, device=dev)
        position_ids = torch.zeros((1, nb), device=dev, dtype=torch.long)
        step = PagedStep(
            request_ids=[f"<graph {i}>" for i in range(nb)], past_lens=[width * cache.page_size - 1] * nb,
            query_lens=[1] * nb, cu_seqlens_q=arange, cu_seqlens_k=arange, seq_lens=arange.new_ones(nb),
            page_table=arange.new_zeros((nb, width)), rows=arange.new_zeros(nb), token_request=arange[:nb],
            slots=rows.new_zeros(nb), positions=position_ids[0],
            sink_writes=rows.new_zeros((3, 0)), recent_writes=rows.new_zeros((3, nb if cache.recent_tokens else 0)),
            copy_rows=rows.new_full((2, nb), -1),
        )
        if cache.recent_tokens:
            step.recent_writes[0] = rows  # token i enters its request's ring
        ctx = PagedForward(cache, step, list(range(nb)), [])
        ctx.native_step = step
        ctx.native_tokens = rows
        # The forward's arguments: input ids [1, nb], position ids [1, nb], logits_to_keep [nb] (every row).
        inputs = dict(step=step, ctx=ctx, input_ids=rows.new_zeros((1, nb)), position_ids=position_ids,
                      logits_to_keep=rows)
        return CapturedStep(None, inputs)

    def _fill(self, entry: CapturedStep, tokens: list[int], step: PagedStep) -> None:
        """Copy the real step (its tokens, and the indices `begin_step` built) into the static buffers; rows past
        it become scratch padding: one token at position 0 of the scratch request."""
        s, n, ids = entry.inputs["step"], len(tokens), entry.inputs["input_ids"]
        nb = ids.shape[1]
        ids[0].copy_(torch.tensor(tokens + [0] * (nb - n)))
        s.positions[:n].copy_(step.positions)  # also the forward's position ids
        s.seq_lens[:n].copy_(step.seq_lens)
        s.rows[:n].copy_(step.rows)
        s.slots[:n].copy_(step.slots)
        s.page_table[:n, : step.page_table.shape[1]].copy_(step.page_table)
        if n < nb:
            s.positions[n:] = 0
            s.seq_lens[n:] = 1
            s.rows[n:] = self.cache.scratch_row
            s.slots[n:] = self.scratch_page * self.cache.page_size
            s.page_table[n:, 0] = self.scratch_page
        cache = self.cache
        # A decode step writes each token to its ring (no token enters the sink here), in the form the cache's
        # `write` reads: flat rows for the one-launch write, else (token, row, slot) triples.
        if cache.recent_tokens and cache.one_launch_write:
            s.copy_rows[1, :n].copy_(step.copy_rows[1])
            if n < nb:
                s.copy_rows[1, n:] = cache.scratch_row * cache.recent_tokens
        elif cache.recent_tokens:
            s.recent_writes[1:, :n].copy_(step.recent_writes[1:])
            if n < nb:
                s.recent_writes[1, n:] = cache.scratch_row
                s.recent_writes[2, n:] = 0

    def _forward(self, entry: CapturedStep) -> torch.Tensor:
        """Logits `[nb, V]` of the entry's step."""
        x = entry.inputs
        x["ctx"].new_latents.clear()
        return self.forward(x["ctx"], x["input_ids"], x["position_ids"], x["logits_to_keep"])

    def _capture(self, entry: CapturedStep) -> None:
        warm_up(lambda: self._forward(entry), self.cache.device)  # on the step's own inputs
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()  # graphs replayed one at a time share one pool
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            entry.output = self._forward(entry)
        entry.graph = graph
        self.captures += 1
