"""The benchmark scripts run end to end at tiny sizes on CPU (their GPU runs are recorded in docs/BENCHMARKS.md)."""

import json
import os
import subprocess
import sys

import pytest
import torch

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


def test_decode_check_holds_one_hot_rows_to_the_rounding_the_backend_does(bench_decode, monkeypatch):
    """With |q| ~ 1e6 rounding the keys to fp16 (what the Gluon kernels do by design) can pick the other token of a
    near tie: on this C8R8 cache it moves row 0's output by 0.3 of its norm from the exact one. A backend computing
    exactly that arithmetic (a stand-in for `gluon_wide`, the fp64 rounding reference) passes `--check`; its output
    against the exact reference is printed beside."""
    from quantmla_hf.kernels.mla_decode_ref import mla_decode_ref

    def rounding_backend(backend, N, capacity=None):
        def run(q_lat, q_rot, cp, rp, fmt, sc, sr, rc, rr, lp, n, scaling):
            o, lse = mla_decode_ref(q_lat, q_rot, cp, rp, fmt, sc, sr, rc, rr, lp, n, scaling, dtype=torch.float64,
                                    score_rounding=bench_decode.score_rounding(backend, fmt))
            return o.float(), lse.float()
        return run

    monkeypatch.setattr(bench_decode, "decode_fn", rounding_backend)
    case = bench_decode.CheckCase("C8R8", 16, 2, 300, 1, "bf16x1e6", torch.bfloat16, R=16)
    exact, rounded = case.reference(), case.reference((True, False))
    assert ((rounded[0][0] - exact[0][0]).norm() / exact[0][0].norm()).item() > 0.2  # a near tie flipped
    lines = []
    assert bench_decode.run_check(lines, cases=[("C4R4", 4, 1, 100, 1), ("C8R8", 16, 2, 300, 1)], R=16,
                                  backends=("gluon_wide",))
    one_hot = [line for line in lines if "bf16x1e6" in line]
    assert len(one_hot) == 2 and all(line.endswith(" OK") and "out_vs_exact=" in line for line in one_hot)
    assert float(one_hot[0].split("out_vs_exact=")[1].split()[0]) > 0.2


def test_check_scales_queries_by_1e6_through_every_gluon_launch(bench_decode):
    """The default check scales one case's queries by 1e6 for each Gluon launch (16 rows: `gluon_regs`, 48:
    `gluon_wide`, 128: `gluon_split`, 4- and 8-bit content); given cases, the second one."""
    one_hot = [c[:4] for c in bench_decode.check_cases() if c[5] == "bf16x1e6"]
    assert one_hot == bench_decode.ONE_HOT_CASES
    assert {h for _, h, _, _ in one_hot} == {16, 48, 128} and {f for f, *_ in one_hot} >= {"C4R4", "C8R8"}
    given = [("C4R4", 4, 1, 100, 1), ("C8R8", 16, 2, 300, 1), ("C2R4", 4, 1, 90, 1)]
    assert [c[:5] for c in bench_decode.check_cases(given) if c[5] == "bf16x1e6"] == [("C8R8", 16, 2, 300, 1)]


def test_kernel_times_counts_each_operation_once_per_call(bench_decode):
    """`--kernel-times`' sum per kernel (here CPU operators: the ones the step calls, none nested in them twice)."""
    times = bench_decode.kernel_times(lambda: torch.ones(4096).add(1).mul(2), iters=3)
    assert list(times) == ["aten::ones", "aten::add", "aten::mul"]
    assert all(us > 0 for us in times.values())


def test_kernel_times_rows_end_with_each_methods_total(bench_decode):
    lines = []
    rows = bench_decode.run_kernel_times(lines, ["4:1:300:C4R4"], iters=1)
    assert len(lines) == len(rows) and rows[-1]["kernel"] == "total"
    assert rows[-1]["us"] == pytest.approx(sum(r["us"] for r in rows[:-1]))
    assert {r["method"] for r in rows} == {bench_decode.select_backend(
        bench_decode.make_cache("C4R4", 1, 8)[0], 4, 1, torch.bfloat16, bench_decode.DEVICE)}


