"""`PagedBatchingManager`: continuous batching on the paged QuantMLA cache (`ContinuousBatcher` on its
`BatcherThread`) behind the interface of the manager `model.init_continuous_batching()` returns, which
transformers' server drives from 5.25 on (its `CBGenerateRunner`, in the model's process): `add_request`,
`cancel_request`, `get_result` (each output carrying a request's tokens so far), `warmup`, `start`,
`logit_processor.supported_keys`, `batch_processor` and `background_thread_status`. The models
`serving_loader.PagedModelLoader` loads return it.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass, field

from .batching import ContinuousBatcher, Sampling
from .serving import BatcherThread, CacheOptions, paged_cache_for, prompt_ids

# the per-request sampling settings the manager takes, with their types (the runner converts the request's values)
SUPPORTED_SAMPLING = {"temperature": float, "top_k": int, "top_p": float}


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
class PagedOutput:
    """One request's state as the runner reads it: `generated_tokens` so far (a `TokenPrefix` while it streams,
    the list of all of them once finished), the error that failed it, and whether it ended."""

    request_id: str
    generated_tokens: "list[int] | TokenPrefix" = field(default_factory=list)
    error: str | None = None
    finished: bool = False

    def is_finished(self) -> bool:
        return self.finished


@dataclass
class _LogitProcessor:
    supported_keys: dict = field(default_factory=lambda: dict(SUPPORTED_SAMPLING))


@dataclass
class _ThreadStatus:
    fatal_error: str | None = None


class PagedBatchingManager:
    """Continuous batching of `model` on a paged QuantMLA cache sized by `options`, as transformers' runner drives
    its continuous-batching manager. Greedy unless a request sets sampling (`top_k = 1` is greedy)."""

    def __init__(self, model, options: CacheOptions):
        self.cache = paged_cache_for(model, options)
        self.batcher = ContinuousBatcher(model, self.cache, options.max_batch_tokens)
        self.thread: BatcherThread | None = None
        self.logit_processor = _LogitProcessor()
        self.batch_processor = None  # the runner's stats line then reports no queue
        self._results: queue.Queue = queue.Queue()

    @property
    def background_thread_status(self) -> _ThreadStatus:
        error = self.thread.error if self.thread is not None else None
        return _ThreadStatus(None if error is None else f"{type(error).__name__}: {error}")

    def warmup(self) -> None:
        """Nothing is compiled ahead of the first request."""

    def start(self) -> None:
        if self.thread is None:
            self.thread = BatcherThread(self.batcher)

    def stop(self) -> None:
        if self.thread is not None:
            self.thread.stop()

    def add_request(self, input_ids, request_id: str, streaming: bool = False, max_new_tokens: int | None = None,
                    eos_token_id=None, temperature: float | None = None, top_k: int | None = None,
                    top_p: float | None = None, **unused) -> None:
        """Queue a prompt (`input_ids`: `[1, T]` tensor or token list); its outputs arrive through `get_result`."""
        sampling = Sampling(top_k != 1, float(temperature or 1.0), top_k if top_k != 1 else None, top_p)
        tokens: list[int] = []

        def on_token(token: int) -> None:
            tokens.append(token)
            if streaming:  # a request that does not stream is read once, at its end
                self._results.put(PagedOutput(request_id, TokenPrefix(tokens, len(tokens))))

        def on_done(generated, error) -> None:
            self._results.put(PagedOutput(request_id, list(generated) or list(tokens),
                                          None if error is None else str(error), True))

        self.thread.submit(request_id, prompt_ids({"input_ids": input_ids}), max_new_tokens or 256, eos_token_id,
                           sampling, on_token, on_done)

    def cancel_request(self, request_id: str) -> None:
        self.thread.cancel(request_id)

    def get_result(self, timeout: float | None = None) -> PagedOutput | None:
        """The next output, waiting up to `timeout` seconds (0: none ready, None)."""
        try:
            return self._results.get(timeout=timeout) if timeout else self._results.get_nowait()
        except queue.Empty:
            return None
