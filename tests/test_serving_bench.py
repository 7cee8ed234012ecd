"""benchmarks/bench_serve.py runs and its check holds on the toy model (the real run is on a GPU); the serving
metrics of benchmarks/serving_metrics.py on hand-made timestamps."""

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_serve.py"
sys.path.insert(0, str(BENCH.parent))

from serving_metrics import SLO, RequestTimes, bisection_rate, goodput, percentile, summarize  # noqa: E402


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
    # each timed run was warmed first (its time apart) and its stats count the timed steps alone
    assert all(r["ready_s"] > 0 and r["warm_steps"] > 0 and r["steps"] < 30 for r in pressured.values())


def test_the_toy_serving_defaults_fit_their_budget():
    from bench_generate import v2_lite
    from bench_serve import SERVE_BUDGET_GIB, SERVE_DEFAULTS, qconfig

    from quantmla_hf.cache.paged import PagedQuantMLACache

    model = v2_lite(2, tiny=True)
    for fmt in ("C16R16", "C4R4", "C2R4"):  # every row's sink/recent copies and pages for the toy workload
        cache = PagedQuantMLACache(model.config, qconfig(fmt), page_size=64,
                                   max_requests=SERVE_DEFAULTS["max_requests"][1],
                                   budget_bytes=int(SERVE_BUDGET_GIB[1] * 2**30), dtype=model.dtype)
        assert cache.capacity_tokens() >= SERVE_DEFAULTS["prompt_max"][1] + SERVE_DEFAULTS["output_max"][1]


def test_bench_serve_serving_metrics_on_the_toy_model(tmp_path, capsys):
    from bench_serve import main

    assert main(["--out", str(tmp_path), "--tiny", "--layers", "2", "--serve", "--requests", "5", "--rates", "8,inf,8",
                 "--max-requests", "3", "--page-size", "16", "--max-batch-tokens", "512"]) == 0
    stdout = capsys.readouterr().out
    rows = json.loads((tmp_path / "bench_serve.json").read_text())
    (workload,) = [r for r in rows if r["bench"] == "serve-workload"]
    prompts, outputs = workload["prompt_lens"], workload["output_lens"]
    assert len(prompts) == len(outputs) == 5 and all(16 <= p <= 128 for p in prompts)
    assert all(4 <= o <= 12 for o in outputs) and workload["unit_arrivals"][0] == 0
    runs = {(r["format"], r["rate"]): r for r in rows if r["bench"] == "serve"}  # a repeated rate runs once
    assert set(runs) == {("C16R16", 8), ("C16R16", "inf"), ("C4R4", 8), ("C4R4", "inf")}
    assert sum(r["bench"] == "serve" for r in rows) == 4
    for r in runs.values():  # every request served whole, every gap counted once, at most 3 running
        assert r["completed"] == 5 and r["output_tokens"] == sum(outputs) and r["input_tokens"] == sum(prompts)
        assert r["itl_count"] == sum(outputs) - 5 and 1 <= r["peak_running"] <= 3
        assert r["output_throughput"] * r["duration_s"] == pytest.approx(sum(outputs))
        for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
            assert 0 < r[f"{metric}_p50"] <= r[f"{metric}_p99"]
        assert r["ttft_ms_p99"] <= r["e2el_ms_p99"] <= r["duration_s"] * 1e3
    for fmt in ("C16R16", "C4R4"):
        (ready,) = [r for r in rows if r["bench"] == "serve-ready" and r["format"] == fmt]
        (good,) = [r for r in rows if r["bench"] == "serve-goodput" and r["format"] == fmt]
        met = {math.inf if rate == "inf" else rate: runs[(f, rate)]["slo_met"] for f, rate in runs if f == fmt}
        best, failing = goodput(met)
        assert ready["ready_s"] > 0 and ready["warm_steps"] > 0 and good["measured"] == [8, "inf"]
        assert good["goodput_rps"] == ("inf" if best == math.inf else best)
        assert good["lowest_failing_rps"] == ("inf" if failing == math.inf else failing)
    assert "TTFT p50" in stdout and "goodput (highest rate whose p99 TTFT <= 2 s" in stdout


def test_first_differences_reports_the_margin_where_tokens_part():
    import torch
    from bench_serve import first_differences

    logits = [[torch.tensor([0.0, 2.0, 1.9]), torch.tensor([5.0, 0.0, 0.0])], [torch.tensor([1.0, 0.0, 0.0])] * 2]
    first, margins = first_differences([[1, 0], [2, 0]], [[1, 0], [0, 0]], logits)
    assert first == [2, 0]
    assert margins[0] is None and margins[1] == {"margin": 1.0, "scale": 1.0}
    first, margins = first_differences([[2]], [[1]], [[torch.tensor([0.0, 2.0, 1.9])]])
    assert first == [0] and abs(margins[0]["margin"] - 0.1) < 1e-6 and margins[0]["scale"] == 2.0


