"""Assisted generation and prompt lookup reproduce the model's own greedy tokens with the QuantMLA cache.

A draft of k tokens is verified in one chunk of k + 1 queries; each query must see the positions that one-token
decoding would have seen in the model dtype (its own recent window), and rejected drafts must leave the recent
window exactly as it was (crop).
"""

from __future__ import annotations

import pytest
import torch

from quantmla_hf import QuantMLACache, QuantMLAConfig, apply_quantmla
from quantmla_hf.integration import build_cache
from quantmla_hf.cache.growing import CACHE_KWARG as GENERATE_CACHE_KWARG
from quantmla_hf.tiny_models import tiny_mla_model

NEW_TOKENS = 40


def _model(recent: int, content_bits: int):
    config = QuantMLAConfig(transform="none", content_bits=content_bits, rope_bits=4, group_size=16, sink_tokens=2,
                            recent_tokens=recent, advanced={"kernel": "torch"})
    return apply_quantmla(tiny_mla_model("deepseek_v3", seed=11, num_hidden_layers=2), config)


def _prompt(length: int) -> torch.Tensor:
    # Repeated phrases, so prompt lookup finds drafts and verifies chunks of several tokens.
    phrase = torch.tensor([5, 17, 42, 8, 99, 23, 61, 7, 13, 88, 31])
    return phrase.repeat(length // len(phrase) + 1)[:length][None]


def _generate(model, ids, **kwargs):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS,
                              **kwargs)[0, ids.shape[1]:]


@pytest.mark.parametrize("recent", [16, 128])
@pytest.mark.parametrize("content_bits", [4, 2])
def test_prompt_lookup_and_assisted_generation_equal_greedy(recent, content_bits, one_thread):
    model = _model(recent, content_bits)
    ids = _prompt(recent + 24)  # the history soon reaches past the recent window
    greedy = _generate(model, ids)
    lookup = _generate(model, ids, prompt_lookup_num_tokens=4)
    assert torch.equal(lookup, greedy), (lookup, greedy)
    assistant = tiny_mla_model("deepseek_v3", seed=12, num_hidden_layers=1)
    assisted = _generate(model, ids, assistant_model=assistant)
    assert torch.equal(assisted, greedy), (assisted, greedy)


@pytest.mark.parametrize("recent", [16, 128])
@pytest.mark.parametrize("content_bits", [4, 2])
def test_each_query_of_a_chunk_sees_what_one_token_decoding_sees(recent, content_bits, one_thread):
    model = _model(recent, content_bits)
    ids, draft = _prompt(recent + 24), torch.tensor([[3, 9, 27, 81, 115, 91, 19]])
    chunked, one_by_one = build_cache(model), build_cache(model)
    with torch.no_grad():
        model(ids, **{GENERATE_CACHE_KWARG: chunked})
        model(ids, **{GENERATE_CACHE_KWARG: one_by_one})
        chunk_logits = model(draft, **{GENERATE_CACHE_KWARG: chunked}).logits[0]
        step_logits = torch.cat([model(draft[:, t:t + 1], **{GENERATE_CACHE_KWARG: one_by_one}).logits[0]
                                 for t in range(draft.shape[1])])
        torch.testing.assert_close(chunk_logits, step_logits, rtol=0, atol=2e-5)
        # reject the last 4 draft tokens, then decode on: the recent window was restored exactly
        accepted = build_cache(model)
        model(ids, **{GENERATE_CACHE_KWARG: accepted})
        for t in range(3):
            model(draft[:, t:t + 1], **{GENERATE_CACHE_KWARG: accepted})
        chunked.crop(-4)
        nxt = torch.tensor([[44]])
        torch.testing.assert_close(model(nxt, **{GENERATE_CACHE_KWARG: chunked}).logits,
                                   model(nxt, **{GENERATE_CACHE_KWARG: accepted}).logits, rtol=0, atol=2e-5)


def test_rejected_drafts_leave_the_recent_window_exact():
    model = tiny_mla_model("deepseek_v3", seed=11, num_hidden_layers=1)
    config = QuantMLAConfig(transform="none", content_bits=2, group_size=16, sink_tokens=2, recent_tokens=16)
    one_by_one, chunked = (QuantMLACache(config=model.config, quantization_config=config) for _ in range(2))
    torch.manual_seed(0)
    d_c, d_r = model.config.kv_lora_rank, model.config.qk_rope_head_dim
    history, draft = torch.randn(1, 1, 40, d_c + d_r), torch.randn(1, 1, 6, d_c + d_r)
    for cache in (one_by_one, chunked):
        cache.update(history[..., :d_c], history[..., d_c:], 0)
    one_by_one.update(draft[:, :, :2, :d_c], draft[:, :, :2, d_c:], 0)  # what survives the rejection
    chunked.update(draft[..., :d_c], draft[..., d_c:], 0)
    chunked.crop(-4)
    a, b = one_by_one.layers[0], chunked.layers[0]
    assert a.length == b.length == 42
    assert torch.equal(a.recent_content, b.recent_content) and torch.equal(a.recent_rope, b.recent_rope)
