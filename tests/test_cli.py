"""The `quantmla` command line end to end on a tiny checkpoint (in process; the Hub push is in test_hub.py)."""

from __future__ import annotations

import importlib
import json
import math
from importlib import metadata

import pytest

from quantmla_hf.cli.main import main
from quantmla_hf.embedded import EVALUATION_TEXT


def test_console_script_is_declared():
    (entry,) = [e for e in metadata.entry_points(group="console_scripts") if e.name == "quantmla"]
    assert entry.value == "quantmla_hf.cli.main:main" and entry.load() is main


def test_quantize_generate_eval(base_dir, tmp_path, capsys):
    out = tmp_path / "q"
    rc = main(["quantize", str(base_dir), "--out", str(out), "--transform", "none", "--group-size", "16",
               "--sink-tokens", "1", "--recent-tokens", "4", "--content-bits", "2"])
    assert rc == 0
    saved = json.loads((out / "config.json").read_text())["quantization_config"]
    assert saved["quant_method"] == "quantmla" and saved["content_bits"] == 2 and saved["recent_tokens"] == 4
    assert (out / "tokenizer.json").is_file() and (out / "README.md").is_file()
    assert "saved C2R4" in capsys.readouterr().out

    assert main(["generate", str(out), "--prompt", "The city", "--prompt", "A", "--max-new-tokens", "3"]) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert lines[0].startswith("The city") and lines[1].startswith("A")
    assert "QuantMLACache C2R4" in captured.err

    result = tmp_path / "eval.json"
    rc = main(["eval", str(out), "--text", str(EVALUATION_TEXT), "--window", "24", "--prefill", "6",
               "--max-windows", "1", "--json", str(result)])
    assert rc == 0
    res = json.loads(result.read_text())
    assert res["windows"] == 1 and res["tokens_scored"] == 18 and res["cache"] == "C2R4"
    assert all(math.isfinite(res[k]) and res[k] > 1 for k in ("baseline_perplexity", "quantmla_perplexity"))
    # 2-bit history beyond a 4-token window changes the predictions
    assert res["baseline_perplexity"] != res["quantmla_perplexity"]
    table = capsys.readouterr().out
    # the tiny checkpoint is float32: the baseline is labelled by its dtype, not "BF16"
    assert "float32 DynamicCache" in table and "BF16" not in table and "C2R4" in table


def test_analyze_writes_table_and_plot(base_dir, tmp_path, capsys):
    pytest.importorskip("quantmla_hf.evaluation.analysis")
    from quantmla_hf.embedded import CALIBRATION_TEXT

    rc = main(["analyze", str(base_dir), "--calibration", str(CALIBRATION_TEXT), "--samples", "2", "--seq-len", "16",
               "--group-size", "16", "--out", str(tmp_path)])
    assert rc == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report and (tmp_path / "dual_path.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["quantize", "{tmp}/missing", "--out", "{tmp}/x"], "missing"),
        (["eval", "{base}", "--text", "{tmp}/nope.txt", "--transform", "none"], "nope.txt: no such file"),
        (["eval", "{base}", "--text", "{text}", "--window", "10", "--prefill", "9"], "--prefill"),
    ],
)
def test_errors_exit_1_with_a_message(base_dir, tmp_path, capsys, argv, message):
    argv = [a.format(base=base_dir, tmp=tmp_path, text=EVALUATION_TEXT) for a in argv]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert f"quantmla {argv[0]}: error:" in err and message in err


def test_usage_error_exits_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["quantize"])
    assert exc.value.code == 2


def test_optimum_registration_module_imports_without_optimum():
    import quantmla_hf.cli.optimum as reg

    try:
        importlib.import_module("optimum.commands.base")
    except ImportError:
        assert reg.REGISTER_COMMANDS == []
    else:
        assert reg.REGISTER_COMMANDS[0].COMMAND.name == "quantmla"


def test_optimum_cli_runs_the_quantmla_subcommand(base_dir, tmp_path):
    """`optimum-cli quantmla ...` (registered through the optimum.commands.register namespace) runs `quantmla`."""
    import subprocess
    import sys

    out = tmp_path / "via-optimum"
    script = "from optimum.commands.optimum_cli import main; main()"
    args = ["quantmla", "quantize", str(base_dir), "--out", str(out), "--transform", "none", "--group-size", "16"]
    # cwd outside the repository: `python -c` puts the working directory on sys.path
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "quantmla"
    bad = subprocess.run([sys.executable, "-c", script, "quantmla", "quantize"], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    assert bad.returncode == 2 and "MODEL" in bad.stderr.upper()
