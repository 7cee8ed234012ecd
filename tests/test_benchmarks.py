"""The benchmark scripts run end to end at tiny sizes on CPU (their GPU runs are recorded in docs/BENCHMARKS.md)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")


@pytest.fixture
def bench_decode(monkeypatch):
    monkeypatch.syspath_prepend(BENCH)
    import bench_decode

    return bench_decode


def test_decode_check_passes_at_tiny_sizes(bench_decode):
    """`--check`'s own comparison (bf16, fp32 and |q| ~ 1e6 queries against the fp64 reference), two small caches."""
    lines = []
    assert bench_decode.run_check(lines, cases=[("C4R4", 16, 2, 150, 1), ("C2R4", 16, 1, 151, 1)], R=16)
    # rows 0 and B-1 of each case: bf16 queries (3), fp32 queries (3), |q| ~ 1e6 on the second case (1)
    assert sum(line.endswith(" OK") for line in lines) == 7
    assert lines[-1].startswith("check worst")


def test_generate_benchmark_runs_and_fits_a_largest_batch(tmp_path):
    cmd = [sys.executable, os.path.join(BENCH, "bench_generate.py"), "--tiny", "--out", str(tmp_path),
           "--methods", "dynamic-bf16,C4R4,C4R4-static", "--skip", "C4R4-static@3x40"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads((tmp_path / "bench_generate.json").read_text())
    assert {(r["method"], r["B"]) for r in result["rows"]} == {
        ("dynamic-bf16", 2), ("dynamic-bf16", 3), ("C4R4", 2), ("C4R4", 3), ("C4R4-static", 2)}
    assert all(r["tok_s"] > 0 and r["ms_per_step"] > 0 for r in result["rows"])
    assert {f["method"] for f in result["max_batch"]} == {"dynamic-bf16", "C4R4"}
