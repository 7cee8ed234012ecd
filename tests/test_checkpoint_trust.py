"""A loaded checkpoint's quantization_config: trusted for nothing, versioned, complete; options passed beside it."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from quantmla_hf import QuantMLACache, QuantMLAConfig, apply_quantmla
from quantmla_hf.config import FORMAT_VERSION
from quantmla_hf.integration import build_cache
from quantmla_hf.tiny_models import tiny_mla_model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A C4R4 QuantMLA checkpoint with stock weights (transform none)."""
    path = tmp_path_factory.mktemp("quantmla")
    config = QuantMLAConfig(transform="none", group_size=16, sink_tokens=1, recent_tokens=4)
    apply_quantmla(tiny_mla_model("deepseek_v3", seed=7), config).save_pretrained(path)
    return path


def edited(checkpoint, tmp_path, **changes):
    """A copy of `checkpoint` whose quantization_config has `changes` (a value None deletes the key)."""
    out = tmp_path / "edited"
    out.mkdir()
    for f in checkpoint.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    config = json.loads((out / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config["quantization_config"].pop(key)
        else:
            config["quantization_config"][key] = value
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_saved_config_carries_the_format_version(checkpoint):
    saved = json.loads((checkpoint / "config.json").read_text())["quantization_config"]
    assert saved["format_version"] == FORMAT_VERSION
    assert saved["transform"] == "none"  # "auto" is never saved: the resolved transform is


def test_config_naming_a_local_file_is_refused_before_anything_reads_it(checkpoint, tmp_path, monkeypatch):
    secret = tmp_path / "passwd"
    secret.write_text("root:x:0:0:root:/root:/bin/bash\n" * 400)
    opened = []
    real_open = open
    monkeypatch.setattr("builtins.open", lambda f, *a, **k: (opened.append(str(f)), real_open(f, *a, **k))[1])
    path = edited(checkpoint, tmp_path, calibration_data=str(secret), transform="learned", calibrated=False)
    with pytest.raises(ValueError, match="names calibration data") as err:
        AutoModelForCausalLM.from_pretrained(path)
    assert "never reads local files" in str(err.value) and "Delete calibration_data" in str(err.value)
    assert str(secret) not in opened


def test_uncalibrated_learned_transform_in_a_checkpoint_is_refused_with_the_fix(checkpoint, tmp_path):
    path = edited(checkpoint, tmp_path, transform="learned", calibrated=False)
    with pytest.raises(ValueError, match="calibrated=false") as err:
        AutoModelForCausalLM.from_pretrained(path)
    assert "quantmla_hf.quantize" in str(err.value) and 'transform to "none"' in str(err.value)


def test_newer_format_version_is_refused_clearly(checkpoint, tmp_path):
    path = edited(checkpoint, tmp_path, format_version=FORMAT_VERSION + 1, new_option=3)
    with pytest.raises(ValueError, match="newer quantmla-hf") as err:
        AutoModelForCausalLM.from_pretrained(path)
    assert "pip install -U quantmla-hf" in str(err.value)


@pytest.mark.parametrize("version", ["1", 0, True])
def test_unknown_format_version_is_refused(version):
    with pytest.raises(ValueError, match="format_version"):
        QuantMLAConfig.from_dict({"quant_method": "quantmla", "format_version": version})


def test_incomplete_config_gets_accurate_advice_not_recalibration(checkpoint, tmp_path):
    path = edited(checkpoint, tmp_path, calibrated=None, transform=None)
    with pytest.raises(ValueError, match="lacks transform, calibrated") as err:
        AutoModelForCausalLM.from_pretrained(path)
    assert "Restore config.json" in str(err.value) and "calibration_data" not in str(err.value)


def test_cache_options_passed_beside_a_checkpoint_take_effect(checkpoint):
    model = AutoModelForCausalLM.from_pretrained(
        checkpoint, quantization_config=QuantMLAConfig(content_bits=2, recent_tokens=8, advanced={"kernel": "torch"}))
    qconfig = model.config.quantization_config
    assert (qconfig.name, qconfig.recent_tokens, qconfig.sink_tokens) == ("C2R4", 8, 1)
    assert qconfig.advanced.kernel == "torch"
    cache = build_cache(model)
    assert isinstance(cache, QuantMLACache) and cache.quantization_config.content_bits == 2
    with torch.no_grad():
        out = model.generate(torch.arange(3, 30)[None], max_new_tokens=2, do_sample=False,
                             return_dict_in_generate=True)
    assert out.sequences.shape[1] == 29


def test_weight_options_passed_beside_a_checkpoint_are_named_in_a_warning(checkpoint):
    with pytest.warns(UserWarning, match="ignored") as record:
        model = AutoModelForCausalLM.from_pretrained(
            checkpoint, quantization_config=QuantMLAConfig(content_bits=2, transform="hadamard",
                                                           advanced={"calibration_steps": 5}))
    message = " ".join(str(w.message) for w in record)
    assert "transform='hadamard' (the checkpoint has 'none')" in message and "advanced.calibration_steps=5" in message
    assert model.config.quantization_config.transform == "none" and model.config.quantization_config.content_bits == 2


def test_default_transform_is_auto_and_works_without_data():
    assert QuantMLAConfig().transform == "auto"
    model = apply_quantmla(tiny_mla_model("deepseek_v3", seed=1), QuantMLAConfig(group_size=16))
    assert model.config.quantization_config.transform == "none"  # no calibration text: RTN, said in the log
