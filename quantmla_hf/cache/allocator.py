"""Fixed-size pages of the paged QuantMLA cache: the allocator and the budget arithmetic.

A page holds `page_size` consecutive tokens of one request in every layer. Its bytes are the packed copies of those
tokens (`CacheFormat.packed_bytes_per_token`, the byte layout of `quantmla_hf/format.py`) times the number of cache
layers, so a fixed memory budget holds `1152 / 315 = 3.66x` more C4R4 tokens than BF16-latent (C16R16) tokens at
DeepSeek widths. Each running request also holds one row of model-dtype sink and recent copies (quantized formats
only); those rows are paid out of the same budget before the pages (`pages_for_budget`).
"""

from __future__ import annotations

import torch

from ..format import CacheFormat


class CacheBudgetExceeded(RuntimeError):
    """The paged cache has no room left for the tokens asked for. Nothing was allocated by the failed call: finish or
    free requests (or preempt one) and retry, or build the cache with a larger budget."""


def protected_bytes_per_request(fmt: CacheFormat, num_layers: int, dtype: torch.dtype) -> int:
    """Bytes of one request's model-dtype sink and recent copies over all layers (0 when nothing is quantized: at
    16 bits the pages already hold the model-dtype values)."""
    if not (fmt.content.quantized or fmt.rope.quantized):
        return 0
    return (fmt.sink_tokens + fmt.recent_tokens) * fmt.dense_bytes_per_token(dtype) * num_layers


def page_bytes(fmt: CacheFormat, num_layers: int, page_size: int, dtype: torch.dtype) -> int:
    """Bytes of one page: `page_size` tokens of packed content and RoPE paths in every layer."""
    return page_size * fmt.packed_bytes_per_token(dtype) * num_layers


def pages_for_budget(
    budget_bytes: int, fmt: CacheFormat, num_layers: int, page_size: int, max_requests: int, dtype: torch.dtype
) -> int:
    """Pages that fit `budget_bytes` once `max_requests` rows of sink/recent copies are paid for.

    Raises `ValueError` when the budget does not even hold those rows and one page.
    """
    protected = max_requests * protected_bytes_per_request(fmt, num_layers, dtype)
    per_page = page_bytes(fmt, num_layers, page_size, dtype)
    n = (budget_bytes - protected) // per_page
    if n < 1:
        raise ValueError(
            f"a budget of {budget_bytes} bytes holds no page of {fmt.name}: {max_requests} requests' sink/recent "
            f"copies take {protected} bytes and a page of {page_size} tokens {per_page} bytes; raise the budget or "
            "lower max_requests / page_size"
        )
    return int(n)


class PageAllocator:
    """Free list of `num_pages` page ids. Freed pages are reused first (last freed, first given).

    Args:
        num_pages: pages the cache holds.
    """

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        # Popped from the end: page 0 is given first, and a freed page is the next one given.
        self._free = list(range(num_pages - 1, -1, -1))
        self._used: set[int] = set()
        self.peak_used = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take `n` pages. Raises `CacheBudgetExceeded` (allocating nothing) when fewer than `n` are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            raise CacheBudgetExceeded(
                f"{n} pages asked for but {len(self._free)} of {self.num_pages} are free: finish or preempt a "
                "request first, or build the cache with a larger budget"
            )
        pages = [self._free.pop() for _ in range(n)]
        self._used.update(pages)
        self.peak_used = max(self.peak_used, len(self._used))
        return pages

    def free(self, pages: list[int]) -> None:
        """Return `pages`. Raises `ValueError` for a page that is not allocated (double free, foreign id)."""
        bad = [p for p in pages if p not in self._used]
        if bad or len(set(pages)) != len(pages):
            raise ValueError(f"pages {bad or pages} are not allocated (freed twice?)")
        for p in reversed(pages):
            self._used.discard(p)
            self._free.append(p)
