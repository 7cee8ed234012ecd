"""Continuous batching on the paged QuantMLA cache: each request's greedy tokens equal `generate` on it alone.

Tiny models of every MLA family; requests of mixed lengths arriving at different steps, prefill chunks mixed with
decode steps (a token budget smaller than the prompts), C16R16 (the BF16-latent baseline through the same pages)
and C4R4 (against its own `generate` on the contiguous QuantMLACache).
"""

import pytest
import torch
from helpers import KERNEL_DEVICE

from quantmla_hf import QuantMLAConfig, apply_quantmla
from quantmla_hf.cache.paged import PagedQuantMLACache
from quantmla_hf.serving.batching import ContinuousBatcher, RequestTooLong, generate_batch
from quantmla_hf.tiny_models import TINY_FAMILIES, tiny_mla_model

NEW_TOKENS = 5
PROMPT_LENS = (5, 13, 1, 9)
ARRIVALS = (0, 0, 2, 3)


def qconfig(bits, kernel="torch"):
    return QuantMLAConfig(content_bits=bits, rope_bits=bits, group_size=16, sink_tokens=2, recent_tokens=4,
                          transform="none", advanced={"kernel": kernel})


def prompts(seed=1, lens=PROMPT_LENS):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (n,), generator=g).tolist() for n in lens]


