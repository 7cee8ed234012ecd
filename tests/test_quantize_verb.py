"""`quantmla_hf.quantize` gives a really quantized model, and no entry point changes the config it is given."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import quantmla_hf
from quantmla_hf import QuantMLACache, QuantMLAConfig, apply_quantmla
from quantmla_hf.embedded import CALIBRATION_TEXT, REFERENCE_MODEL
from quantmla_hf.integration import generated_cache
from quantmla_hf.tiny_models import tiny_mla_model


def _kv_b(model):
    return [p.detach().clone() for n, p in model.named_parameters() if "kv_b_proj" in n]


def _changed(before, model):
    return all(not torch.equal(a, b) for a, b in zip(before, _kv_b(model)))


def test_a_config_reused_for_a_second_model_calibrates_it_too():
    cfg = QuantMLAConfig(transform="hadamard", group_size=16, advanced={"kernel": "torch"})
    first, second = tiny_mla_model(seed=0), tiny_mla_model(seed=1)
    before_first, before_second = _kv_b(first), _kv_b(second)
    apply_quantmla(first, cfg)
    assert cfg.calibrated is False and cfg.extra == {}, "the caller's config was changed"
    apply_quantmla(second, cfg)
    assert _changed(before_first, first) and _changed(before_second, second), "the second model kept plain weights"
    own = first.config.quantization_config, second.config.quantization_config
    assert own[0] is not cfg and own[1] is not cfg and own[0] is not own[1]
    assert own[0].calibrated and own[1].calibrated


def test_from_pretrained_does_not_change_the_config_passed(tmp_path):
    tiny_mla_model(seed=3).save_pretrained(tmp_path)
    cfg = QuantMLAConfig(transform="hadamard", group_size=16, advanced={"kernel": "torch"})
    a = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=cfg)
    assert cfg.calibrated is False
    b = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=cfg)
    assert a.config.quantization_config.calibrated and b.config.quantization_config.calibrated
    for x, y in zip(_kv_b(a), _kv_b(b)):  # both fused the same transform into the same weights
        assert torch.equal(x, y)
    plain = _kv_b(tiny_mla_model(seed=3))
    assert all(not torch.equal(x, y) for x, y in zip(_kv_b(b), plain))


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """A tiny random checkpoint saved with the reference tokenizer (so calibration text finds it)."""
    tokenizer = AutoTokenizer.from_pretrained(REFERENCE_MODEL)
    path = tmp_path_factory.mktemp("base")
    tiny_mla_model("deepseek_v3", seed=4, vocab_size=len(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_quantize_gives_a_quantized_model_that_saves_as_one(base_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    text = CALIBRATION_TEXT.read_text(encoding="utf-8")
    cfg = QuantMLAConfig(transform="learned", content_bits=2, group_size=16,
                         advanced={"calibration_samples": 4, "calibration_seq_len": 16, "calibration_steps": 2,
                                   "kernel": "torch"})
    # No tokenizer argument: the checkpoint's own tokenizer is found.
    out = quantmla_hf.quantize(model, cfg, [text[:2400]], progress=False)
    assert out is model and not cfg.calibrated
    own = model.config.quantization_config
    assert isinstance(own, QuantMLAConfig) and own.calibrated and own.extra["calibration"]["layers"]
    ids = torch.tensor([[3, 9, 27, 81, 40, 12, 5]])
    gen = model.generate(ids, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    assert isinstance(generated_cache(gen), QuantMLACache)

    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert saved["quant_method"] == "quantmla" and saved["calibrated"] is True
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    again = reloaded.generate(ids, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    assert isinstance(generated_cache(again), QuantMLACache)
    assert torch.equal(again.sequences, gen.sequences)


def test_the_old_two_step_idiom_is_refused_not_fused_twice():
    """Before, `quantize` only calibrated and `apply_quantmla(model, cfg)` followed; now the second call would fuse
    a second transform on top of the first, so it says what changed instead."""
    cfg = QuantMLAConfig(transform="hadamard", group_size=16, advanced={"kernel": "torch"})
    model = quantmla_hf.quantize(tiny_mla_model(seed=0), cfg)
    with pytest.raises(ValueError, match="already quantized with QuantMLA.*does the whole job"):
        apply_quantmla(model, cfg)
    apply_quantmla(model, model.config.quantization_config)  # re-applying its own config is harmless


def test_calibration_only_function_stays_in_calibration():
    from quantmla_hf.calibration import calibrate

    assert calibrate is not quantmla_hf.quantize
    model = calibrate(tiny_mla_model(seed=0), QuantMLAConfig(transform="hadamard", group_size=16), progress=False)
    assert getattr(model.config, "quantization_config", None) is None  # calibration alone connects no cache
