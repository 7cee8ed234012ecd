"""Captured decode steps of continuous batching (`quantmla_hf.serving.graphs`), on the CPU.

What runs on the CPU is everything but the CUDA graph itself: when a step is captured, the static buffers filled from
each real step, the scratch padding of a bucket, the release of the scratch page and row. The graph is stood in for
by a replay that runs the captured forward again on the same buffers (what a CUDA graph replays), so the tokens must
equal `generate` on each request alone, with request counts that fill a bucket partly (10 of 16) and exact ones.
"""

from types import SimpleNamespace

import pytest
import torch

from quantmla_hf import QuantMLAConfig, apply_quantmla
from quantmla_hf.cache.paged import PagedQuantMLACache
from quantmla_hf.serving.batching import ContinuousBatcher
from quantmla_hf.serving.graphs import PagedDecodeGraphs, bucket, device_key, request_bucket, unsupported_reason
from quantmla_hf.tiny_models import tiny_mla_model


class BufferReplay(PagedDecodeGraphs):
    """The captured forward replayed by running it again on its static buffers (no CUDA on this machine)."""

    def _capture(self, entry):
        entry.output = self._forward(entry)
        entry.graph = SimpleNamespace(replay=lambda: entry.output.copy_(self._forward(entry)))
        self.captures += 1


def qconfig(bits, kernel="torch"):
    return QuantMLAConfig(content_bits=bits, rope_bits=bits, group_size=16, sink_tokens=2, recent_tokens=4,
                          transform="none", advanced={"kernel": kernel})


def alone(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def test_buckets():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 200)] == [1, 2, 4, 4, 8, 8, 16, 256]
    assert [request_bucket(n) for n in (1, 3, 5, 8, 9, 17, 200)] == [1, 3, 5, 8, 16, 32, 256]


def test_a_cuda_device_without_index_is_the_current_one():
    # a cache built on "cuda" and weights on "cuda:0" share a device when device 0 is current
    assert device_key("cuda", 0) == device_key("cuda:0", 0) == ("cuda", 0)
    assert device_key("cuda", 1) != device_key("cuda:0", 1)
    assert device_key("cpu", 0) == ("cpu", None)


def test_off_where_a_graph_cannot_run():
    model = apply_quantmla(tiny_mla_model("deepseek_v3", seed=3), qconfig(4))
    cache = PagedQuantMLACache(model.config, qconfig(4), page_size=4, max_requests=2, num_pages=8, dtype=model.dtype)
    assert "not a CUDA device" in unsupported_reason(model, cache)
    assert ContinuousBatcher(model, cache).graphs is None  # "auto": eager on the CPU, silently
    with pytest.raises(ValueError, match="decode_graphs=True, but the paged cache is on cpu"):
        ContinuousBatcher(model, cache, decode_graphs=True)
    with pytest.raises(ValueError, match="decode_graphs must be"):
        ContinuousBatcher(model, cache, decode_graphs="yes")


@pytest.mark.parametrize("bits", [4, 16])
def test_replayed_decode_steps_equal_generate_alone(bits):
    model = apply_quantmla(tiny_mla_model("deepseek_v3", seed=3), qconfig(bits))
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (7, 3, 12, 5, 9, 4, 6, 8, 10, 2)]
    # finishing at different steps: 10 requests (a graph of 16 rows, 6 of them padding), then 9, 8, ... 1 (exact)
    new = [9, 4, 6, 3, 5, 7, 2, 8, 4, 6]
    cache = PagedQuantMLACache(model.config, qconfig(bits), page_size=4, max_requests=10, num_pages=60,
                               dtype=model.dtype)
    batcher = ContinuousBatcher(model, cache, max_batch_tokens=128, decode_graphs=False)
    batcher.graphs = BufferReplay(cache, batcher._forward)
    for i, (p, n) in enumerate(zip(prompts, new)):
        batcher.add_request(str(i), p, n)
    results = batcher.run()
    assert [results[str(i)] for i in range(len(prompts))] == [alone(model, p, n) for p, n in zip(prompts, new)]
    stats = batcher.stats
    # the first step prefills; every later step decodes and is replayed
    assert stats.graph_steps == stats.steps - 1 == max(new) - 1
    assert stats.eager_seconds > 0 and stats.graph_seconds > 0  # the prefill step, the replayed ones
    running = [sum(n > k for n in new) for k in range(1, max(new))]  # requests in each decode step
    assert stats.graph_captures >= len({request_bucket(k) for k in running})
    assert cache.allocator.num_used == 0 and not cache.requests and cache.free_rows == 10  # scratch returned