def test_kernel_times_give_the_replay_and_what_lies_outside_the_kernels(bench_decode, monkeypatch):
    """With `replays`, each method's rows end with its CUDA-graph replay time and the replay less the kernels' total
    (here on the CPU: the replay is the call itself and its clock reads 1 ms)."""
    monkeypatch.setattr(bench_decode, "graphed", lambda fn: fn)
    monkeypatch.setattr(bench_decode, "bench", lambda replay: (replay(), 1.0)[1])
    lines = []
    rows = bench_decode.run_kernel_times(lines, ["4:1:300:C4R4"], iters=1, replays=True)
    assert [r["kernel"] for r in rows[-3:]] == ["total", "graph replay", "outside the kernels"]
    total, replay, outside = (r["us"] for r in rows[-3:])
    assert replay == pytest.approx(1000.0) and outside == pytest.approx(1000.0 - total)
    assert lines[-1].endswith("outside the kernels")


def test_rounding_effect_shows_each_paths_rounding(bench_decode):
    """`--rounding-effect`: one row per case with bf16 queries (and the 1e6-scaled one), the LSE shift of rounding
    each path's packed keys to fp16; none on a BF16 cache, some on the packed paths of C4R8."""
    lines = []
    bench_decode.run_rounding_effect(lines, cases=[("C4R8", 4, 2, 200, 1), ("C16R16", 4, 1, 150, 1)], R=16)
    rows = [line.split() for line in lines[1:]]
    assert [(r[0], r[5]) for r in rows] == [("C4R8", "bf16"), ("C16R16", "bf16"), ("C16R16", "bf16x1e6")]
    content, rope, both = (float(x) for x in rows[0][7:])
    assert content > 0 and rope > 0 and both > 0
    assert all(float(x) == 0 for r in rows[1:] for x in r[7:])


@pytest.fixture
def tree_compare(monkeypatch):
    monkeypatch.syspath_prepend(BENCH)
    import tree_compare

    return tree_compare


def test_repeated_rounds_give_intervals_ratios_and_a_verdict(tree_compare):
    """`--repeat`'s summary: a method's mean with its t interval, its per-round ratio to the reference, and whether
    the reference's interval lies below, above or across a target."""
    times = {"ours": [0.1990, 0.1992, 0.1989, 0.1991], "bf16": [0.4970, 0.4964, 0.4958, 0.4966]}
    rows, verdict = tree_compare.summarize_rounds(times, target=0.20)
    assert [r["method"] for r in rows] == ["ours", "bf16"]
    assert rows[0]["ms"].value == pytest.approx(0.19905) and rows[0]["ms"].high < 0.20 and verdict == "met"
    assert rows[0]["ratio"].value == pytest.approx(1.0) and rows[0]["ratio"].high - rows[0]["ratio"].low < 1e-12
    ratios = [b / a for a, b in zip(times["ours"], times["bf16"])]
    assert rows[1]["ratio"].value == pytest.approx(sum(ratios) / 4)
    assert rows[1]["ratio"].low < rows[1]["ratio"].value < rows[1]["ratio"].high
    assert tree_compare.summarize_rounds(times, target=0.1991)[1].startswith("tie")
    assert tree_compare.summarize_rounds(times, target=0.19)[1] == "missed"
    assert tree_compare.summarize_rounds(times)[1] is None
    with pytest.raises(ValueError, match="one time per round"):
        tree_compare.summarize_rounds({"ours": [0.2, 0.2], "bf16": [0.5]})


def test_a_named_backends_output_is_held_against_the_defaults(bench_decode):
    """`--repeat --also-backends`: each named backend's output and LSE against the default's on the same inputs."""
    o, lse = torch.randn(2, 16, 512, dtype=torch.bfloat16), torch.randn(2, 16)
    assert bench_decode._against((o, lse), (o.clone(), lse.clone())) == (0.0, 0.0)
    moved = o.float() + 1e-2 * o.float().norm() / o.numel() ** 0.5
    rel, lse_err = bench_decode._against((moved, lse + 0.25), (o, lse))
    assert rel == pytest.approx((moved - o.float()).norm().item() / o.float().norm().item(), rel=1e-5)
    assert lse_err == pytest.approx(0.25)


