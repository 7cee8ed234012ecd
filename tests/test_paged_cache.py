"""Paged QuantMLA cache: the page allocator, the budget arithmetic, and paged writes/reads against QuantMLACache."""

import pytest
import torch
from helpers import KERNEL_DEVICE, to_device

from quantmla_hf import QuantMLACache, QuantMLAConfig
from quantmla_hf.cache.allocator import (
    CacheBudgetExceeded,
    PageAllocator,
    pages_for_budget,
    protected_bytes_per_request,
)
from quantmla_hf.cache.paged import PagedQuantMLACache
from quantmla_hf.format import CacheFormat, PathFormat
from quantmla_hf.tiny_models import tiny_config


def test_allocator_alloc_free_reuse():
    a = PageAllocator(5)
    first = a.allocate(3)
    assert sorted(first) == [0, 1, 2] and a.num_free == 2 and a.num_used == 3
    a.free([first[1]])
    assert a.allocate(1) == [first[1]]  # a freed page is given again first
    with pytest.raises(CacheBudgetExceeded, match="3 pages asked for but 2 of 5 are free"):
        a.allocate(3)
    assert a.num_free == 2  # the failed call allocated nothing
    assert a.peak_used == 3
    with pytest.raises(ValueError, match="not allocated"):
        a.free([4])
    a.free(first)
    with pytest.raises(ValueError, match="not allocated"):
        a.free(first[:1])
    assert a.num_free == 5


def test_budget_holds_more_c4r4_tokens_than_bf16_latent():
    """The same bytes hold ~3.6x more C4R4 tokens than C16R16 (BF16 latent) tokens at DeepSeek widths."""
    L, page, requests = 27, 64, 8
    budget = 16 * 2**30
    c4 = CacheFormat(PathFormat(512, 4, 64), PathFormat(64, 4, 64))
    c16 = CacheFormat(PathFormat(512, 16, 64), PathFormat(64, 16, 64))
    assert protected_bytes_per_request(c16, L, torch.bfloat16) == 0
    assert protected_bytes_per_request(c4, L, torch.bfloat16) == 132 * 1152 * L
    n4 = pages_for_budget(budget, c4, L, page, requests, torch.bfloat16)
    n16 = pages_for_budget(budget, c16, L, page, requests, torch.bfloat16)
    assert n16 == budget // (page * 1152 * L)
    assert n4 == (budget - requests * 132 * 1152 * L) // (page * 315 * L)
    assert 3.6 < n4 / n16 < 1152 / 315
    with pytest.raises(ValueError, match="raise the budget"):
        pages_for_budget(10_000, c4, L, page, requests, torch.bfloat16)


def _cache(bits, page_size=4, num_pages=40, max_requests=4, sink=2, recent=5, model="deepseek_v3", kernel="torch"):
    def qconfig(kernel):
        return QuantMLAConfig(content_bits=bits, rope_bits=max(bits, 4), sink_tokens=sink, recent_tokens=recent,
                              advanced={"kernel": kernel})

    config = tiny_config(model)
    paged = PagedQuantMLACache(config, qconfig(kernel), page_size=page_size, max_requests=max_requests,
                               num_pages=num_pages, dtype=torch.float32,
                               device=KERNEL_DEVICE if kernel == "triton" else "cpu")
    return config, qconfig("torch"), paged  # the contiguous reference cache takes the returned config


def test_out_of_budget_is_all_or_nothing():
    _, _, paged = _cache(4, page_size=4, num_pages=3, max_requests=2)
    paged.end_step(paged.begin_step(["a"], [5]))  # 2 pages
    with pytest.raises(CacheBudgetExceeded, match="needs 2 pages"):
        paged.begin_step(["a", "b"], [4, 1])  # a: 9 tokens -> 1 more page, b: 1 page
    assert paged.allocator.num_free == 1 and "b" not in paged.requests and paged.get_seq_length("a") == 5
    assert paged.can_admit("a", 7) and not paged.can_admit("a", 8)  # 12 tokens fit 3 pages, 13 do not
    paged.end_step(paged.begin_step(["b"], [4]))
    assert not paged.can_admit("c", 1)  # no page left
    paged.free_request("a")
    assert paged.allocator.num_free == 2 and paged.can_admit("c", 8)
    with pytest.raises(CacheBudgetExceeded, match="request rows"):
        paged.begin_step(["c", "d"], [1, 1])  # two rows asked, one free (b holds the other)


def test_step_indices_follow_the_pages():
    """`begin_step`'s index tensors, stated position by position: a decode token, a chunk that crosses the sink
    window and a page edge, and a new request, with pages taken out of order."""
    _, _, paged = _cache(4, page_size=4, num_pages=12, sink=2, recent=5)
    paged.allocator.allocate(3)  # later pages come from further in the pool
    paged.end_step(paged.begin_step(["a", "b"], [6, 1]))
    step = paged.begin_step(["a", "b", "c"], [1, 7, 2])
    reqs = [paged.requests[r] for r in ("a", "b", "c")]
    past, q = [6, 1, 0], [1, 7, 2]
    assert step.page_table.dtype == torch.int32 and step.page_table.shape == (3, max(len(r.pages) for r in reqs))
    for i, r in enumerate(reqs):
        assert step.page_table[i, : len(r.pages)].tolist() == r.pages and not step.page_table[i, len(r.pages):].any()
    assert step.cu_seqlens_q.tolist() == [0, 1, 8, 10] and step.cu_seqlens_k.tolist() == [0, 7, 15, 17]
    assert step.seq_lens.tolist() == [7, 8, 2] and step.rows.tolist() == [r.row for r in reqs]
    assert step.token_request.tolist() == [0] + [1] * 7 + [2] * 2
    positions = [p for b, n in zip(past, q) for p in range(b, b + n)]
    assert step.positions.tolist() == positions
    assert step.slots.tolist() == [reqs[i].pages[p // 4] * 4 + p % 4 for i, p in zip(step.token_request.tolist(),
                                                                                      positions)]
    # sink: b's position 1 (token 1) and c's 0, 1 (tokens 8, 9); recent: the last 5 of each chunk, slot p % 5
    assert step.sink_writes.T.tolist() == [[1, reqs[1].row, 1], [8, reqs[2].row, 0], [9, reqs[2].row, 1]]
    recent = [[0, reqs[0].row, 1]] + [[t, reqs[1].row, (t) % 5] for t in range(3, 8)]
    recent += [[8, reqs[2].row, 0], [9, reqs[2].row, 1]]
    assert step.recent_writes.T.tolist() == recent
    assert all(t.dtype == torch.int32 for t in (step.cu_seqlens_q, step.seq_lens, step.rows, step.token_request))
    assert all(t.dtype == torch.int64 for t in (step.slots, step.positions, step.sink_writes, step.recent_writes))