def alone(model, prompt, n=NEW_TOKENS):
    out = model.generate(torch.tensor([prompt], device=model.device), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("bits", [16, 4])
@pytest.mark.parametrize("family", sorted(TINY_FAMILIES))
def test_outputs_equal_generate_alone(family, bits):
    model = apply_quantmla(tiny_mla_model(family, seed=3), qconfig(bits))
    ps = prompts()
    outs, stats = generate_batch(model, ps, NEW_TOKENS, arrival_steps=list(ARRIVALS), max_batch_tokens=16,
                                 page_size=4)
    assert outs == [alone(model, p) for p in ps]
    assert stats.preemptions == 0 and stats.generated_tokens == NEW_TOKENS * len(ps)
    assert stats.peak_running == len(ps)  # the late arrivals joined requests already decoding
    assert stats.graph_steps == 0 and stats.graph_seconds == 0 and stats.eager_seconds > 0  # no CUDA: eager steps


@pytest.mark.parametrize("family", ["deepseek_v3", "longcat_flash"])
def test_chunked_prefill_of_prompts_longer_than_a_forward(family):
    """Prompts of 13 and 9 tokens with 8 tokens per forward: prefilled in chunks beside decode steps (C16R16, where
    chunking changes nothing but the float order)."""
    model = apply_quantmla(tiny_mla_model(family, seed=3), qconfig(16))
    ps = prompts()
    outs, stats = generate_batch(model, ps, NEW_TOKENS, arrival_steps=list(ARRIVALS), max_batch_tokens=8,
                                 page_size=4)
    assert outs == [alone(model, p) for p in ps]
    assert stats.forward_tokens == sum(PROMPT_LENS) + (NEW_TOKENS - 1) * len(ps)


def test_triton_kernels_in_the_loop():
    """Quantization and latent decode through the Triton kernels (compiled on a GPU, the interpreter on CPU) give the
    same tokens."""
    model = apply_quantmla(tiny_mla_model("deepseek_v3", seed=3), qconfig(4)).to(KERNEL_DEVICE)
    cache = PagedQuantMLACache(model.config, qconfig(4, kernel="triton"), page_size=4, max_requests=3, num_pages=16,
                               dtype=model.dtype, device=KERNEL_DEVICE)
    ps = prompts(lens=(6, 3, 11))
    outs, _ = generate_batch(model, ps, 4, cache=cache, max_batch_tokens=16)
    assert outs == [alone(model, p, 4) for p in ps]


def test_preemption_under_pressure_recomputes_and_counts():
    """Pages for two requests' prompts but not for all four growing together: the newest running request is
    preempted, recomputed later, and every output still equals generate alone (C16R16: recomputation is exact)."""
    model = apply_quantmla(tiny_mla_model("deepseek_v3", seed=3), qconfig(16))
    ps = prompts(lens=(7, 6, 8, 5))
    cache = PagedQuantMLACache(model.config, qconfig(16), page_size=4, max_requests=4, num_pages=9, dtype=model.dtype)
    batcher = ContinuousBatcher(model, cache, max_batch_tokens=32)
    for i, p in enumerate(ps):
        batcher.add_request(str(i), p, 6)
    results = batcher.run()
    assert batcher.stats.preemptions > 0
    assert [results[str(i)] for i in range(4)] == [alone(model, p, 6) for p in ps]
    assert cache.allocator.num_used == 0 and not cache.requests  # everything returned at the end
    assert batcher.stats.peak_pages <= 9


def test_long_prompts_wait_for_room_instead_of_thrashing():
    """Two 20-token prompts chunked 8 tokens a forward, pages for one and a half of them: the second is admitted only
    once the first finished (it would otherwise take pages chunk by chunk, run out half-way and be recomputed again
    and again), so nothing is preempted and each prompt is computed once."""
    model = apply_quantmla(tiny_mla_model("deepseek_v3", seed=3), qconfig(16))
    ps = prompts(lens=(20, 20))
    cache = PagedQuantMLACache(model.config, qconfig(16), page_size=4, max_requests=2, num_pages=8, dtype=model.dtype)
    batcher = ContinuousBatcher(model, cache, max_batch_tokens=8)
    for i, p in enumerate(ps):
        batcher.add_request(str(i), p, 4)
    results = batcher.run()
    assert [results[str(i)] for i in range(2)] == [alone(model, p, 4) for p in ps]
    assert batcher.stats.preemptions == 0 and batcher.stats.peak_running == 1
    assert batcher.stats.forward_tokens == 2 * (20 + 3)


def test_prompts_too_long_for_the_cache_or_the_context_are_refused_and_answers_cut():
    """A request holds the cache's pages less one (3 x 4 tokens here) and at most the model's context: a prompt that
    leaves no room for an answer is refused when it is added, a longer answer is cut at that length."""
    model = apply_quantmla(tiny_mla_model("deepseek_v3", seed=3, max_position_embeddings=32), qconfig(4))
    cache = PagedQuantMLACache(model.config, qconfig(4), page_size=4, max_requests=2, num_pages=4, dtype=model.dtype)
    batcher = ContinuousBatcher(model, cache)
    assert batcher.max_request_tokens == 12
    with pytest.raises(RequestTooLong, match="prompt of 12 tokens, but a request holds at most 12 tokens.*larger"):
        batcher.add_request("long", list(range(12)), 2)
    with pytest.raises(ValueError, match="empty prompt"):
        batcher.add_request("empty", [], 2)
    batcher.add_request("cut", list(range(9)), 100)
    assert batcher.run()["cut"] == alone(model, list(range(9)), 3)  # 9 + 3 = 12 tokens
    roomy = PagedQuantMLACache(model.config, qconfig(4), page_size=4, max_requests=2, num_pages=40, dtype=model.dtype)
    assert ContinuousBatcher(model, roomy).max_request_tokens == 32  # the context binds
    with pytest.raises(RequestTooLong, match="context of 32"):
        generate_batch(model, [list(range(32))], 2, cache=roomy)


def test_generation_config_sets_length_end_token_and_sampling():
    from transformers import GenerationConfig

    model = apply_quantmla(tiny_mla_model("deepseek_v3", seed=3), qconfig(16))
    ps = prompts(lens=(6, 9))
    greedy, _ = generate_batch(model, ps, generation_config=GenerationConfig(max_new_tokens=4, do_sample=False))
    assert greedy == [alone(model, p, 4) for p in ps]
    stop = greedy[0][1]  # the first request's second token ends it
    ended, _ = generate_batch(model, ps, generation_config=GenerationConfig(max_new_tokens=4, eos_token_id=stop))
    assert ended[0] == greedy[0][: greedy[0].index(stop) + 1]
    torch.manual_seed(0)
    sampled, _ = generate_batch(model, ps, generation_config=GenerationConfig(max_new_tokens=4, do_sample=True,
                                                                              temperature=5.0))
    assert [len(s) for s in sampled] == [4, 4] and sampled != greedy  # hot sampling leaves the greedy path


def test_transformers_generate_batch_runs_on_the_paged_cache():
    """transformers' own `generate_batch` and `continuous_batching_context_manager` of a QuantMLA model: its
    `GenerationOutput`s by request id, each request's greedy tokens those of `generate` alone, on the paged C4R4 cache
    (the stock manager refuses the "quantmla" attention)."""
    from transformers import GenerationConfig
    from transformers.generation.continuous_batching import RequestStatus

    from quantmla_hf.serving.manager import PagedBatchingManager

    model = apply_quantmla(tiny_mla_model("deepseek_v3", seed=3), qconfig(4))
    model.config.eos_token_id = model.generation_config.eos_token_id = None  # as many tokens as generate's
    ps = prompts()
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False)
    out = model.generate_batch(ps, generation_config=config)
    assert list(out) == [f"req_{i}" for i in range(len(ps))]
    assert [o.generated_tokens for o in out.values()] == [alone(model, p) for p in ps]
    assert all(o.status == RequestStatus.FINISHED and o.error is None and o.prompt_ids == p
               for o, p in zip(out.values(), ps))
    with model.continuous_batching_context_manager(generation_config=config, persistent_manager=True) as manager:
        assert isinstance(manager, PagedBatchingManager) and manager.cache.format.name == "C4R4"
        assert manager.warmed_up and manager.warmup_report.steps > 0
        rid = manager.add_request(ps[1], streaming=True, max_new_tokens=3)
        streamed = [list(o.generated_tokens) for o in manager.request_id_iter(rid)]
    assert streamed[-1] == alone(model, ps[1], 3) and [len(s) for s in streamed] == [1, 2, 3, 3]  # then finished
    assert model.init_continuous_batching() is manager  # kept for the next call, with its warm cache
    model.destroy_cached_continuous_batching_manager()
    assert manager.cache.allocator.num_used == 0 and "_cached_continuous_batching_manager" not in model.__dict__
    model.dequantize()
    assert "init_continuous_batching" not in model.__dict__  # transformers' own method again


def test_continuous_batching_api_outside_the_supported_releases_names_quantmla_serve(monkeypatch):
    from quantmla_hf.serving import continuous_api

    assert all(map(continuous_api.supported, [(5, 17), (5, 25)]))
    assert not any(map(continuous_api.supported, [(5, 16), (5, 26)]))
    # the module object the check reads (transformers' lazy module can be replaced in sys.modules meanwhile)
    monkeypatch.setattr(continuous_api.transformers, "__version__", "5.26.0")
    model = apply_quantmla(tiny_mla_model("deepseek_v3", seed=3), qconfig(4))
    for call in (lambda: model.generate_batch([[1, 2]]), model.init_continuous_batching):
        with pytest.raises(NotImplementedError, match="transformers 5.26.0. Serve it with `quantmla serve`"):
            call()
