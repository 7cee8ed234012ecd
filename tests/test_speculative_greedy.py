"""Assisted generation and prompt lookup reproduce the model's own greedy tokens with the QuantMLA cache.

A draft of k tokens is verified in one chunk of k + 1 queries, and the first verification feeds the prompt with its
drafts into an empty cache: each draft query must see the positions that one-token decoding would have seen in the
model dtype (its own recent window, older tokens from their packed copies), the prompt what its prefill sees, and
rejected drafts must leave the recent window exactly as it was (crop). The embedded reference model on real text
shows it; random models with repeated-token prompts hide it.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from quantmla_hf import QuantMLACache, QuantMLAConfig, apply_quantmla
from quantmla_hf.attention.interface import quantmla_attention_forward
from quantmla_hf.cache.growing import CACHE_KWARG as GENERATE_CACHE_KWARG
from quantmla_hf.cache.static import StaticQuantMLACache
from quantmla_hf.embedded import EVALUATION_TEXT, REFERENCE_MODEL
from quantmla_hf.integration import build_cache
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


def _generate(model, ids, new_tokens=NEW_TOKENS, **kwargs):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens,
                              **kwargs)[0, ids.shape[1]:]


@pytest.fixture(scope="module")
def reference_prompt():
    """A paragraph of the embedded evaluation text and the start of the next (222 tokens): past both recent windows,
    and ending in a word seen before, so prompt lookup drafts from the first verification on."""
    paragraphs = [p for p in EVALUATION_TEXT.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    text = paragraphs[0] + "\n\n" + " ".join(paragraphs[1].split()[:39])
    return AutoTokenizer.from_pretrained(REFERENCE_MODEL)(text, return_tensors="pt").input_ids


def _reference_model(recent: int, content_bits: int):
    config = QuantMLAConfig(transform="none", content_bits=content_bits, rope_bits=4, recent_tokens=recent,
                            advanced={"kernel": "torch"})
    return AutoModelForCausalLM.from_pretrained(REFERENCE_MODEL, dtype=torch.float32,
                                                quantization_config=config).eval()


def _forward_lengths(model) -> list[tuple[int, int]]:
    """(cached tokens, new tokens) of every forward of `model` from now on."""
    seen = []

    def hook(module, args, kwargs):
        cache = kwargs.get(GENERATE_CACHE_KWARG)
        seen.append((cache.get_seq_length(), kwargs["input_ids"].shape[1]))

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


@pytest.mark.parametrize("recent", [16, 128])
@pytest.mark.parametrize("content_bits", [4, 2])
def test_reference_model_speculative_decoding_equals_greedy(recent, content_bits, reference_prompt, one_thread):
    """Real text on the trained reference model (RTN): greedy, prompt lookup and assisted generation (the model its
    own assistant) give the same tokens, and the logits of every token agree with greedy's."""
    model = _reference_model(recent, content_bits)
    ids, new = reference_prompt, 32
    kw = {"max_new_tokens": new, "min_new_tokens": new, "do_sample": False, "output_logits": True,
          "return_dict_in_generate": True}
    with torch.no_grad():
        greedy = model.generate(ids, **kw)
        forwards = _forward_lengths(model)
        runs = {"prompt lookup": model.generate(ids, prompt_lookup_num_tokens=4, **kw)}
        lookup_forwards = list(forwards)
        runs["assisted"] = model.generate(ids, assistant_model=model, **kw)
    # Both first verifications fed the prompt with drafts (the case a plain prefill gets wrong).
    assert lookup_forwards[0][0] == 0 and lookup_forwards[0][1] > ids.shape[1], lookup_forwards[:3]
    assert any(f[0] == 0 and f[1] > ids.shape[1] for f in forwards[len(lookup_forwards):]), forwards
    for name, out in runs.items():
        assert torch.equal(out.sequences, greedy.sequences), f"{name}:\n{out.sequences}\n{greedy.sequences}"
        diff = (torch.stack(out.logits) - torch.stack(greedy.logits)).abs().max()
        assert diff <= 1e-4, f"{name}: logits differ from greedy's by up to {diff:.3g}"


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


