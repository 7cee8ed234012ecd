"""The absorbed latent-space reference attention equals stock (expanded) attention in fp32."""

import pytest
import torch
from helpers import CACHE_KWARG, assert_close
from transformers import DynamicCache

import quantmla_hf.ops.decode as decode_module
from quantmla_hf import QuantMLACache, QuantMLAConfig, install_cache_hooks
from quantmla_hf.attention.absorbed import absorbed_attention_ref, split_kv_b
from quantmla_hf.tiny_models import TINY_FAMILIES, tiny_mla_model


def test_absorbed_equals_expanded_on_random_tensors():
    torch.manual_seed(0)
    B, H, Tq, N, dn, dr, dv, dc = 2, 3, 4, 9, 8, 4, 6, 16
    q_nope, q_rot = torch.randn(B, H, Tq, dn), torch.randn(B, H, Tq, dr)
    c, k_rot = torch.randn(B, N, dc), torch.randn(B, N, dr)
    kv_b = torch.randn(H * (dn + dv), dc)
    w_uk, w_uv = split_kv_b(kv_b, H, dn, dv)
    mask = torch.ones(B, 1, Tq, N, dtype=torch.bool).tril(N - Tq)
    mask[1, ..., :3] = False  # left padding of row 1
    out, lse = absorbed_attention_ref(q_nope, q_rot, c, k_rot, w_uk, w_uv, 0.3, mask)
    kv = (c @ kv_b.T).view(B, N, H, dn + dv).transpose(1, 2)
    k = torch.cat([kv[..., :dn], k_rot[:, None].expand(B, H, N, dr)], -1)
    scores = (torch.cat([q_nope, q_rot], -1) @ k.transpose(-1, -2)) * 0.3
    scores = scores.masked_fill(~mask, float("-inf"))
    ref = (scores.softmax(-1) @ kv[..., dn:]).transpose(1, 2)
    assert_close("out", ref, out, 1e-6)
    assert_close("lse", torch.logsumexp(scores, -1), lse, 1e-6)


@pytest.mark.parametrize("model_type", sorted(TINY_FAMILIES))
def test_latent_attention_matches_stock_attention_on_every_family(model_type, monkeypatch):
    """Every forward, prefill included, goes through the absorbed path; logits equal stock SDPA in fp32."""
    monkeypatch.setattr(decode_module, "NATIVE_MAX_QUERY", 10**6)
    model = tiny_mla_model(model_type)
    install_cache_hooks(model)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (2, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True)
    stock = model.generate(ids, **kw, **{CACHE_KWARG: DynamicCache(config=model.config)})
    without_cache = model(ids, attention_mask=mask).logits

    model.set_attn_implementation("quantmla")
    q = QuantMLAConfig(content_bits=16, rope_bits=16, recent_tokens=64)
    cache = QuantMLACache(config=model.config, quantization_config=q)
    out = model.generate(ids, **kw, **{CACHE_KWARG: cache})
    assert cache.layers[0].last_update_native
    assert torch.equal(out.sequences, stock.sequences)
    for a, b in zip(out.logits, stock.logits):
        assert_close("logits", b, a, 1e-5)
    # Without a cache the "quantmla" implementation is plain SDPA.
    assert_close("no-cache logits", without_cache, model(ids, attention_mask=mask).logits, 1e-6)
