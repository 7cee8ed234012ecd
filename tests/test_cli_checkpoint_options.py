"""Options given on the command line for a MODEL already quantized with QuantMLA: applied, or refused by name."""

from __future__ import annotations

import json

import pytest

from quantmla_hf import QuantMLAConfig, apply_quantmla
from quantmla_hf.cli import main
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


@pytest.mark.parametrize("flags", [["--transform", "learned"], ["--calibration-steps", "3", "--transform", "none"]])
def test_weight_flags_on_a_quantized_checkpoint_are_errors_naming_them(c4r4_dir, tmp_path, capsys, flags):
    rc = main(["quantize", str(c4r4_dir), "--out", str(tmp_path / "q"), "--content-bits", "2", *flags])
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err and not (tmp_path / "q").exists()
    named = [f for f in flags if f.startswith("--")]
    assert all(f in err for f in named) and "already quantized with QuantMLA" in err


def test_eval_window_check_uses_the_default_window_when_no_flag_is_given(tmp_path, capsys):
    base = tmp_path / "base"
    tiny_mla_model("deepseek_v3", seed=6).save_pretrained(base)
    from quantmla_hf.demo import EVALUATION_TEXT

    rc = main(["eval", str(base), "--text", str(EVALUATION_TEXT), "--window", "100", "--prefill", "6"])
    err = capsys.readouterr().err
    assert rc == 1 and "--window 100" in err and "(recent)" in err and "Traceback" not in err
