"""Paged QuantMLA cache and continuous batching: many requests of different lengths share fixed-size pages."""

from .allocator import CacheBudgetExceeded, PageAllocator, page_bytes, pages_for_budget, protected_bytes_per_request
from .cache import PagedQuantMLACache, PagedRequest, PagedStep

__all__ = [
    "CacheBudgetExceeded",
    "PageAllocator",
    "PagedQuantMLACache",
    "PagedRequest",
    "PagedStep",
    "page_bytes",
    "pages_for_budget",
    "protected_bytes_per_request",
]