def test_percentile_interpolates_between_closest_ranks():
    assert percentile([4, 1, 3, 2], 50) == 2.5
    assert percentile([4, 1, 3, 2], 0) == 1 and percentile([4, 1, 3, 2], 100) == 4
    assert percentile(range(101), 99) == 99 and percentile([7.0], 99) == 7.0
    assert percentile([0, 10], 99) == pytest.approx(9.9, rel=1e-15)
    with pytest.raises(ValueError, match="needs values"):
        percentile([], 50)


def test_request_times_ttft_tpot_itl():
    r = RequestTimes(arrival=1.0, token_times=(1.5, 1.75, 2.25, 3.0), prompt_tokens=9)
    assert r.ttft == 0.5 and r.tpot == 0.5 and r.itls == [0.25, 0.5, 0.75] and r.e2e == 2.0
    assert RequestTimes(0.0, (0.25,)).tpot is None and RequestTimes(0.0, (0.25,)).itls == []
    with pytest.raises(ValueError, match="follow the arrival"):
        RequestTimes(1.0, (0.5, 1.5))
    with pytest.raises(ValueError, match="follow the arrival"):
        RequestTimes(0.0, (1.5, 1.25))


def test_summarize_a_hand_made_trace():
    trace = [
        RequestTimes(0.0, (0.5, 0.75, 1.0), 10),  # TTFT 500 ms, TPOT 250, ITL 250 250, E2E 1000
        RequestTimes(0.25, (1.25, 2.25), 20),  # TTFT 1000, TPOT 1000, ITL 1000, E2E 2000
        RequestTimes(0.5, (0.75,), 30),  # TTFT 250, no TPOT nor ITL, E2E 250
        RequestTimes(1.0, (), 40),  # not completed
    ]
    s = summarize(trace, duration=2.5, slo=SLO(ttft_s=0.75, tpot_ms=500))
    assert (s["completed"], s["input_tokens"], s["output_tokens"], s["itl_count"]) == (3, 60, 6, 3)
    assert s["request_throughput"] == 3 / 2.5 and s["output_throughput"] == 6 / 2.5
    assert (s["ttft_ms_mean"], s["ttft_ms_p50"]) == (1750 / 3, 500)
    assert s["ttft_ms_p99"] == pytest.approx(500 + 500 * 0.98, rel=1e-15)
    assert (s["tpot_ms_mean"], s["tpot_ms_p50"]) == (625, 625)
    assert s["tpot_ms_p99"] == pytest.approx(250 + 750 * 0.99, rel=1e-15)
    assert (s["itl_ms_mean"], s["itl_ms_p50"], s["itl_ms_p99"]) == (500, 250, pytest.approx(985, rel=1e-15))
    assert (s["e2el_ms_mean"], s["e2el_ms_p50"]) == (3250 / 3, 1000)
    # the first and third request meet TTFT <= 0.75 s and TPOT <= 500 ms, the second and the unfinished one do not;
    # p99 TTFT (990 ms) misses the objective, a looser one holds
    assert s["slo_attainment"] == 0.5 and s["slo_met"] is False
    assert SLO(ttft_s=1.0, tpot_ms=1000).met_by(s) and not SLO(ttft_s=1.0, tpot_ms=990).met_by(s)
    empty = summarize([RequestTimes(0.0, ())], duration=1.0, slo=SLO())
    assert empty["completed"] == 0 and empty["ttft_ms_p99"] is None and empty["slo_met"] is False


def test_goodput_is_the_highest_rate_met_with_every_lower_one():
    assert goodput({1: True, 2: True, 4: False, 8: True}) == (2, 4)
    assert bisection_rate({1: True, 2: True, 4: False, 8: True}) == 3
    assert goodput({1: False, 2: True}) == (None, 1) and bisection_rate({1: False, 2: True}) is None
    assert goodput({1: True, 2: True}) == (2, None) and bisection_rate({1: True, 2: True}) is None
    assert goodput({1: True, math.inf: False}) == (1, math.inf) and bisection_rate({1: True, math.inf: False}) is None


def test_workload_lengths_and_poisson_arrivals():
    from bench_serve import sample_workload, unit_arrivals

    prompts, outputs = sample_workload(20001, 0, 4096, 1.0, 1024, 32768, 64, 1024)
    assert (prompts, outputs) == sample_workload(20001, 0, 4096, 1.0, 1024, 32768, 64, 1024)
    assert min(prompts) == 1024 and max(prompts) == 32768 and min(outputs) == 64 and max(outputs) == 1024
    assert statistics.median(prompts) == pytest.approx(4096, rel=0.03)
    # clipped at 1024 = median / 4, i.e. below log(4) / sigma = 1.39 sigmas: Phi(-1.386) = 8.3% of the prompts
    assert sum(p == 1024 for p in prompts) / len(prompts) == pytest.approx(0.083, abs=0.006)
    assert statistics.mean(outputs) == pytest.approx(544, rel=0.01)
    times = unit_arrivals(20000, 1)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert times[0] == 0 and min(gaps) > 0 and statistics.mean(gaps) == pytest.approx(1.0, rel=0.02)
    assert statistics.median(gaps) == pytest.approx(math.log(2), rel=0.03)  # exponential gaps