def test_split_targets_are_timed_beside_the_default_and_held_to_its_output(bench_decode, monkeypatch):
    """`--repeat --splits 2,5`: each split target reaches the decode as its `num_splits` override, its output is held
    to the default's, and each gets its time's ratio to the default's (here on the CPU: a replay is the call itself
    and each method's clock reads a time of its own, in the order the methods are captured)."""
    passed = []
    decode = bench_decode.mla_decode_static

    def recording(*args, num_splits=None, **kw):
        passed.append(num_splits)
        return decode(*args, num_splits=num_splits, **kw)

    clock = iter([0.2, 0.1, 0.3, 1.0])  # the default, target 2, target 5, the torch bmm

    def captured(fn):
        ms = next(clock)
        return lambda: (fn(), ms)[1]

    monkeypatch.setattr(bench_decode, "mla_decode_static", recording)
    monkeypatch.setattr(bench_decode, "graphed", captured)
    monkeypatch.setattr(bench_decode, "bench", lambda replay: replay())
    lines = []
    rows = bench_decode.run_repeats(lines, [(4, 1, 300)], ["C4R4"], rounds=3, splits=(2, 5))
    assert {2, 5} <= set(passed) and None in passed
    held = [line for line in lines if " against default: " in line]
    assert [line.split(" against ")[0].split()[-1] for line in held] == ["splits2-C4R4", "splits5-C4R4"], lines
    assert all(float(line.split("out_rel=")[1].split()[0]) < 1e-3 for line in held), held
    ratios = {r["method"]: r["ratio"]["value"] for r in rows if r["method"].startswith("splits") and "/" in r["method"]}
    assert ratios == pytest.approx({"splits2/new-C4R4": 0.5, "splits5/new-C4R4": 1.5})
    assert bench_decode.split_targets("8, 16,32") == (8, 16, 32) and bench_decode.split_targets("") == ()
    for bad in ("0,8", "8,x", "-4"):  # 0 would silently be the default's target
        with pytest.raises(ValueError, match="split targets of at least 1"):
            bench_decode.split_targets(bad)


def test_placements_pool_the_allocations_and_pair_them(bench_decode):
    """`--placements`' summary: a format's mean over all its allocations' rounds, its allocation means, and the ratio
    to the first format's taken allocation against allocation, with an interval over the allocations."""
    times = {("C4R4", 0): [0.0200, 0.0202], ("C2R4", 0): [0.0210, 0.0212],
             ("C4R4", 1): [0.0204, 0.0204], ("C2R4", 1): [0.0208, 0.0210]}
    rows = bench_decode.summarize_placements(times)
    assert [r["format"] for r in rows] == ["C4R4", "C2R4"] and rows[0]["ratio"] is None
    assert rows[0]["ms"].value == pytest.approx(0.02025) and rows[0]["allocations"] == pytest.approx([0.0201, 0.0204])
    pairs = [0.0211 / 0.0201, 0.0209 / 0.0204]
    assert rows[1]["ratio"].value == pytest.approx(sum(pairs) / 2)
    assert rows[1]["ratio"].low < min(pairs) and rows[1]["ratio"].high > max(pairs)
    with pytest.raises(ValueError, match="same allocations"):
        bench_decode.summarize_placements({("C4R4", 0): [0.02], ("C4R4", 1): [0.02], ("C2R4", 0): [0.02]})


def test_profiling_flashmla_without_its_build_folder_says_what_to_pass(bench_decode):
    with pytest.raises(SystemExit, match="needs --flashmla DIR"):
        bench_decode.run_profile("16:1:300:C4R4", "flashmla", 1)


def test_profiling_a_paged_point_runs_the_paged_launch(bench_decode, monkeypatch, capsys):
    calls = []
    paged = bench_decode.mla_decode_paged

    def counted(*args, **kwargs):
        calls.append(kwargs["backend"])
        return paged(*args, **kwargs)

    monkeypatch.setattr(bench_decode, "mla_decode_paged", counted)
    bench_decode.run_profile("16:1:320:C4R4", "default", 2, paged=True)
    assert calls == [None, None]  # the paged dispatch's own choice, once per call
    assert "(default, paged): 2 calls" in capsys.readouterr().out


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


