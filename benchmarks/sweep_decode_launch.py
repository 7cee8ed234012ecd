"""Launch sweeps behind the decode kernels' launch choices, against an older tree's kernels in the same process.

    mkdir -p baseline && git archive 5b83181 kernels | tar -x -C baseline
    python benchmarks/sweep_decode_launch.py portable --baseline-path baseline [--formats C16R16] [--points H:B:N,..]
        the portable kernel (default: C16R16 at 16 heads B32/B8 32K and B1 4K, 128 heads B32 32K) over token tiles
        {32, 64}, warps {4, 8} and pipeline stages {1, 2, 3}, each against the baseline's and this tree's dispatch
    python benchmarks/sweep_decode_launch.py splits --baseline-path baseline [--formats C4R4,C2R4,C8R8]
        the formats (default C4R4 and C2R4) at 16 heads, B1 4K through `gluon_regs` and `triton` with 2-64 split
        targets
    python benchmarks/sweep_decode_launch.py paged
        the paged Triton kernel (with its combine) on C4R4 and C16R16 at 16 heads B1/B5/B8/B32 32K and 128 heads B8 32K,
        split targets of 1, 2, 4, 8 and 16 programs per multiprocessor (the rule both Triton kernels take:
        `mla_decode_triton.programs_per_sm`)
    python benchmarks/sweep_decode_launch.py portable-splits
        the same split targets and points for the contiguous portable kernel (`backend="triton"`)

Each time of `portable` and `splits` is the best of 3 `do_bench` medians of a CUDA-graph replay
(`bench_decode.graphed`), of `paged` and `portable-splits` the median of 5 rounds taken in turns; a launch the GPU cannot run (shared
memory) is reported and skipped. The launch parameters are swapped in the kernel module for the
sweep (`launch_shape`) and restored after.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_decode as bd  # noqa: E402

from quantmla_hf.ops import backends as dispatch  # noqa: E402
from quantmla_hf.kernels import mla_decode_triton as portable  # noqa: E402


def best_ms(fn, args, rounds=3) -> float:
    replay = bd.graphed(lambda: fn(*args))
    return min(bd.bench(replay) for _ in range(rounds))


def point_args(fmt_name, H, B, N):
    q_lat, q_rot, lp = bd._queries(B, H)
    fmt, cp, rp, sc, sr, rc, rr = bd.make_cache(fmt_name, B, N)
    return (q_lat, q_rot, cp, rp, fmt, sc, sr, rc, rr, lp, N, bd.SCALING)


PORTABLE_POINTS = [(16, 32, 32768), (128, 32, 32768), (16, 8, 32768), (16, 1, 4096)]


def sweep_portable(baseline, formats, points) -> None:
    saved = portable.launch_shape
    try:
        for name, (H, B, N) in itertools.product(formats, points):
            args = point_args(name, H, B, N)
            old = best_ms(baseline(N), args)
            default = best_ms(bd.decode_fn("default", N), args)
            print(f"{name} H={H} B={B} N={N}: baseline {old:.4f} ms, default dispatch {default:.4f}", flush=True)
            rows = []
            for bt, warps, st in itertools.product((32, 64), (4, 8), (1, 2, 3)):
                portable.launch_shape = lambda fmt, M, shape=(bt, warps, st): shape
                try:
                    t = best_ms(bd.decode_fn("triton", N), args)
                except Exception as err:  # noqa: BLE001 - a launch the GPU refuses is reported, not fatal
                    print(f"{name} H={H} B={B} tile={bt} warps={warps} stages={st}: {type(err).__name__}", flush=True)
                    continue
                rows.append((t, bt, warps, st))
                print(f"{name} H={H} B={B} N={N} tile={bt} warps={warps} stages={st}: {t:.4f} ms ({t / old:.3f}x "
                      f"baseline {old:.4f})", flush=True)
            t, bt, warps, st = min(rows)
            print(f"best {name} H={H} B={B} N={N}: {t:.4f} ms (tile {bt}, {warps} warps, {st} stages), baseline "
                  f"{old:.4f}, default dispatch {default:.4f}", flush=True)
    finally:
        portable.launch_shape = saved


def sweep_splits(baseline, formats=("C4R4", "C2R4")) -> None:
    H, B, N = 16, 1, 4096
    length = torch.tensor([N], dtype=torch.int64, device=bd.DEVICE)
    for name in formats:
        args = point_args(name, H, B, N)
        old = best_ms(baseline(N), args)
        default = best_ms(bd.decode_fn("default", N), args)
        print(f"{name} H={H} B={B} N={N}: baseline {old:.4f} ms, default dispatch {default:.4f}", flush=True)
        for backend, ns in itertools.product(("gluon_regs", "triton"), (2, 4, 8, 12, 16, 24, 32, 48, 64)):
            def run(*a, backend=backend, ns=ns):
                return dispatch.mla_decode_static(*a[:10], length, N, a[11], backend=backend, num_splits=ns)
            t = best_ms(run, args)
            print(f"{name} {backend} split target {ns}: {t:.4f} ms ({t / old:.3f}x baseline)", flush=True)


def sweep_split_rule(layout: str, per_sm=(1, 2, 4, 8, 16), rounds=5) -> None:
    """Split targets of `per_sm` programs per multiprocessor for the paged kernel (`layout` "paged") or the
    contiguous portable kernel ("portable", through `mla_decode_static(backend="triton")`), with their combine."""
    sms = dispatch.num_sms(0)
    for name in ("C4R4", "C16R16"):
        for H, B, N in [(16, 1, 32768), (16, 5, 32768), (16, 8, 32768), (16, 32, 32768), (128, 8, 32768)]:
            args = point_args(name, H, B, N)
            rows = B * -(-H // portable.block_rows(H))
            length = torch.tensor([N], dtype=torch.int64, device=bd.DEVICE)

            def launch(ns, args=args, length=length, N=N):
                if layout == "paged":
                    return bd.paged_fn(args, num_splits=ns, backend="triton")
                return lambda: dispatch.mla_decode_static(*args[:10], length, N, args[11], backend="triton",
                                                          num_splits=ns)

            replays = {k: bd.graphed(launch(-(-k * sms // rows))) for k in per_sm}
            times = {k: [] for k in per_sm}
            for _ in range(rounds):
                for k, replay in replays.items():
                    times[k].append(bd.bench(replay))
            med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
            print(f"{name} H={H} B={B} N={N} (rule: {portable.programs_per_sm(rows)} per SM): "
                  + "  ".join(f"{k}/SM {m:.4f}" for k, m in med.items()), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweep", choices=("portable", "splits", "paged", "portable-splits"))
    ap.add_argument("--baseline-path", default="", help="root of an older tree's kernels (git archive REV kernels); "
                    "portable and splits compare against it")
    ap.add_argument("--formats", default="", help="the formats swept (portable: C16R16, splits: C4R4,C2R4)")
    ap.add_argument("--points", default="", help="portable: H:B:N,... (default PORTABLE_POINTS)")
    a = ap.parse_args()
    if bd.DEVICE != "cuda":
        raise SystemExit("the launch sweeps time CUDA kernels: run them on a GPU")
    if a.sweep in ("portable", "splits") and not a.baseline_path:
        raise SystemExit(f"the {a.sweep} sweep compares against an older tree: give --baseline-path DIR")
    baseline = bd.load_baseline(a.baseline_path) if a.baseline_path else None
    points = [tuple(int(x) for x in p.split(":")) for p in a.points.split(",") if p]
    sweeps = {"portable": lambda base: sweep_portable(base, [f for f in (a.formats or "C16R16").split(",") if f],
                                                      points or PORTABLE_POINTS),
              "splits": lambda base: sweep_splits(base, [f for f in (a.formats or "C4R4,C2R4").split(",") if f]),
              "paged": lambda _: sweep_split_rule("paged"), "portable-splits": lambda _: sweep_split_rule("portable")}
    sweeps[a.sweep](baseline)


if __name__ == "__main__":
    main()
