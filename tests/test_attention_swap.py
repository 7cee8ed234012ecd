"""End to end: the "quantmla" attention (absorbed decode on the packed cache) equals stock attention over the
same QuantMLACache (which dequantizes the history for it), on every tiny MLA family, fp32.

Small sink/recent windows (2 + 4) make most of the history quantized, so the kernel's packed path is exercised.
"""

import pytest
import torch
from helpers import CACHE_KWARG, KERNEL_DEVICE, assert_close, to_device
from transformers import DynamicCache

from quantmla_hf import QuantMLACache, QuantMLAConfig, install_cache_hooks
from quantmla_hf.attention.masks import expected_mask
from quantmla_hf.tiny_models import TINY_FAMILIES, tiny_mla_model

TOL = 1e-4


def _prompt(batch=2, length=9, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding of row 1
    return ids, mask


def _cache(model, kernel, **q):
    cfg = QuantMLAConfig(content_bits=q.pop("content_bits", 4), rope_bits=q.pop("rope_bits", 4), sink_tokens=2,
                         recent_tokens=4, transform=q.pop("transform", "none"), **q, advanced={"kernel": kernel})
    return QuantMLACache(config=model.config, quantization_config=cfg)


def _generate(model, impl, cache, ids, mask, **kw):
    model.set_attn_implementation(impl)
    kwargs = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, output_logits=True,
                  return_dict_in_generate=True, **kw)
    return model.generate(ids, **kwargs, **{CACHE_KWARG: cache})


# The Triton interpreter is slow (the quantize kernel of every cache write runs in it too), so the Triton decode
# kernel runs end to end on one family here; tests/test_mla_decode.py covers it against the reference in depth.
CASES = [(m, "torch") for m in sorted(TINY_FAMILIES)] + [("deepseek_v3", "triton")]


@pytest.mark.parametrize("model_type, kernel", CASES)
def test_native_decode_matches_stock_attention(model_type, kernel):
    device = KERNEL_DEVICE if kernel == "triton" else "cpu"
    model = tiny_mla_model(model_type).to(device)
    install_cache_hooks(model)
    ids, mask = to_device(_prompt(), device)
    # Both cache kernels write identical codes (tests/test_cache.py), so the stock side may use the fast one.
    stock = _generate(model, "sdpa", _cache(model, "torch"), ids, mask)
    cache = _cache(model, kernel)
    out = _generate(model, "quantmla", cache, ids, mask)
    assert all(layer.last_update_native for layer in cache.layers)
    assert cache.get_seq_length() > 2 + 4 + 3, "the history must hold quantized tokens"
    assert torch.equal(out.sequences, stock.sequences)
    for a, b in zip(out.logits, stock.logits):
        assert_close("logits", b, a, TOL)
    # Sanity: low-bit logits really differ from the unquantized cache, so the comparison above is not vacuous.
    exact = _generate(model, "sdpa", DynamicCache(config=model.config), ids, mask)
    assert max((a - b).abs().max() for a, b in zip(exact.logits[1:], stock.logits[1:])) > 1e-4


@pytest.mark.parametrize("model_type", ["deepseek_v3", "longcat_flash"])
def test_several_query_tokens_against_a_cache(model_type):
    """Prefill, then 3 tokens in one forward (assisted decoding / chunked prefill), left padding in row 1.

    With "quantmla" each query of the chunk sees what one-token decoding sees (its own recent window,
    `quantmla_hf.attention.chunk`): equal to 3 one-token forwards. Unquantized (C16R16) that is also stock attention
    over the history the cache returns.
    """
    model = tiny_mla_model(model_type)
    install_cache_hooks(model)
    ids, mask = _prompt(length=10)
    more = torch.randint(3, 128, (2, 3), generator=torch.Generator().manual_seed(5))
    full_mask = torch.cat([mask, torch.ones_like(more)], 1)

    def chunk(impl, **q):
        model.set_attn_implementation(impl)
        cache = _cache(model, "torch", **q)
        model(ids, attention_mask=mask, **{CACHE_KWARG: cache})
        return model(more, attention_mask=full_mask, **{CACHE_KWARG: cache}).logits

    def one_by_one(**q):
        model.set_attn_implementation("quantmla")
        cache = _cache(model, "torch", **q)
        model(ids, attention_mask=mask, **{CACHE_KWARG: cache})
        return torch.cat([model(more[:, t:t + 1], attention_mask=full_mask[:, :11 + t], **{CACHE_KWARG: cache}).logits
                          for t in range(3)], 1)

    assert_close("3-token chunk logits vs one token at a time", one_by_one(), chunk("quantmla"), TOL)
    lossless = dict(content_bits=16, rope_bits=16)
    assert_close("3-token chunk logits, C16R16", chunk("sdpa", **lossless), chunk("quantmla", **lossless), TOL)


def test_beam_search_native_matches_stock():
    model = tiny_mla_model("deepseek_v2")
    install_cache_hooks(model)
    ids, mask = _prompt()
    kw = dict(num_beams=3, num_return_sequences=2, output_scores=True)
    stock = _generate(model, "sdpa", _cache(model, "torch"), ids, mask, **kw)
    out = _generate(model, "quantmla", _cache(model, "torch"), ids, mask, **kw)
    assert torch.equal(out.sequences, stock.sequences)
    assert_close("beam scores", stock.sequences_scores, out.sequences_scores, TOL)


def test_hadamard_rotated_rope_cache_and_16_bit_paths():
    """The Hadamard baseline stores rotated k_R copies: the native path rotates the query instead."""
    model = tiny_mla_model("deepseek_v3")
    install_cache_hooks(model)
    ids, mask = _prompt()
    for q in (dict(transform="hadamard"), dict(content_bits=16, rope_bits=16)):
        stock = _generate(model, "sdpa", _cache(model, "torch", **dict(q)), ids, mask)
        out = _generate(model, "quantmla", _cache(model, "torch", **dict(q)), ids, mask)
        for a, b in zip(out.logits, stock.logits):
            assert_close(f"logits {q}", b, a, TOL)


def test_mask_with_holes_falls_back_to_the_reconstructed_history():
    lp = torch.tensor([0, 2])
    want = expected_mask(lp, 2, 6)
    assert want[1, 0].tolist() == [False, False, True, True, True, False]
    assert want[1, 1].tolist() == [False, False, True, True, True, True]
    model = tiny_mla_model("deepseek_v3")
    install_cache_hooks(model)
    ids, mask = _prompt()
    mask[0, 4] = 0  # a hole that is not left padding
    stock = _generate(model, "sdpa", _cache(model, "torch"), ids, mask)
    out = _generate(model, "quantmla", _cache(model, "torch"), ids, mask)
    for a, b in zip(out.logits, stock.logits):
        assert_close("logits with a hole", b, a, TOL)