def test_generate_before_after_runs_the_older_trees_decode_in_its_turns(monkeypatch):
    """`bench_generate.py --baseline-path`: the "before" calls decode through the other tree's kernels (here this
    tree's own files loaded a second time, interpreted), one call per layer and one-token step, the "new" calls
    through this tree's; the route is undone afterwards, every variant has its time in every round, and the greedy
    tokens of the two are compared."""
    monkeypatch.syspath_prepend(BENCH)
    import bench_generate
    import quantmla_hf.ops.decode as decode_module

    own = decode_module.backends
    rows = bench_generate.before_after_generate(layers=2, heads=4, fmt="C4R4", points=[(2, 37)], rounds=2,
                                                new_tokens=4, baseline_path=ROOT, tiny=True)
    (row,) = rows
    assert decode_module.backends is own
    assert row["baseline_calls"] == 2 * 4 * 2  # rounds x one-token forwards x layers, all in the "before" turns
    assert [len(row["step_ms"][v]) for v in ("new", "before")] == [2, 2]
    assert row["step_ratio"]["low"] <= row["step_ratio"]["value"] <= row["step_ratio"]["high"]
    assert row["same_tokens"] and row["first_token_differing"] is None  # the same kernels: the same greedy tokens


def test_a_baseline_path_without_kernels_says_what_to_pass(tree_compare, tmp_path):
    with pytest.raises(SystemExit, match="git archive"):
        tree_compare.load_baseline_decode(str(tmp_path))


