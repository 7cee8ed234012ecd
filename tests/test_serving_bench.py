"""benchmarks/bench_serve.py runs and its check holds on the toy model (the real run is on a GPU)."""

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_serve.py"


def test_bench_serve_check_and_pressure_on_the_toy_model(tmp_path):
    cmd = [sys.executable, str(BENCH), "--out", str(tmp_path), "--tiny", "--layers", "2", "--check",
           "--check-tokens", "4", "--pressure", "--pressure-requests", "3", "--pressure-input", "400",
           "--pressure-output", "6", "--page-size", "16", "--max-batch-tokens", "512", "--repeat", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "bench_serve.json").read_text())
    checks = [r for r in rows if r["bench"] == "check"]
    assert [r["equal"] for r in checks] == ["6/6", "6/6"]
    assert all(r["margin_at_difference"] == [None] * 6 and r["first_difference"] == [4] * 6 for r in checks)
    pressured = {r["format"]: r for r in rows if r["bench"] == "pressure" and r["round"] == 0}
    for label in ("pressure", "no-pressure"):  # two rounds each, and their mean ratio with its interval
        assert sorted((r["round"], r["format"]) for r in rows if r["bench"] == label) == [
            (0, "C16R16"), (0, "C4R4"), (1, "C16R16"), (1, "C4R4")]
        (mean,) = [r for r in rows if r["bench"] == label + "-ratio-mean"]
        low, high = mean["interval_95"]
        assert mean["rounds"] == 2 and low <= mean["c4r4_over_c16r16"] <= high
    # the same budget holds more C4R4 tokens (the toy's 4 + 128 protected tokens per request weigh more than a
    # real model's); C4R4 runs the three requests together, C16R16 cannot; every request completes in both formats
    assert pressured["C4R4"]["cache_tokens"] > pressured["C16R16"]["cache_tokens"]
    assert all(r["generated"] == 3 * 6 for r in pressured.values())
    assert pressured["C4R4"]["preemptions"] == 0 and pressured["C4R4"]["peak_running"] == 3
    assert pressured["C16R16"]["cache_tokens"] < 3 * 406 and pressured["C16R16"]["peak_running"] < 3


def test_first_differences_reports_the_margin_where_tokens_part():
    sys.path.insert(0, str(BENCH.parent))
    import torch
    from bench_serve import first_differences

    logits = [[torch.tensor([0.0, 2.0, 1.9]), torch.tensor([5.0, 0.0, 0.0])], [torch.tensor([1.0, 0.0, 0.0])] * 2]
    first, margins = first_differences([[1, 0], [2, 0]], [[1, 0], [0, 0]], logits)
    assert first == [2, 0]
    assert margins[0] is None and margins[1] == {"margin": 1.0, "scale": 1.0}
    first, margins = first_differences([[2]], [[1]], [[torch.tensor([0.0, 2.0, 1.9])]])
    assert first == [0] and abs(margins[0]["margin"] - 0.1) < 1e-6 and margins[0]["scale"] == 2.0
