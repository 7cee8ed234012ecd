"""The four failures transformers' common tests found with QuantMLA, checked directly, at quantized widths and
without the transformers sources (these run on a network-less box too; test_transformers_suite.py runs the
upstream tests themselves).
"""

from __future__ import annotations

import pytest
import torch
from helpers import CACHE_KWARG, assert_close
from transformers import AutoModelForSequenceClassification, DynamicCache

from quantmla_hf import QuantMLACache, QuantMLAConfig, apply_quantmla
from quantmla_hf.attention.state import ATTN_IMPLEMENTATION
from quantmla_hf.hooks import QuantMLAModel
from quantmla_hf.tiny_models import tiny_config, tiny_mla_model


def c4r4(**kw) -> QuantMLAConfig:
    base = dict(content_bits=4, rope_bits=4, transform="none", group_size=8, sink_tokens=1, recent_tokens=4,
                advanced={"kernel": "torch"})
    return QuantMLAConfig(**{**base, **kw})


def _ids(batch=2, length=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (batch, length), generator=g)


def test_heads_that_cannot_generate_load_a_quantmla_checkpoint(tmp_path):
    model = apply_quantmla(tiny_mla_model("deepseek_v3"), c4r4())
    model.save_pretrained(tmp_path)
    head = AutoModelForSequenceClassification.from_pretrained(tmp_path, num_labels=3)  # an AttributeError before the fix
    assert not head.can_generate() and isinstance(head, QuantMLAModel)  # saving hooks; generate's are never called
    assert head.config._attn_implementation == ATTN_IMPLEMENTATION
    assert head(_ids(batch=1)).logits.shape == (1, 3)
    # The causal LM keeps the class whose generate builds a QuantMLA cache.
    assert isinstance(model, QuantMLAModel) and type(model).__name__ == "DeepseekV3ForCausalLM" and model.can_generate()


@pytest.mark.parametrize("model_type", ["deepseek_v3", "longcat_flash"])
def test_output_attentions_during_cached_decode(model_type):
    """Weights come back on the decode step too; the output is that of the latent-space decode (4-bit history)."""
    model = apply_quantmla(tiny_mla_model(model_type), c4r4())
    ids = _ids(length=11)
    n_attn = model.config.num_hidden_layers  # LongCat: two attention modules per decoder layer
    outs = {}
    for want in (False, True):
        cache = QuantMLACache(config=model.config, quantization_config=c4r4())
        model(ids[:, :10], **{CACHE_KWARG: cache}, use_cache=True)
        outs[want] = model(ids[:, 10:], **{CACHE_KWARG: cache}, use_cache=True, output_attentions=want)
        assert all(layer.last_update_native != want for layer in cache.layers)  # decode path off only for weights
    weights = outs[True].attentions
    assert len(weights) == n_attn and weights[0].shape == (2, 4, 1, 11)
    assert torch.allclose(weights[0].sum(-1), torch.ones(2, 4, 1), atol=1e-5)
    assert_close("logits with weights vs latent decode", outs[False].logits, outs[True].logits, 1e-4)


def test_output_attentions_without_mask_is_causal():
    """No attention mask (SDPA's mask interface leaves causality to `is_causal`): the weights stay causal."""
    model = apply_quantmla(tiny_mla_model("deepseek_v2"), c4r4())
    ids = _ids(length=6)
    plain = model(ids)
    weighted = model(ids, output_attentions=True)
    assert_close("logits with and without weights", plain.logits, weighted.logits, 1e-5)
    assert torch.all(torch.triu(weighted.attentions[0], diagonal=1) == 0)


def test_explicit_attn_implementation_is_honoured_and_switchable(tmp_path):
    apply_quantmla(tiny_mla_model("minicpm3"), c4r4(content_bits=2, rope_bits=4)).save_pretrained(tmp_path)
    from transformers import AutoModelForCausalLM

    default = AutoModelForCausalLM.from_pretrained(tmp_path)
    eager = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    assert default.config._attn_implementation == ATTN_IMPLEMENTATION
    assert eager.config._attn_implementation == "eager"
    ids = _ids(length=12)
    # Same weights and a 2-bit cache: eager over the dequantized history equals the latent-space decode.
    a = default.generate(ids, max_new_tokens=3, do_sample=False, output_logits=True, return_dict_in_generate=True)
    b = eager.generate(ids, max_new_tokens=3, do_sample=False, output_logits=True, return_dict_in_generate=True)
    assert torch.equal(a.sequences, b.sequences)
    for x, y in zip(a.logits, b.logits):
        assert_close("eager vs quantmla logits", x, y, 1e-4)
    # Switching back and forth keeps the cache and the implementation consistent (the decode path follows).
    for impl in ("sdpa", "eager", ATTN_IMPLEMENTATION):
        default.set_attn_implementation(impl)
        cache = QuantMLACache(config=default.config, quantization_config=default.config.quantization_config)
        out = default.generate(ids, max_new_tokens=3, do_sample=False, **{CACHE_KWARG: cache})
        assert torch.equal(out, a.sequences), impl
        assert all(layer.last_update_native == (impl == ATTN_IMPLEMENTATION) for layer in cache.layers)


def test_direct_base_model_call_does_not_read_a_stale_cache():
    """After a QuantMLA decode, calling `model.model` directly with another cache must not read the old one."""
    model = apply_quantmla(tiny_mla_model("deepseek_v2"), c4r4())
    stock = tiny_mla_model("deepseek_v2")
    ids = _ids(length=10)
    cache = QuantMLACache(config=model.config, quantization_config=c4r4())
    model(ids[:, :9], **{CACHE_KWARG: cache}, use_cache=True)
    model(ids[:, 9:], **{CACHE_KWARG: cache}, use_cache=True)  # native decode: the state holds this cache
    dyn, dyn_ref = DynamicCache(config=model.config), DynamicCache(config=stock.config)
    model.model(ids[:, :3], **{CACHE_KWARG: dyn}, use_cache=True)
    stock.model(ids[:, :3], **{CACHE_KWARG: dyn_ref}, use_cache=True)
    got = model.model(ids[:, 3:4], **{CACHE_KWARG: dyn}, use_cache=True).last_hidden_state
    want = stock.model(ids[:, 3:4], **{CACHE_KWARG: dyn_ref}, use_cache=True).last_hidden_state
    assert_close("base model with a DynamicCache", want, got, 1e-5)


def test_quantized_config_object_passed_back_as_config(tmp_path):
    model = apply_quantmla(tiny_mla_model("glm4_moe_lite"), c4r4())
    model.save_pretrained(tmp_path)
    assert model.config.quantization_config.get("quant_method") == "quantmla"
    assert model.config.quantization_config.get("no_such_field", 7) == 7
    from transformers import AutoModel

    base = AutoModel.from_pretrained(tmp_path, config=model.config)  # AttributeError 'get' before the fix
    assert base.config._attn_implementation == ATTN_IMPLEMENTATION
    assert tiny_config("glm4_moe_lite").model_type == base.config.model_type
