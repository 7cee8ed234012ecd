"""Run one decode kernel a few times at one point, for a profiler to attach to (DeepSeek-V2-Lite dims, bf16 queries).

    python benchmarks/profile_decode.py C4R4 16 32 32768 ['{"num_warps": 8}'] [fast|old]

`fast` (default) runs `mla_decode_fast.mla_decode_static` (device-side length), `gluon`, `gluon-scaled`,
`gluon-regs` and `gluon-wide` the same through a Gluon kernel (`-k regex:mla_decode_gluon_regs` etc. under ncu), `old` the fallback
`mla_decode`. The Nsight Compute profiles of docs/BENCHMARKS.md "Gluon kernel with register operands" came from
`ncu --clock-control none -k regex:KERNEL -s 2 -c 1 --set full --import-source yes -o FILE python3
benchmarks/profile_decode.py C4R4 16 32 32768 '{}' gluon-regs`.
Under Nsight Compute, the stall and shared-memory figures of docs/BENCHMARKS.md came from (one kernel launch;
`-k regex:mla_decode_fast_kernel` for the fast kernel, `regex:mla_decode_fwd` for the fallback):

    ncu --clock-control none -k regex:mla_decode_fwd -c 1 --metrics \\
      smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,\\
      smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,\\
      smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,\\
      smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,\\
      smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,\\
      l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,\\
      smsp__inst_executed.sum,sm__warps_active.avg.pct_of_peak_sustained_active,gpu__time_duration.sum,\\
      dram__throughput.avg.pct_of_peak_sustained_elapsed \\
      python3 benchmarks/profile_decode.py C4R4 16 32 32768 '{}' old

`--kernel-times` instead replays the call from a CUDA graph under `torch.profiler` and prints each kernel's mean
GPU time (the decode kernel and the combine of the split partials), the replay's wall time and the grid's programs;
the launch argument may then be a JSON list of launches, timed one after the other in the same process (e.g. a
`num_splits` sweep):

    python3 benchmarks/profile_decode.py C4R4 16 32 32768 '[{}, {"num_splits": 8}]' gluon-regs --kernel-times
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_decode import D_C, D_R, SCALING, bench, decode_fn, graphed, make_cache  # noqa: E402


def kernel_times(fn, args, reps: int = 20) -> tuple[dict[str, float], float]:
    """`({kernel name: mean GPU ms per call}, replay median ms)` of `fn(*args)` replayed from a CUDA graph."""
    from torch.profiler import ProfilerActivity, profile

    replay = graphed(lambda: fn(*args))
    wall = bench(replay)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            replay()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            times[e.name] = times.get(e.name, 0.0) + e.device_time / 1000 / reps
    return times, wall


def main():
    argv = [a for a in sys.argv[1:] if a != "--kernel-times"]
    name, H, B, N = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    launch = json.loads(argv[4]) if len(argv) > 4 else {}
    kernel = argv[5] if len(argv) > 5 else "fast"
    fmt, cp, rp, sc, sr, rc, rr = make_cache(name, B, N)
    q_lat = torch.randn(B, H, 1, D_C, device=cp[next(iter(cp))].device).bfloat16()
    q_rot = torch.randn(B, H, 1, D_R, device=q_lat.device).bfloat16()
    lp = torch.zeros(B, dtype=torch.long, device=q_lat.device)
    args = (q_lat, q_rot, cp, rp, fmt, sc, sr, rc, rr, lp, N, SCALING)
    if "--kernel-times" in sys.argv:
        print(f"{name} H={H} B={B} N={N} {kernel}: mean GPU ms per call of each kernel, replayed from a CUDA graph")
        for one in launch if isinstance(launch, list) else [launch]:
            times, wall = kernel_times(decode_fn(kernel, fmt, N, **one), args)
            parts = ", ".join(f"{k[:40]} {v:.4f}" for k, v in sorted(times.items(), key=lambda kv: -kv[1]))
            print(f"{json.dumps(one):32s} replay {wall:.4f} ms | {parts}", flush=True)
        return
    fn = decode_fn(kernel, fmt, N, **launch)
    for _ in range(3):
        fn(*args)
    if torch.cuda.is_available():
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