@pytest.mark.parametrize("bits,kernel", [(4, "torch"), (2, "torch"), (16, "torch"), (4, "triton"), (2, "triton")])
def test_paged_writes_and_reads_match_contiguous_cache(bits, kernel):
    """Requests of different lengths arriving at different steps, chunked prefills mixed with decode steps: every
    request's packed bytes and every history the cache returns equal QuantMLACache's on that request alone (the
    paged writes through the reference or the Triton kernel, the contiguous cache through the reference)."""
    config, qc, paged = _cache(bits, kernel=kernel)
    L = paged.num_layers
    torch.manual_seed(0)
    lengths = {"a": 23, "b": 9, "c": 14}
    latents = {rid: (torch.randn(L, n, 64) * 3, torch.randn(L, n, 16)) for rid, n in lengths.items()}
    ref = {rid: QuantMLACache(config=config, quantization_config=qc) for rid in lengths}
    # (request, new tokens) per step: a prefills in chunks of 7, b arrives at step 1, c at step 2, then decode.
    schedule = [
        [("a", 7)],
        [("a", 7), ("b", 6)],
        [("a", 7), ("b", 1), ("c", 11)],
        [("a", 1), ("b", 1), ("c", 1)],
        [("a", 1), ("b", 1), ("c", 1)],
        [("c", 1)],
    ]
    done = dict.fromkeys(lengths, 0)
    for plan in schedule:
        rids, qs = [r for r, _ in plan], [q for _, q in plan]
        step = paged.begin_step(rids, qs)
        for layer in range(L):
            c = torch.cat([latents[r][0][layer, done[r] : done[r] + q] for r, q in plan])
            k = torch.cat([latents[r][1][layer, done[r] : done[r] + q] for r, q in plan])
            c, k = to_device((c, k), paged.device)
            paged.write(layer, step, c, k)
            hist_c, hist_k = to_device(paged.history(layer, step, c, k), "cpu")
            for i, (r, q) in enumerate(plan):
                exp_c, exp_k = ref[r].update(
                    latents[r][0][layer, None, None, done[r] : done[r] + q],
                    latents[r][1][layer, None, None, done[r] : done[r] + q], layer,
                )
                lo, hi = int(step.cu_seqlens_k[i]), int(step.cu_seqlens_k[i + 1])
                assert torch.equal(hist_c[lo:hi], exp_c[0, 0]) and torch.equal(hist_k[lo:hi], exp_k[0, 0])
        paged.end_step(step)
        for r, q in plan:
            done[r] += q
    for r, n in lengths.items():
        assert paged.get_seq_length(r) == n
        for layer in range(L):
            got_c, got_r = to_device(paged.request_planes(layer, r), "cpu")
            ref_layer = ref[r].layers[layer]
            for got, store in ((got_c, ref_layer.content), (got_r, ref_layer.rope)):
                for name, plane in got.items():
                    assert torch.equal(plane, store.planes[name][:, :n]), (r, layer, name)
    pages_held = sum(len(req.pages) for req in paged.requests.values())
    assert pages_held == sum(-(-n // paged.page_size) for n in lengths.values()) == paged.allocator.num_used
    paged.free_request("b")
    assert paged.allocator.num_used == pages_held - 3


def test_c16r16_keeps_no_protected_rows():
    _, _, c16 = _cache(16)
    _, _, c4 = _cache(4)
    assert c16.sink_tokens == c16.recent_tokens == 0 and c16.sink_content[0].numel() == 0
    # one row per request plus the scratch row of captured decode steps, never given to a request
    assert c4.sink_content[0].shape == (5, 2, 64) and c4.recent_rope[0].shape == (5, 5, 16)
    assert c4.scratch_row == 4 and c4.free_rows == 4 and 4 not in c4._free_rows


def test_bad_inputs_are_refused_clearly():
    config = tiny_config("deepseek_v3")
    with pytest.raises(ValueError, match="exactly one of num_pages and budget_bytes"):
        PagedQuantMLACache(config, QuantMLAConfig(), num_pages=4, budget_bytes=10**6)
    with pytest.raises(ValueError, match="transform='hadamard'"):
        PagedQuantMLACache(config, QuantMLAConfig(transform="hadamard"), num_pages=4)
    _, _, paged = _cache(4)
    step = paged.begin_step(["a"], [3])
    with pytest.raises(ValueError, match=r"expected latent \[3, 64\]"):
        paged.write(0, step, torch.zeros(2, 64), torch.zeros(2, 16))
    with pytest.raises(ValueError, match="at least one new token"):
        paged.begin_step(["b"], [0])