@pytest.mark.parametrize("recent, prompt_length", [(16, 40), (8, 6), (0, 30)])
@pytest.mark.parametrize("content_bits", [4, 2])
def test_a_prompt_fed_with_its_drafts_is_a_prefill_then_decode_steps(recent, prompt_length, content_bits,
                                                                      one_thread):
    """The chunk rule on an empty cache: with `mark_drafts(P)`, a forward of P prompt tokens and 6 drafts gives the
    prompt's prefill logits and each draft's one-token decoding logits (a prompt past the recent window, one short
    enough for the latent-space prefill, no recent window); crop after it restores the window exactly."""
    model = _model(recent, content_bits)
    ids, draft = _prompt(prompt_length), torch.tensor([[3, 9, 27, 81, 115, 91]])
    marked, one_by_one = build_cache(model), build_cache(model)
    with torch.no_grad():
        marked.mark_drafts(prompt_length)
        chunk_logits = model(torch.cat([ids, draft], 1), **{GENERATE_CACHE_KWARG: marked}).logits[0]
        step_logits = torch.cat([model(ids, **{GENERATE_CACHE_KWARG: one_by_one}).logits[0]] + [
            model(draft[:, t:t + 1], **{GENERATE_CACHE_KWARG: one_by_one}).logits[0] for t in range(6)])
        torch.testing.assert_close(chunk_logits, step_logits, rtol=0, atol=2e-5)
        assert marked.layers[0].drafts_from is None  # the mark held for that forward only
        # reject the last 4 drafts, then decode on as after the prompt and the 2 accepted drafts one at a time
        accepted = build_cache(model)
        for chunk in (ids, draft[:, :1], draft[:, 1:2]):
            model(chunk, **{GENERATE_CACHE_KWARG: accepted})
        marked.crop(-4)
        nxt = torch.tensor([[44]])
        torch.testing.assert_close(model(nxt, **{GENERATE_CACHE_KWARG: marked}).logits,
                                   model(nxt, **{GENERATE_CACHE_KWARG: accepted}).logits, rtol=0, atol=2e-5)
        # Unmarked, the same forward is a plain prefill: the drafts see the whole chunk in the model dtype.
        plain = build_cache(model)
        plain_logits = model(torch.cat([ids, draft], 1), **{GENERATE_CACHE_KWARG: plain}).logits[0]
        assert plain.layers[0].chunk_window is None
    if recent and prompt_length > recent:
        assert (plain_logits[prompt_length:] - step_logits[prompt_length:]).abs().max() > 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", ["torch", "triton"])
@pytest.mark.parametrize("marked", [True, False])
def test_draft_queries_attend_as_the_one_token_step_bit_for_bit(dtype, kernel, marked, one_thread):
    """One attention module fed the same latents and queries: a prompt of 40 tokens with 6 drafts in one forward
    (marked) or 6 drafts after the cached prompt (unmarked) against a prefill of the prompt and 6 one-token steps.
    Every output is identical, prompt included; at kernel="triton" through the Triton decode kernels."""
    config = QuantMLAConfig(transform="none", content_bits=2, rope_bits=4, group_size=16, sink_tokens=2,
                            recent_tokens=16, advanced={"kernel": kernel})
    model = apply_quantmla(tiny_mla_model("deepseek_v3", seed=11, num_hidden_layers=1, dtype=dtype), config)
    attn = model.model.layers[0].self_attn
    g = torch.Generator().manual_seed(0)
    P, N, H = 40, 46, attn.config.num_attention_heads
    latent = torch.randn(1, 1, N, attn.kv_lora_rank, generator=g).to(dtype)
    k_rot = torch.randn(1, 1, N, attn.qk_rope_head_dim, generator=g).to(dtype)
    query = torch.randn(1, H, N, attn.qk_head_dim, generator=g).to(dtype)

    def attend(cache, lo, hi):
        state = attn._quantmla_state
        state.cache, state.mask_key = cache, None
        cache.set_native(True)
        key, value = attn.expand_kv(*cache.update(latent[:, :, lo:hi], k_rot[:, :, lo:hi], 0))
        return quantmla_attention_forward(attn, query[:, :, lo:hi], key, value, None, scaling=attn.scaling)[0]

    chunked, steps = build_cache(model), build_cache(model)
    if marked:
        chunked.mark_drafts(P)
        out = attend(chunked, 0, N)
    else:
        out = torch.cat([attend(chunked, 0, P), attend(chunked, P, N)], 1)
    want = torch.cat([attend(steps, 0, P)] + [attend(steps, t, t + 1) for t in range(P, N)], 1)
    assert torch.equal(out, want), (out - want).abs().amax(dim=(0, 2, 3))


@pytest.mark.parametrize("case", ["eager", "output_attentions", "recent_tokens=0", "static cache"])
def test_speculative_decoding_that_cannot_equal_greedy_is_refused(case):
    recent = 0 if case == "recent_tokens=0" else 16
    model = _model(recent, 4)
    if case == "eager":
        model.set_attn_implementation("eager")
    extra = {"output_attentions": True} if case == "output_attentions" else {}
    config = model.config.quantization_config

    def cache():
        if case != "static cache":
            return {}
        return {GENERATE_CACHE_KWARG: StaticQuantMLACache(config=model.config, quantization_config=config,
                                                         max_cache_len=80)}

    ids = _prompt(30)
    with pytest.raises(ValueError, match="would not reproduce greedy decoding") as err:
        _generate(model, ids, prompt_lookup_num_tokens=4, **extra, **cache())
    assert "prompt_lookup_num_tokens" in str(err.value)
    if recent:  # short enough that no query reads a packed copy: nothing to refuse
        _generate(model, ids[:, :2], new_tokens=recent, prompt_lookup_num_tokens=4, **extra, **cache())


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
