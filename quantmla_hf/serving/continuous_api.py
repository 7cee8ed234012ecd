"""transformers' own continuous-batching API on a QuantMLA model: `model.generate_batch(...)`,
`model.continuous_batching_context_manager(...)` and `model.init_continuous_batching(...)` run on the paged packed
cache.

In transformers 5.17 to 5.25 (`generation/continuous_batching/continuous_api.py`, `ContinuousMixin`),
`generate_batch` runs inside `continuous_batching_context_manager`, which gets its manager from
`self.init_continuous_batching(generation_config, continuous_batching_config, workload_hints)` and then calls the
manager's `warmup`, `start`, `add_requests`, `get_result`, `is_running`, `stop` and `destroy`. The stock manager
refuses a QuantMLA model ("Implementation quantmla is not supported for continuous batching") and would build K/V
pages MLA does not have; a QuantMLA model's `init_continuous_batching` (`quantmla_hf.hooks`) returns a
`manager.PagedBatchingManager` instead, and the stock `generate_batch` and context manager run on it unchanged: same
arguments, same `dict[request_id, GenerationOutput]` result, each request's greedy tokens those of `generate` on it
alone. Outside that range the three methods raise an error naming `quantmla serve` and
`quantmla_hf.serving.batching.generate_batch`.

`ContinuousBatchingConfig` and `WorkloadHints` size the cache (`cache_options`).
"""

from __future__ import annotations

import torch
import transformers
from packaging import version

from .manager import CacheOptions, PagedBatchingManager

# The transformers releases whose generate_batch / context manager reach the manager through
# `self.init_continuous_batching` and read it through the methods `PagedBatchingManager` has.
SUPPORTED_RANGE = ((5, 17), (5, 26))
# transformers' default page (K/V block) size: replaced by the paged cache's 64, the decode kernels' token tile.
TRANSFORMERS_PAGE_SIZE = 256
PAGE_SIZE = 64
MAX_REQUESTS = 64

# The model attribute where `quantmla serve`'s loader leaves the `(CacheOptions, tokenizer)` it serves with.
SERVE_OPTIONS = "_quantmla_serve_options"


def supported(release: tuple[int, ...] | None = None) -> bool:
    """Whether transformers `release` (default: the installed one) runs its continuous-batching API on the paged
    cache (through `quantmla_hf.hooks`)."""
    release = release or version.parse(transformers.__version__).release
    return SUPPORTED_RANGE[0] <= tuple(release[:2]) < SUPPORTED_RANGE[1]


def cache_options(model, continuous_batching_config=None, workload_hints=None) -> CacheOptions:
    """The paged cache and batcher transformers' settings ask for:

    - `page_size` (`block_size` in 5.17): as given, unless it is transformers' default 256 (64 then);
    - `num_blocks` -> the number of pages; `max_batch_tokens` (default the longer of 2048 and the longest hinted
      prompt, so that a prompt is prefilled whole as `generate` prefills it); `max_requests_per_batch` -> the
      requests running at once (default the hinted request count, at most 64);
    - without `num_blocks`: with hints of the prompt and answer lengths (what `generate_batch` gives), pages for that
      many requests at those lengths; else `max_memory_percent` (default 0.9) of the free memory of the model's
      CUDA device, or 1 GiB elsewhere.
    Warm-up covers contexts up to the hinted prompt and answer lengths (default: any)."""
    cb, hints = continuous_batching_config, workload_hints
    page = getattr(cb, "page_size", None) or getattr(cb, "block_size", None)
    page = PAGE_SIZE if page in (None, TRANSFORMERS_PAGE_SIZE) else int(page)
    hinted = int(getattr(hints, "num_requests", 0) or 0)
    max_requests = int(getattr(cb, "max_requests_per_batch", None) or min(hinted or MAX_REQUESTS, MAX_REQUESTS))
    prompt, answer = (int(getattr(hints, name, 0) or 0) for name in ("max_prompt_length", "max_generated_length"))
    max_batch_tokens = int(getattr(cb, "max_batch_tokens", None) or max(2048, prompt))
    num_pages, budget_gib, context = getattr(cb, "num_blocks", None), None, None
    if prompt and answer:
        context = prompt + answer
        if num_pages is None:  # every running request at the hinted length, and the page kept free for graphs
            num_pages = max_requests * -(-(context + 1) // page) + 1
    elif num_pages is None and model.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(model.device)
        budget_gib = (getattr(cb, "max_memory_percent", None) or 0.9) * free / 2**30
    return CacheOptions(budget_gib, num_pages, page, max_requests, max_batch_tokens, warmup_context=context)


def init_continuous_batching(model, generation_config=None, continuous_batching_config=None,
                             workload_hints=None) -> PagedBatchingManager:
    """transformers' `init_continuous_batching` on the paged QuantMLA cache (`hooks.QuantMLAModel` calls it): a
    `PagedBatchingManager` sized by `continuous_batching_config` and `workload_hints` (`cache_options`), or by the
    options `quantmla serve` loaded the model with (`SERVE_OPTIONS`), with `generation_config` (default the
    model's) as the requests' defaults; the manager kept by `stop(keep_for_next_session=True)` is returned again."""
    cached = model.__dict__.get("_cached_continuous_batching_manager")
    if isinstance(cached, PagedBatchingManager):
        return cached
    served = model.__dict__.get(SERVE_OPTIONS)
    if served is not None:
        options, tokenizer = served
        return PagedBatchingManager(model, options, tokenizer=tokenizer)
    gen_config = generation_config if generation_config is not None else model.generation_config
    if (getattr(gen_config, "num_return_sequences", None) or 1) > 1:
        raise ValueError(f"num_return_sequences={gen_config.num_return_sequences}: continuous batching on the paged "
                         "QuantMLA cache returns one sequence per prompt; repeat the prompt instead")
    return PagedBatchingManager(model, cache_options(model, continuous_batching_config, workload_hints), gen_config,
                                announce=False)


def destroy_cached_manager(model) -> None:
    """Destroy the manager `stop(keep_for_next_session=True)` kept on `model`."""
    cached = model.__dict__.pop("_cached_continuous_batching_manager", None)
    if isinstance(cached, PagedBatchingManager):
        cached.destroy()


def check_supported(name: str) -> None:
    """Refuse transformers' continuous-batching method `name` outside the releases this module serves."""
    if not supported():
        raise NotImplementedError(
            f"{name} of a QuantMLA model runs on the paged packed cache with transformers "
            f"{'.'.join(map(str, SUPPORTED_RANGE[0]))} to {SUPPORTED_RANGE[1][0]}.{SUPPORTED_RANGE[1][1] - 1}; this "
            f"is transformers {transformers.__version__}. Serve it with `quantmla serve` (an OpenAI-compatible "
            "server) or batch it with quantmla_hf.serving.batching.generate_batch(model, prompts, ...)"
        )
