"""Options given on the command line for a MODEL already quantized with QuantMLA: every cache flag given applies (one
equal to the default too); a weight flag that differs from the checkpoint is a usage error naming it."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from quantmla_hf import QuantMLAConfig, apply_quantmla
from quantmla_hf.cli.main import main
from quantmla_hf.embedded import REFERENCE_MODEL
from quantmla_hf.tiny_models import tiny_mla_model


@pytest.fixture(scope="module")
def c4r4_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("c4r4")
    apply_quantmla(tiny_mla_model("deepseek_v3", seed=6),
                   QuantMLAConfig(transform="none", group_size=16, recent_tokens=4)).save_pretrained(path)
    return path


def test_cache_flags_take_effect_on_a_quantized_checkpoint(c4r4_dir, tmp_path, capsys):
    out = tmp_path / "q"
    assert main(["quantize", str(c4r4_dir), "--out", str(out), "--content-bits", "2", "--recent-tokens", "8"]) == 0
    assert "saved C2R4" in capsys.readouterr().out
    saved = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (saved["content_bits"], saved["recent_tokens"], saved["group_size"]) == (2, 8, 16)


@pytest.fixture(scope="module")
def q_c2(tmp_path_factory):
    """A C2R4 checkpoint with recent 16 and the reference tokenizer (stock weights: transform none)."""
    path = tmp_path_factory.mktemp("q_c2")
    tokenizer = AutoTokenizer.from_pretrained(REFERENCE_MODEL)
    model = tiny_mla_model("deepseek_v3", seed=6, vocab_size=len(tokenizer))
    apply_quantmla(model, QuantMLAConfig(content_bits=2, recent_tokens=16, transform="none")).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_cache_flags_equal_to_the_defaults_apply_to_a_quantized_source(q_c2, tmp_path, capsys):
    out = tmp_path / "q2"
    assert main(["quantize", str(q_c2), "--out", str(out), "--content-bits", "4", "--recent-tokens", "128"]) == 0
    assert f"saved C4R4 (transform=none, calibrated=False) to {out}" in capsys.readouterr().out
    saved = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (saved["content_bits"], saved["recent_tokens"], saved["transform"]) == (4, 128, "none")


def test_generate_uses_the_cache_flags_given_for_a_quantized_source(q_c2, capsys):
    assert main(["generate", str(q_c2), "--content-bits", "4", "--prompt", "The city", "--max-new-tokens", "3"]) == 0
    assert " C4R4: " in capsys.readouterr().err
    assert main(["generate", str(q_c2), "--prompt", "The city", "--max-new-tokens", "3"]) == 0
    assert " C2R4: " in capsys.readouterr().err


@pytest.mark.parametrize("verb", ["quantize", "generate"])
@pytest.mark.parametrize("flags,named,unnamed", [
    (["--transform", "hadamard"], "--transform hadamard", None),
    (["--calibration-steps", "3", "--transform", "none"], "--calibration-steps 3", "--transform"),
])
def test_weight_flags_differing_from_a_quantized_source_are_usage_errors(q_c2, tmp_path, capsys, verb, flags, named,
                                                                         unnamed):
    out = tmp_path / "q"
    target = ["--out", str(out)] if verb == "quantize" else ["--prompt", "The city"]
    rc = main([verb, str(q_c2), *target, "--content-bits", "4", *flags])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err and not out.exists()
    assert err.startswith(f"quantmla {verb}: error: ") and named in err and "already quantized with QuantMLA" in err
    assert unnamed is None or unnamed not in err


def test_a_weight_flag_equal_to_the_quantized_source_is_accepted(q_c2, tmp_path, capsys):
    out = tmp_path / "q"
    assert main(["quantize", str(q_c2), "--out", str(out), "--transform", "none"]) == 0
    assert "saved C2R4 (transform=none" in capsys.readouterr().out


def test_eval_window_check_uses_the_default_window_when_no_flag_is_given(tmp_path, capsys):
    base = tmp_path / "base"
    tiny_mla_model("deepseek_v3", seed=6).save_pretrained(base)
    from quantmla_hf.embedded import EVALUATION_TEXT

    rc = main(["eval", str(base), "--text", str(EVALUATION_TEXT), "--window", "100", "--prefill", "6"])
    err = capsys.readouterr().err
    assert rc == 1 and "--window 100" in err and "(recent)" in err and "Traceback" not in err