def _ncu_source_page(path, rows):
    """A source page as `ncu --page source --csv --print-source sass` writes it: a title row, a header, one row per
    instruction (counts with thousands separators)."""
    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)",
              "Instructions Executed", "stall_lg", "stall_wait", "stall_lg (Not Issued)"]
    lines = ['"Kernel Name","mla_decode_gluon_kernel",', ",".join(f'"{h}"' for h in header)]
    for i, (sass, lg, wait, executed) in enumerate(rows):
        cells = [hex(i * 16), sass, str(lg + wait), "0", f"{executed:,}", str(lg), str(wait), "1"]
        lines.append(",".join(f'"{c}"' for c in cells))
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_ncu_stalls_sums_reasons_and_names_the_excess(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(BENCH)
    import ncu_stalls

    first = _ncu_source_page(tmp_path / "a.csv", [("LDG.E.64 R2, desc[UR4][R4.64]", 1, 5, 1200),
                                                  ("STG.E desc[UR4][R6.64], R8", 2, 0, 64)])
    second = _ncu_source_page(tmp_path / "b.csv", [("LDG.E.64 R2, desc[UR4][R4.64]", 1, 6, 1200),
                                                   ("STG.E desc[UR4][R6.64], R8", 40, 1, 64)])
    totals = ncu_stalls.reason_totals(ncu_stalls.read_source_page(second))
    assert (totals["stall_lg"], totals["stall_wait"], totals["samples"], totals["executed"]) == (41, 7, 48, 1264)
    assert "stall_lg (Not Issued)" not in totals
    out = subprocess.run([sys.executable, os.path.join(BENCH, "ncu_stalls.py"), first, second, "--top", "1"],
                         capture_output=True, text=True, check=True).stdout
    assert "| stall_lg | 3 | 41 | +38 |" in out
    assert "most stall_lg in" in out and out.strip().endswith("40  STG.E desc[UR4][R6.64], R8")
    (tmp_path / "bad.csv").write_text('"Line No","Source"\n"1","x"\n')
    with pytest.raises(ValueError, match="--print-source sass"):
        ncu_stalls.read_source_page(str(tmp_path / "bad.csv"))


def test_ncu_stalls_finds_each_innermost_hot_loop(tmp_path, monkeypatch):
    """`--loops`: a loop's body runs from its branch's target to the branch; an enclosing loop, a retry loop with
    almost no samples and a branch that runs rarely are left out."""
    monkeypatch.syspath_prepend(BENCH)
    import ncu_stalls

    rows = [("MOV R1, R2", 0, 1, 10),  # 0: target of the enclosing loop
            ("HGMMA.64x64x16.F32 R24, R84, gdesc[UR16], R24", 30, 40, 5000),  # 1: the hot loop's first instruction
            ("LOP3.LUT R3, R4, 0xf, RZ, 0xc0, !PT", 5, 60, 5000),
            ("@!P0 BRA 0x10", 5, 0, 5000),  # 3: back to row 1
            ("@!P1 BRA 0x0", 1, 0, 2000),  # 4: back to row 0 (encloses the hot loop)
            ("SYNCS.PHASECHK.TRANS64.TRYWAIT P2, [UR39+0x10], R3", 0, 0, 9000),  # 5: a retry loop
            ("@!P2 BRA 0x50", 0, 1, 9000),
            ("@!P3 BRA 0x20", 0, 0, 10)]  # 7: rarely taken
    page = ncu_stalls.read_source_page(_ncu_source_page(tmp_path / "l.csv", rows))
    assert ncu_stalls.hot_loops(page) == [(1, 3), (5, 6)]
    out = subprocess.run([sys.executable, os.path.join(BENCH, "ncu_stalls.py"), str(tmp_path / "l.csv"), "--loops",
                          "--top", "2"], capture_output=True, text=True, check=True).stdout
    body = [line for line in out.splitlines() if line.startswith("| 1-3 ")]
    assert body == ["| 1-3 | 3 | 1 | 15000 | 140 (98%) | wait 71%, lg 29% |"], out
    assert "| 5-6 " not in out  # the retry loop: under 1% of the samples


def test_score_precision_variants_change_only_the_packed_scores(monkeypatch):
    """`score_precision.py`: its exact variant is the reference decode; the rounding variants move the packed
    positions' scores by what their rounding says (int8 per 64 channels within half a step, fp8 e4m3 within 1/16
    relative, half a subnormal step at most) and leave a cache of copies only untouched; fp16 partials round each
    split's output once, the LSE not at all."""
    monkeypatch.syspath_prepend(BENCH)
    import score_precision as sp

    from quantmla_hf import CacheFormat, PathFormat
    from quantmla_hf.kernels.mla_decode_ref import mla_decode_static_ref

    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 128, generator=g) * 5
    step = q.reshape(3, 2, 64).abs().amax(-1, keepdim=True) / 127
    assert ((sp.int8_per_group(q) - q).reshape(3, 2, 64).abs() <= step / 2 + 1e-6).all()
    subnormal_step = q.abs().amax(-1, keepdim=True) / sp.FP8_MAX * 2**-9  # e4m3's spacing below 2**-6
    bound = torch.maximum(q.abs() / 16, subnormal_step / 2) + 1e-6
    assert ((sp.fp8_per_row(q) - q).abs() <= bound).all() and not torch.equal(sp.fp8_per_row(q), q)

    from helpers import random_planes

    fmt = CacheFormat(PathFormat(128, 4, 64), PathFormat(64, 4, 64), 2, 8)
    B, N, H = 2, 60, 3
    content, rope = (random_planes(f, (B, N), g, torch.float32) for f in (fmt.content, fmt.rope))
    copies = [torch.randn(B, n, d, generator=g) for n, d in ((2, 128), (2, 64), (8, 128), (8, 64))]
    args = (torch.randn(B, H, 1, 128, generator=g), torch.randn(B, H, 1, 64, generator=g), content, rope, fmt,
            *copies, torch.tensor([0, 5]), torch.tensor([N]), N, 0.1)
    exact = mla_decode_static_ref(*args)
    assert all(torch.equal(a, b) for a, b in zip(sp.decode_variant("exact")(*args), exact))
    for variant in ("bf16_keys", "int8_q64", "fp8_q_row"):
        o, lse = sp.decode_variant(variant)(*args)
        assert not torch.equal(lse, exact[1]) and (lse - exact[1]).abs().max() < 0.5
    o, lse = sp.decode_variant("fp16_partials")(*args)  # the scores exact, the output rounded once to fp16
    assert (lse - exact[1]).abs().max() < 1e-5 and not torch.equal(o, exact[0])
    assert ((o - exact[0]).abs() <= exact[0].abs() * 2**-11 + 2**-17).all()
    scores = torch.randn(2, 3, 4, 50, generator=g)  # several splits, one of them empty
    scores[..., 16:32] = float("-inf")
    values = torch.randn(2, 50, 8, generator=g)
    o, lse = sp.fp16_split_merge(scores, values, split=16)
    assert (lse - torch.logsumexp(scores, -1)).abs().max() < 1e-5
    assert ((o - scores.softmax(-1) @ values[:, None]).abs() <= values.abs().max() * 2**-11).all()
    short = list(args)
    short[10], short[11] = torch.tensor([10]), 10  # 10 positions: 2 sink + 8 recent, nothing packed
    short[9] = torch.tensor([0, 0])
    for variant in ("bf16_keys", "int8_q64", "fp8_q_row"):
        assert all(torch.equal(a, b) for a, b in zip(sp.decode_variant(variant)(*short),
                                                     mla_decode_static_ref(*short)))
