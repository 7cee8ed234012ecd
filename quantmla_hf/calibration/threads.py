"""How many torch threads long CPU work (calibration, `quantmla eval`) runs on: measured, not assumed.

torch starts one intra-op thread per core. On a machine whose cores other processes also use, every parallel
operation then waits at its barrier for a thread the scheduler has put aside: on the 2-core CPU shared with other
jobs, an elementwise operation on 64 K floats took 14 ms with 2 threads against 8 us with 1, and one calibration
step 2.5-3x longer with 2 threads than with 1 (docs/CALIBRATION.md). On an idle machine more threads are faster.
`cpu_threads()` leaves out the cores other processes keep busy (`other_load`: the machine's busy time less this
process's own, so that its own threads are never taken for another's work) and times a small workload with one
thread and with the remaining count, keeping the faster; `retune()` decides again between the parts of long work
(calibration layers, evaluation batches), since a shared machine's load changes. A count the user fixed
(`OMP_NUM_THREADS` or `MKL_NUM_THREADS` set) is left alone.

The thread count changes float reductions, so calibrations with different counts differ in the last bits
(docs/CALIBRATION.md, "Determinism"); the chosen count is logged.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager

import torch

# A thread count must be this much faster than one thread to be kept (the probe is short and noisy).
MIN_GAIN = 1.25
PROBE_ELEMENTS = 1 << 18
PROBE_ROUNDS = 12


def _probe(threads: int, x: torch.Tensor, m: torch.Tensor, budget: float | None = None) -> float:
    """Seconds for `PROBE_ROUNDS` rounds of parallel elementwise work and a matmul with `threads` threads; stops early
    (returning the time so far) once past `budget`."""
    torch.set_num_threads(threads)
    start = time.perf_counter()
    for _ in range(PROBE_ROUNDS):
        (x * 1.0001 + 0.5).sum()
        m @ m
        if budget is not None and time.perf_counter() - start > budget:
            break
    return time.perf_counter() - start


def user_fixed_threads() -> bool:
    """True when the environment fixes the thread count (`OMP_NUM_THREADS`, `MKL_NUM_THREADS`)."""
    return any(os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"))


def _busy_seconds(line: str) -> float:
    """Busy ticks of one `/proc/stat` cpu line (user nice system irq softirq steal; not idle, iowait or guest)."""
    fields = [float(v) for v in line.split()[1:9]]
    return sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0.0)


def _cpu_sample() -> tuple[float, float, float] | None:
    """(wall seconds, busy CPU seconds of the CPUs this process may run on, CPU seconds of this process) now, from
    `/proc/stat` and `os.times()`; None where `/proc/stat` cannot be read (not Linux)."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
        allowed = os.sched_getaffinity(0)
    except (OSError, AttributeError):
        return None
    busy = sum(_busy_seconds(line) for line in lines
               if line.startswith("cpu") and line[3:4].isdigit() and int(line.split()[0][3:]) in allowed)
    own = os.times()
    return time.perf_counter(), busy / os.sysconf("SC_CLK_TCK"), own.user + own.system


_last_sample: tuple[float, float, float] | None = None
SAMPLE_SECONDS = 0.2  # the first measurement's interval (this process idle meanwhile)


def other_load() -> float:
    """Cores' worth of work other processes keep busy. On Linux: the busy time of the CPUs this process may run on
    less this process's own (all its threads) over the interval since the previous call (or a short idle interval on the first), so that this
    process's own threads never count as another's load; elsewhere the 1-minute load average less the threads torch
    runs; 0 where the platform gives neither."""
    global _last_sample
    if _last_sample is None or time.perf_counter() - _last_sample[0] > 60.0:
        _last_sample = _cpu_sample()
        time.sleep(SAMPLE_SECONDS)
    now = _cpu_sample()
    if now is not None and _last_sample is not None:
        wall = now[0] - _last_sample[0]
        others = (now[1] - _last_sample[1]) - (now[2] - _last_sample[2])
        _last_sample = now
        return max(0.0, others / max(wall, 1e-6))
    _last_sample = now
    try:
        return max(0.0, os.getloadavg()[0] - torch.get_num_threads())
    except (AttributeError, OSError):
        return 0.0


def best_thread_count(ceiling: int | None = None) -> int:
    """The thread count to run on: at most `ceiling` (default: torch's count now) less the cores other processes keep
    busy (`other_load`, rounded to the nearest core, at least one left), and more than one only where the probe ran
    that many `MIN_GAIN` times faster than one thread; torch's count is left as found."""
    before = torch.get_num_threads()
    n = ceiling or before
    n = max(1, min(n, n - round(other_load())))
    if n <= 1:
        return 1
    x, m = torch.randn(PROBE_ELEMENTS), torch.randn(192, 192)
    try:
        _probe(1, x, m)  # warm-up
        one = _probe(1, x, m)
        many = _probe(n, x, m, budget=MIN_GAIN * one)
    finally:
        torch.set_num_threads(before)
    return n if many * MIN_GAIN < one else 1


_ceiling: int | None = None  # torch's count when the outermost `cpu_threads` block was entered


def retune(device, fixed: int | None = None) -> int:
    """Set torch's thread count to `best_thread_count()` when `device` is a CPU and the user did not fix it (long
    CPU work calls this between its parts: the load of a shared machine changes); returns the count in use. Within a
    `cpu_threads` block the count may go back up to the one found on entering it. `fixed`: the count to keep instead
    (the user's)."""
    if fixed is not None or device is None or torch.device(device).type != "cpu" or user_fixed_threads():
        return torch.get_num_threads()
    torch.set_num_threads(best_thread_count(_ceiling))
    return torch.get_num_threads()


@contextmanager
def cpu_threads(device: torch.device | str | None):
    """Within the block torch runs on `best_thread_count()` threads when `device` is a CPU and the user did not fix
    the count (`retune` may change it again inside, up to the count found on entering); yields the count chosen. The
    previous count is restored on leaving."""
    global _ceiling
    before, outer = torch.get_num_threads(), _ceiling
    _ceiling = outer or before
    try:
        yield retune(device)
    finally:
        torch.set_num_threads(before)
        _ceiling = outer
