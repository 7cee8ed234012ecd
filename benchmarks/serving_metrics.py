"""Serving metrics of one load run, from host times: when each request arrived and when each of its tokens came
back. The definitions are those of vLLM's `benchmark_serving` and SGLang's `bench_serving`:

- TTFT (time to first token): first token's time - arrival time (queueing, prefill, and the steps of other
  requests it waited behind);
- TPOT (time per output token), per request with at least 2 tokens: (last token's time - first token's time) /
  (tokens - 1), the mean gap after the first token;
- ITL (inter-token latency): every gap between consecutive tokens of a request, all requests pooled (a prefill
  step that runs between two decode steps shows as one long gap here, and only diluted in TPOT);
- E2E latency: last token's time - arrival time;
- percentiles: linear interpolation between the closest ranks (`numpy.percentile`'s default);
- request throughput: completed requests / duration; output throughput: generated tokens / duration; the
  duration runs from the load's time origin (the first arrival) to the last token;
- SLO attainment: the fraction of requests whose own TTFT and TPOT meet the objective (vLLM's "request goodput"
  is this fraction times the request throughput);
- goodput: the highest request rate (requests/s) at which the load's p99 TTFT and p99 TPOT both meet the objective,
  every lower measured rate meeting it too (DistServe's goodput at a p99 attainment), searched over the measured
  rates and refined by bisection between the highest passing and the lowest failing one (`bisection_rate`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class RequestTimes:
    """One request of a load run: its arrival and the host time each of its tokens came back (seconds, one
    clock), and its prompt length."""

    arrival: float
    token_times: tuple[float, ...]
    prompt_tokens: int = 0

    def __post_init__(self) -> None:
        times = self.token_times
        if any(b < a for a, b in zip(times, times[1:])) or (times and times[0] < self.arrival):
            raise ValueError(f"token times must follow the arrival ({self.arrival}) in order, got {list(times)}")

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival

    @property
    def tpot(self) -> float | None:
        """Mean gap after the first token; None for a request of fewer than 2 tokens."""
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n >= 2 else None

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def e2e(self) -> float:
        return self.token_times[-1] - self.arrival


def percentile(values, q: float) -> float:
    """The `q`-th percentile (0-100) of `values`, linear between the closest ranks (`numpy.percentile`'s default:
    rank `(n - 1) q / 100` of the sorted values)."""
    xs = sorted(values)
    if not xs or not 0 <= q <= 100:
        raise ValueError(f"percentile needs values and 0 <= q <= 100, got {len(xs)} values and q={q}")
    rank = (len(xs) - 1) * q / 100
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def describe(name: str, values, scale: float = 1e3, percentiles=(50, 99)) -> dict[str, float | None]:
    """`{name}_mean` and `{name}_p{q}` of `values` times `scale` (1e3: seconds to ms); None where there are none."""
    values = [v * scale for v in values]
    out = {f"{name}_mean": sum(values) / len(values) if values else None}
    out.update({f"{name}_p{q:g}": percentile(values, q) if values else None for q in percentiles})
    return out


@dataclass(frozen=True)
class SLO:
    """The latency objective: p99 TTFT at most `ttft_s` seconds and p99 TPOT at most `tpot_ms` milliseconds."""

    ttft_s: float = 2.0
    tpot_ms: float = 50.0

    def met_by(self, summary: dict) -> bool:
        """Whether a load's summary (`summarize`) meets the objective at p99."""
        ttft, tpot = summary["ttft_ms_p99"], summary["tpot_ms_p99"]
        return ttft is not None and tpot is not None and ttft <= self.ttft_s * 1e3 and tpot <= self.tpot_ms

    def attained(self, request: RequestTimes) -> bool:
        """Whether one request's own TTFT and TPOT meet the objective (a 1-token request: its TTFT alone)."""
        tpot = request.tpot
        return request.ttft <= self.ttft_s and (tpot is None or tpot * 1e3 <= self.tpot_ms)


def summarize(requests: list[RequestTimes], duration: float, slo: SLO | None = None) -> dict:
    """The metrics of one load run of `requests` (those with no token count as not completed) over `duration`
    seconds: TTFT, TPOT, ITL and E2E latency in ms (mean, p50, p99), throughputs, and with `slo` its attainment."""
    if duration <= 0:
        raise ValueError(f"duration must be > 0 seconds, got {duration}")
    done = [r for r in requests if r.token_times]
    tpots = [r.tpot for r in done if r.tpot is not None]
    out_tokens = sum(len(r.token_times) for r in done)
    row = dict(completed=len(done), input_tokens=sum(r.prompt_tokens for r in done), output_tokens=out_tokens,
               itl_count=sum(len(r.token_times) - 1 for r in done), duration_s=duration,
               request_throughput=len(done) / duration, output_throughput=out_tokens / duration)
    row.update(describe("ttft_ms", [r.ttft for r in done]))
    row.update(describe("tpot_ms", tpots))
    row.update(describe("itl_ms", [g for r in done for g in r.itls]))
    row.update(describe("e2el_ms", [r.e2e for r in done]))
    if slo is not None:
        row["slo_met"] = slo.met_by(row)
        row["slo_attainment"] = sum(slo.attained(r) for r in done) / len(requests) if requests else None
    return row


def goodput(met: dict[float, bool]) -> tuple[float | None, float | None]:
    """From `met` (request rate -> whether its load met the objective): the goodput, the highest rate at which it
    and every lower measured rate met it (None: not even the lowest did), and the lowest failing rate above it
    (None: every higher measured rate met it too)."""
    best, failing = None, None
    for rate in sorted(met):
        if not met[rate]:
            failing = rate
            break
        best = rate
    return best, failing


def bisection_rate(met: dict[float, bool]) -> float | None:
    """The next rate to measure: the midpoint of the goodput and the lowest failing rate above it, or None where
    no finite interval is open (no rate passed, none failed, or the failing one is unbounded)."""
    best, failing = goodput(met)
    if best is None or failing is None or math.isinf(failing):
        return None
    return (best + failing) / 2
