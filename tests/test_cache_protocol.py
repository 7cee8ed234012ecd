"""Every way transformers calls a cache, on `QuantMLACache` side by side with `DynamicCache`.

With 16-bit paths the QuantMLA cache stores exactly what it is given, so after any sequence of calls (update, crop
in the convention of the installed release, reorder, batch_repeat_interleave, batch_select_indices, reset,
offload/prefetch) it must return the same history, lengths and mask sizes as a `DynamicCache` fed the same calls.
Generation strategies that drive those calls per step (assisted decoding with an assistant model, prompt-lookup
decoding) must give the tokens of greedy decoding.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from quantmla_hf import QuantMLACache, QuantMLAConfig, apply_quantmla
from quantmla_hf.cache.growing import LEGACY_POSITIVE_CROP
from quantmla_hf.tiny_models import tiny_config, tiny_mla_model

D_C, D_R = 64, 16
EXACT = dict(content_bits=16, rope_bits=16, sink_tokens=2, recent_tokens=3, transform="none",
             advanced={"kernel": "torch"})


def _pair(batch=2, n=9, seed=0):
    """(DynamicCache, C16R16 QuantMLACache) fed the same `n` tokens per layer, and the generator for more."""
    config = tiny_config("deepseek_v3")
    dyn = DynamicCache(config=config)
    ours = QuantMLACache(config=config, quantization_config=QuantMLAConfig(**EXACT))
    g = torch.Generator().manual_seed(seed)
    _step(dyn, ours, g, batch, n)
    return dyn, ours, g


def _step(dyn, ours, g, batch, n):
    """Feed `n` new tokens to every layer of both caches; the returned histories must agree."""
    for idx in range(len(ours.layers)):
        c, r = torch.randn(batch, 1, n, D_C, generator=g), torch.randn(batch, 1, n, D_R, generator=g)
        want = dyn.update(c, r, idx)
        got = ours.update(c, r, idx)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"layer {idx}: history differs"


def _assert_same(dyn, ours):
    for idx, (d, q) in enumerate(zip(dyn.layers, ours.layers)):
        assert ours.get_seq_length(idx) == dyn.get_seq_length(idx)
        for q_len in (1, 5):
            assert ours.get_mask_sizes(q_len, idx) == dyn.get_mask_sizes(q_len, idx)
        if dyn.get_seq_length(idx) == 0:
            continue
        c, r = q.read_history()
        assert torch.equal(c, d.keys[:, 0]) and torch.equal(r, d.values[:, 0]), f"layer {idx}: stored tokens differ"


def _outcome(cache, amount):
    try:
        cache.crop(amount)
    except ValueError:
        return "refused"
    return cache.get_seq_length()


@pytest.mark.parametrize("amount", [-9, -5, -1, 0, 1, 4, 9, 12])
def test_crop_matches_dynamic_cache_in_the_installed_convention(amount):
    dyn, ours, g = _pair(n=9)
    assert _outcome(ours, amount) == _outcome(dyn, amount)
    _assert_same(dyn, ours)
    _step(dyn, ours, g, 2, 2)  # decoding goes on from the cropped state
    _assert_same(dyn, ours)


def test_crop_zero_keeps_everything_and_positive_follows_the_release():
    """`crop(0)` is what assisted decoding calls after a fully accepted draft (and DeferredStopCheck every step)."""
    _, ours, _ = _pair(n=9)
    ours.crop(0)
    assert ours.get_seq_length() == 9
    if LEGACY_POSITIVE_CROP:
        ours.crop(6)
        assert ours.get_seq_length() == 6
    else:
        with pytest.raises(ValueError, match="positive value"):
            ours.crop(6)
    assert ours.is_croppable


def test_crop_takes_the_tensor_count_of_assisted_decoding():
    """transformers 5.17 computes the count as `candidate_length - n_matches`, a 0-d integer tensor."""
    dyn, ours, _ = _pair(n=9)
    for amount in (torch.tensor(0), torch.tensor(-3)):
        dyn.crop(amount)
        ours.crop(amount)
        _assert_same(dyn, ours)
    with pytest.raises(TypeError, match="crop takes an int"):
        ours.crop(-1.0)


def test_crop_past_the_start_is_refused():
    _, ours, _ = _pair(n=4)
    with pytest.raises(ValueError, match="cannot remove 5 tokens from a cache holding 4"):
        ours.crop(-5)


@pytest.mark.parametrize(
    "op",
    [
        lambda c: c.reorder_cache(torch.tensor([1, 0, 2])),
        lambda c: c.batch_repeat_interleave(2),
        lambda c: c.batch_select_indices(torch.tensor([2, 0])),
        lambda c: c.reset(),
        lambda c: [c.offload(i) for i in range(len(c.layers))],
    ],
    ids=["reorder_cache", "batch_repeat_interleave", "batch_select_indices", "reset", "offload"],
)
def test_batch_operations_match_dynamic_cache(op):
    dyn, ours, g = _pair(batch=3, n=6)
    op(dyn)
    op(ours)
    if ours.get_seq_length() == 0 and dyn.get_seq_length() != 0:
        # transformers 5.17's DynamicLayer.reset zeroes its tensors but keeps their length (later releases empty
        # it); a reset cache is empty, so compare with an empty DynamicCache.
        dyn = DynamicCache(config=tiny_config("deepseek_v3"))
    _assert_same(dyn, ours)
    batch = dyn.layers[0].keys.shape[0] if dyn.get_seq_length() else 3
    for layer in ours.layers:
        layer.prefetch()
    _step(dyn, ours, g, batch, 1)
    _step(dyn, ours, g, batch, 4)
    _assert_same(dyn, ours)


def test_empty_cache_answers_like_dynamic_cache():
    config = tiny_config("deepseek_v3")
    dyn, ours = DynamicCache(config=config), QuantMLACache(config=config, quantization_config=QuantMLAConfig(**EXACT))
    _assert_same(dyn, ours)
    for cache in (dyn, ours):
        cache.crop(0)
        cache.reorder_cache(torch.tensor([0]))
    assert ours.get_seq_length() == dyn.get_seq_length() == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Cache(offloading=True) uses CUDA streams")
def test_offloading_cache_matches_dynamic_cache_on_cuda():
    config = tiny_config("deepseek_v3")
    dyn = DynamicCache(config=config, offloading=True)
    ours = QuantMLACache(config=config, quantization_config=QuantMLAConfig(**EXACT), offloading=True)
    g = torch.Generator().manual_seed(0)
    for n in (7, 1, 1):
        for idx in range(len(ours.layers)):
            c = torch.randn(2, 1, n, D_C, generator=g).cuda()
            r = torch.randn(2, 1, n, D_R, generator=g).cuda()
            want, got = dyn.update(c, r, idx), ours.update(c, r, idx)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.fixture(scope="module")
def models():
    """A tiny model (C16R16 and C4R4 copies) and, as assistant, the same weights with their own C16R16 cache: its
    drafts are (nearly) always accepted, so the main cache sees `crop(0)` and the assistant's cache its own crops."""
    out = {}
    for name, cfg in {
        "c16": QuantMLAConfig(**EXACT),
        "c4": QuantMLAConfig(content_bits=4, rope_bits=4, group_size=16, sink_tokens=2, recent_tokens=4,
                             transform="none", advanced={"kernel": "torch"}),
    }.items():
        out[name] = apply_quantmla(tiny_mla_model("deepseek_v3", seed=0), cfg)
    out["assistant"] = apply_quantmla(tiny_mla_model("deepseek_v3", seed=0), QuantMLAConfig(**EXACT))
    return out


def _prompt():
    # A repetitive prompt so that prompt lookup finds drafts and some of them are accepted.
    return torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 10, 11]])


@pytest.mark.parametrize("name", ["c16", "c4"])
@pytest.mark.parametrize("strategy", ["prompt_lookup", "assistant"])
def test_assisted_generation_gives_the_greedy_tokens(models, name, strategy):
    model = models[name]
    kw = dict(max_new_tokens=12, do_sample=False, return_dict_in_generate=True)
    greedy = model.generate(_prompt(), **kw).sequences
    extra = {"prompt_lookup_num_tokens": 4} if strategy == "prompt_lookup" else {"assistant_model": models["assistant"]}
    assisted = model.generate(_prompt(), **kw, **extra).sequences
    assert torch.equal(assisted, greedy), f"{strategy} on {name}:\n{assisted}\n{greedy}"
