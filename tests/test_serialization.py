"""save_pretrained -> from_pretrained round trips of QuantMLA checkpoints (tiny random models)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from quantmla_hf import QuantMLACache, QuantMLAConfig
from quantmla_hf.attention.state import ATTN_IMPLEMENTATION
from quantmla_hf.embedded import CALIBRATION_TEXT, REFERENCE_MODEL
from quantmla_hf.integration import generated_cache
from quantmla_hf.saving.model_card import MARKER
from quantmla_hf.tiny_models import tiny_mla_model


def tensor_names(directory) -> set[str]:
    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        return set(f.keys())


def prompt(length=10):
    return (torch.arange(length) * 7 % 120 + 3)[None]


@pytest.mark.parametrize("family", ["deepseek_v3", "longcat_flash"])
def test_save_reload_identical(tmp_path, family):
    base_dir, q_dir = tmp_path / "base", tmp_path / "quant"
    tiny_mla_model(family, seed=2).save_pretrained(base_dir)
    qconfig = QuantMLAConfig(transform="none", content_bits=2, group_size=16, sink_tokens=1, recent_tokens=2)
    model = AutoModelForCausalLM.from_pretrained(base_dir, quantization_config=qconfig)
    model.save_pretrained(q_dir)

    assert tensor_names(q_dir) == tensor_names(base_dir)  # original tensor names, nothing added
    saved = json.loads((q_dir / "config.json").read_text())
    assert saved["quantization_config"] == qconfig.to_dict()
    card = (q_dir / "README.md").read_text()
    assert MARKER in card and "base_model_relation" not in card  # a local base has no Hub id to point at
    assert '"content_bits": 2' in card and "BF16 (`DynamicCache`)" in card

    reloaded = AutoModelForCausalLM.from_pretrained(q_dir)  # no quantization_config argument
    assert isinstance(reloaded.config.quantization_config, QuantMLAConfig)
    assert reloaded.config.quantization_config.to_dict() == qconfig.to_dict()
    assert reloaded.config._attn_implementation == ATTN_IMPLEMENTATION
    assert hasattr(reloaded, "_quantmla_state")  # hooks installed again

    ids = prompt()
    assert torch.equal(model(ids).logits, reloaded(ids).logits)
    a = model.generate(ids, max_new_tokens=6, do_sample=False, return_dict_in_generate=True, output_scores=True)
    b = reloaded.generate(ids, max_new_tokens=6, do_sample=False, return_dict_in_generate=True, output_scores=True)
    assert isinstance(generated_cache(b), QuantMLACache)
    assert torch.equal(a.sequences, b.sequences)
    assert all(torch.equal(x, y) for x, y in zip(a.scores, b.scores))


def test_learned_calibration_from_text_then_reload_without_it(tmp_path):
    """learned transform calibrated at load time from strings (tokenizer from the checkpoint), saved, reloaded."""
    pytest.importorskip("quantmla_hf.calibration.pipeline")
    tokenizer = AutoTokenizer.from_pretrained(REFERENCE_MODEL)
    base_dir, q_dir = tmp_path / "base", tmp_path / "quant"
    base = tiny_mla_model("deepseek_v3", seed=4, vocab_size=len(tokenizer))
    base.save_pretrained(base_dir)
    tokenizer.save_pretrained(base_dir)
    text = CALIBRATION_TEXT.read_text(encoding="utf-8")
    strings = [text[i : i + 400] for i in range(0, 2400, 400)]
    qconfig = QuantMLAConfig(transform="learned", content_bits=2, group_size=16, calibration_data=strings,
                             advanced={"calibration_samples": 4, "calibration_seq_len": 16, "calibration_steps": 2})
    model = AutoModelForCausalLM.from_pretrained(base_dir, quantization_config=qconfig)
    assert model.config.quantization_config.calibrated
    fused = [n for n, p in model.named_parameters() if "kv_b_proj" in n and not torch.equal(p, dict(base.named_parameters())[n])]
    assert fused, "calibration fused nothing into kv_b_proj"
    ids = prompt()
    assert torch.allclose(model(ids, use_cache=False).logits, base(ids).logits, atol=1e-4)  # fusion keeps the function

    model.save_pretrained(q_dir)
    saved = json.loads((q_dir / "config.json").read_text())["quantization_config"]
    assert saved["calibrated"] is True and saved["calibration_data"] is None  # the strings are not stored
    assert "6 texts" in (q_dir / "README.md").read_text()
    reloaded = AutoModelForCausalLM.from_pretrained(q_dir)
    assert torch.equal(model(ids).logits, reloaded(ids).logits)
