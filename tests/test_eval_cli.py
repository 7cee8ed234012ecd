"""`quantmla eval` says what it measures: windows that read quantized entries, the baseline's dtype, the bf16 floor."""

from __future__ import annotations

import json
import re

import pytest

from quantmla_hf.cli.main import main
from quantmla_hf.embedded import EVALUATION_TEXT

CACHE = ["--transform", "none", "--group-size", "16", "--sink-tokens", "1", "--recent-tokens", "4", "--content-bits", "2"]


@pytest.mark.parametrize("window", [4, 6])
def test_a_window_that_reads_no_quantized_entry_is_refused(base_dir, capsys, window):
    rc = main(["eval", str(base_dir), "--text", str(EVALUATION_TEXT), "--window", str(window), "--prefill", "2", *CACHE])
    err = capsys.readouterr().err
    assert rc == 1 and "no quantized entry is ever read" in err and "--window 7 or more" in err


def test_the_window_the_refusal_names_is_the_smallest_accepted(base_dir, capsys):
    """The rule and the message agree: the window the refusal suggests (sink 1 + recent 4 + 2 = 7) runs, one less
    is refused."""
    args = ["eval", str(base_dir), "--text", str(EVALUATION_TEXT), "--prefill", "2", "--max-windows", "1", *CACHE]
    assert main([*args, "--window", "6"]) == 1
    suggested = int(re.search(r"--window (\d+) or more", capsys.readouterr().err).group(1))
    assert main([*args, "--window", str(suggested - 1)]) == 1
    assert main([*args, "--window", str(suggested)]) == 0


def test_bf16_eval_prints_the_floor(base_dir, tmp_path, capsys):
    result = tmp_path / "eval.json"
    rc = main(["eval", str(base_dir), "--text", str(EVALUATION_TEXT), "--window", "14", "--prefill", "6",
               "--max-windows", "1", "--dtype", "bfloat16", "--json", str(result), *CACHE])
    out = capsys.readouterr().out
    assert rc == 0
    res = json.loads(result.read_text())
    assert res["baseline_dtype"] == "bfloat16" and "floor_perplexity" in res
    assert "bfloat16 DynamicCache" in out and "C16R16 QuantMLA (floor)" in out and "floor: with nothing quantized" in out


def test_float32_eval_has_no_floor_row(base_dir, tmp_path, capsys):
    rc = main(["eval", str(base_dir), "--text", str(EVALUATION_TEXT), "--window", "24", "--prefill", "6",
               "--max-windows", "1", *CACHE])
    out = capsys.readouterr().out
    assert rc == 0 and "float32 DynamicCache" in out and "floor" not in out
