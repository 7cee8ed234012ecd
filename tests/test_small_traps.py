"""Smaller traps: demo/optimum help, empty prompts, dtype casts, dequantize, honest model card and config."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

import quantmla_hf
from quantmla_hf import QuantMLACache, QuantMLAConfig
from quantmla_hf.cli.main import main
from quantmla_hf.embedded import CALIBRATION_TEXT, REFERENCE_MODEL
from quantmla_hf.integration import generated_cache
from quantmla_hf.tiny_models import tiny_mla_model


def test_demo_help_lists_its_options(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--help"])
    assert exc.value.code == 0 and "--content-bits" in capsys.readouterr().out


def test_optimum_help_lists_the_quantmla_commands():
    pytest.importorskip("optimum.commands.base", reason="optimum is an optional dependency")
    from quantmla_hf.cli.optimum import REGISTER_COMMANDS

    parser = argparse.ArgumentParser(prog="optimum-cli quantmla")
    REGISTER_COMMANDS[0].parse_args(parser)
    text = parser.format_help()
    assert all(cmd in text for cmd in ("quantize", "generate", "eval", "analyze", "demo"))


def test_generate_with_an_empty_prompt_says_so(capsys):
    rc = main(["generate", "unused-model", "--prompt", ""])
    err = capsys.readouterr().err
    assert rc == 1 and "--prompt number 1 is empty" in err and "Traceback" not in err


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """A tiny checkpoint (reference tokenizer) calibrated with transform="smooth" from the shipped text file."""
    tokenizer = AutoTokenizer.from_pretrained(REFERENCE_MODEL)
    base = tmp_path_factory.mktemp("base")
    tiny_mla_model("deepseek_v3", seed=4, vocab_size=len(tokenizer)).save_pretrained(base)
    tokenizer.save_pretrained(base)
    cfg = QuantMLAConfig(transform="smooth", content_bits=2, group_size=16, calibration_data=str(CALIBRATION_TEXT),
                         advanced={"calibration_samples": 16, "calibration_seq_len": 64, "calibration_steps": 1,
                                   "kernel": "torch"})
    model = AutoModelForCausalLM.from_pretrained(base, quantization_config=cfg)
    out = tmp_path_factory.mktemp("quant")
    model.save_pretrained(out)
    return base, out, model


def test_model_card_and_config_state_what_was_used_without_local_paths(calibrated):
    _, out, model = calibrated
    windows = model.config.quantization_config.extra["calibration"]["windows"]
    assert windows[0] < 16  # the shipped text has fewer windows than asked for
    card = (out / "README.md").read_text()
    saved = (out / "config.json").read_text()
    local = os.path.dirname(str(CALIBRATION_TEXT))
    assert local not in card and local not in saved
    assert f"{windows[0]} windows x 64 tokens" in card and "16 sequences" not in card
    assert "text file calibration_text.txt" in card
    assert json.loads(saved)["quantization_config"]["calibration_data"] is None


def test_card_says_the_import_is_needed_and_that_is_true(calibrated):
    """Without `import quantmla_hf` transformers has no hook to load the plugin: it warns and uses its own cache."""
    _, out, _ = calibrated
    card = (out / "README.md").read_text()
    assert "**\nimported** (`import quantmla_hf`)" in card or "and\nimported" in card.replace("**", "")
    script = (
        "import sys\n"
        "from transformers import AutoModelForCausalLM\n"
        "import torch\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(out)!r})\n"
        "o = m.generate(torch.tensor([[3, 9, 27]]), max_new_tokens=2, do_sample=False, return_dict_in_generate=True)\n"
        "c = o.get('cache', None) or o.get('past_key_values', None)\n"
        "print(type(c).__name__, 'quantmla_hf' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=out)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["DynamicCache", "False"]
    assert "Unknown quantization type, got quantmla" in done.stderr


def test_half_float_and_dequantize(calibrated):
    base, _, _ = calibrated
    model = AutoModelForCausalLM.from_pretrained(base, quantization_config=QuantMLAConfig(transform="hadamard",
                                                                                        group_size=16))
    assert model.half().dtype == torch.float16 and model.float().dtype == torch.float32
    ids = torch.tensor([[3, 9, 27, 81, 40]])
    with torch.no_grad():
        fused = model(ids, use_cache=False).logits
    stock = model.dequantize()
    assert stock is model and not getattr(stock, "is_quantized", False)
    assert getattr(stock.config, "quantization_config", None) is None and stock.config._attn_implementation == "sdpa"
    out = stock.generate(ids, max_new_tokens=2, do_sample=False, return_dict_in_generate=True)
    assert isinstance(generated_cache(out), DynamicCache) and not isinstance(generated_cache(out), QuantMLACache)
    with torch.no_grad():
        torch.testing.assert_close(stock(ids, use_cache=False).logits, fused)  # the same function
    saved = base.parent / "dequantized"
    stock.save_pretrained(saved)
    assert "quantization_config" not in json.loads((saved / "config.json").read_text())
    assert not (saved / "README.md").exists()  # no QuantMLA card for a stock model
    assert quantmla_hf.apply_quantmla(stock, QuantMLAConfig(transform="none")).config.quantization_config.name == "C4R4"