def test_replayed_steps_through_the_triton_kernels():
    """The Triton kernels (the interpreter on the CPU): each layer's one-launch write reads the ring rows the static
    buffers carry, for 9 real tokens and the 7 padding ones of a graph of 16 rows (prompts longer than the ring:
    prefilled through the dense path, which the interpreter runs fast)."""
    model = apply_quantmla(tiny_mla_model("deepseek_v3", seed=3), qconfig(4))  # generate alone: the reference
    cache = PagedQuantMLACache(model.config, qconfig(4, "triton"), page_size=4, max_requests=9, num_pages=30,
                               dtype=model.dtype)
    assert cache.one_launch_write
    batcher = ContinuousBatcher(model, cache, max_batch_tokens=128, decode_graphs=False)
    batcher.graphs = BufferReplay(cache, batcher._forward)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (7, 5, 12, 5, 9, 6, 6, 8, 10)]
    for i, p in enumerate(prompts):
        batcher.add_request(str(i), p, 2)
    results = batcher.run()
    assert [results[str(i)] for i in range(len(prompts))] == [alone(model, p, 2) for p in prompts]
    assert batcher.stats.graph_steps == 1 and batcher.stats.graph_captures == 1


def test_prefill_chunks_and_sink_positions_run_eagerly():
    model = apply_quantmla(tiny_mla_model("deepseek_v3", seed=3), qconfig(4))
    cache = PagedQuantMLACache(model.config, qconfig(4), page_size=4, max_requests=2, num_pages=8, dtype=model.dtype)
    graphs = BufferReplay(cache, lambda *a: None)
    decoding = SimpleNamespace(cached=5, tokens=list(range(6)))
    assert graphs.eligible([(decoding, 1)])
    assert not graphs.eligible([(decoding, 1), (SimpleNamespace(cached=0, tokens=[1, 2, 3]), 3)])  # a prefill
    assert not graphs.eligible([(SimpleNamespace(cached=1, tokens=[1, 2]), 1)])  # its token enters the sink (S = 2)
    graphs.disabled = "capture failed"
    assert not graphs.eligible([(decoding, 1)])


def test_warmup_captures_every_bucket_before_the_first_request():
    """After `warmup`, requests of every batch size and length the cache holds are served without a capture, with
    the tokens of `generate` alone; the scratch requests left nothing behind but the graphs' scratch page."""
    model = apply_quantmla(tiny_mla_model("deepseek_v3", seed=3), qconfig(4))
    cache = PagedQuantMLACache(model.config, qconfig(4), page_size=4, max_requests=9, num_pages=20,
                               dtype=model.dtype)
    batcher = ContinuousBatcher(model, cache, max_batch_tokens=128, decode_graphs=False)
    batcher.graphs = BufferReplay(cache, batcher._forward)
    assert batcher.default_warmup_batch_sizes() == (1, 2, 3, 4, 5, 6, 7, 8, 9)
    report = batcher.warmup([1, 3, 9])
    assert report.widths == (1, 2, 4, 8, 16, 32)  # 19 pages of 4 tokens a request at most
    # every (rows, width) a step can have: the longest request and the others on one page each, and the scratch page
    possible = {(request_bucket(b), w) for b in (1, 3, 9) for w in report.widths if min(w, 19 - (b - 1)) > w // 2}
    assert set(batcher.graphs.captured) == possible and report.graphs == len(possible)
    assert cache.allocator.num_used == 1 and not cache.requests and cache.free_rows == 9  # the scratch page
    assert not batcher.finished and batcher.stats.steps == 0 and batcher.stats.graph_captures == report.graphs
    g = torch.Generator().manual_seed(7)
    lens, new = (3, 50, 9), (5, 20, 3)  # one request past 64 tokens (17 pages: width 32)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in lens]
    for i, (p, n) in enumerate(zip(prompts, new)):
        batcher.add_request(str(i), p, n, arrival_step=i)
    results = batcher.run()
    assert [results[str(i)] for i in range(len(prompts))] == [alone(model, p, n) for p, n in zip(prompts, new)]
    assert batcher.graphs.captures == report.graphs and batcher.stats.graph_steps > 0  # replayed, none captured
    with pytest.raises(ValueError, match="between 1 and the cache's max_requests"):
        batcher.warmup([10])
