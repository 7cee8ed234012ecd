"""95% intervals for per-window accuracy measurements: paired bootstrap and Student t.

An accuracy comparison scores every method on the same windows, so a difference is measured window by window
(paired) and its interval comes from the spread of those per-window values, not from each method's own spread.

- `t_interval(x)`: mean of `x: [n]` with the Student-t interval `mean +- t_{0.975, n-1} sd / sqrt(n)`.
- `bootstrap(stat, *columns)`: a statistic of equal-length per-window columns, with the percentile interval of
  `stat` recomputed on `resamples` draws of the windows with replacement (the same draw for every column, which
  is what makes it paired). Used for ratios of means (KL of one method over another) and for perplexity changes
  (`exp(mean NLL difference) - 1`), which are not means of per-window values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

RESAMPLES = 2000


@dataclass(frozen=True)
class Interval:
    """A point estimate with its 95% interval `[low, high]`."""

    value: float
    low: float
    high: float

    def excludes(self, x: float) -> bool:
        """True when `x` lies outside the interval (the difference from `x` is resolved at 95%)."""
        return x < self.low or x > self.high

    def fmt(self, digits: int = 4, scale: float = 1.0, sign: bool = False) -> str:
        f = f"{{:{'+' if sign else ''}.{digits}f}}"
        return f"{f.format(self.value * scale)} [{f.format(self.low * scale)}, {f.format(self.high * scale)}]"

    def to_dict(self) -> dict:
        return {"value": self.value, "low": self.low, "high": self.high}


def t_two_sided_mass(t: float, dof: int) -> float:
    """`P(|T| < t)` for Student's t with an integer `dof` (Abramowitz & Stegun 26.7.3-4: with `theta = atan(t /
    sqrt(dof))`, a finite series in `cos(theta)**2` with `cdiv(dof, 2) - 1` terms)."""
    theta = math.atan(t / math.sqrt(dof))
    c2, s = math.cos(theta) ** 2, math.sin(theta)
    term, total = 1.0, 1.0
    if dof % 2:  # odd: (2 / pi) (theta + sin cos (1 + 2/3 c2 + 2*4/(3*5) c2^2 + ... up to c2^((dof - 3) / 2)))
        for k in range(1, (dof - 1) // 2):
            term *= c2 * (2 * k) / (2 * k + 1)
            total += term
        return 2 / math.pi * (theta + (s * math.cos(theta) * total if dof > 1 else 0.0))
    for k in range(1, dof // 2):  # even: sin (1 + 1/2 c2 + 1*3/(2*4) c2^2 + ... up to c2^((dof - 2) / 2))
        term *= c2 * (2 * k - 1) / (2 * k)
        total += term
    return s * total


def t_quantile_975(dof: int) -> float:
    """The 0.975 quantile of Student's t with `dof` degrees of freedom: the `t` with `P(|T| < t) = 0.95`, by bisection
    on the exact finite series (`t_two_sided_mass`) up to 2000 degrees of freedom (to ~1e-12), and above that the
    Cornish-Fisher series of Abramowitz & Stegun 26.7.5 (its error there is below 1e-12). No scipy needed."""
    if dof < 1:
        raise ValueError(f"a t interval needs at least 2 values, got dof={dof}")
    if dof > 2000:
        z = 1.959963984540054
        g1 = (z**3 + z) / 4
        g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
        g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
        g4 = (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160
        return z + g1 / dof + g2 / dof**2 + g3 / dof**3 + g4 / dof**4
    lo, hi = 0.0, 20.0  # the 0.975 quantile is 12.71 at dof 1 and falls with dof
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        if t_two_sided_mass(mid, dof) < 0.95:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def t_interval(x: torch.Tensor) -> Interval:
    """Mean of `x: [n]` (n >= 2) with its Student-t 95% interval."""
    x = torch.as_tensor(x, dtype=torch.float64).reshape(-1)
    if x.numel() < 2:
        raise ValueError(f"a t interval needs at least 2 windows, got {x.numel()}")
    mean = float(x.mean())
    half = t_quantile_975(x.numel() - 1) * float(x.std(unbiased=True)) / math.sqrt(x.numel())
    return Interval(mean, mean - half, mean + half)


def bootstrap(stat: Callable[..., torch.Tensor], *columns: torch.Tensor, resamples: int = RESAMPLES,
              seed: int = 0) -> Interval:
    """`stat(*columns)` with its paired percentile-bootstrap 95% interval.

    Args:
        stat: maps columns `[n]` (or, batched, `[resamples, n]`) to a value per row (reduce over the last axis).
        columns: per-window values, all of length n >= 2, resampled jointly (paired).
        resamples: bootstrap draws; seed: their generator seed (the interval is reproducible).
    """
    cols = [torch.as_tensor(c, dtype=torch.float64).reshape(-1) for c in columns]
    n = cols[0].numel()
    if n < 2 or any(c.numel() != n for c in cols):
        raise ValueError(f"bootstrap needs equal-length columns of at least 2 windows, got {[c.numel() for c in cols]}")
    value = float(stat(*cols))
    idx = torch.randint(0, n, (resamples, n), generator=torch.Generator().manual_seed(seed))
    draws = stat(*[c[idx] for c in cols]).reshape(-1)
    low, high = torch.quantile(draws, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return Interval(value, low, high)


def mean_of(x: torch.Tensor) -> torch.Tensor:
    return x.mean(-1)


def ratio_of_means(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`mean(a) / mean(b)` over the last axis (e.g. KL of a method over RTN's KL)."""
    return a.mean(-1) / b.mean(-1)


def perplexity_change(nll: torch.Tensor, nll_ref: torch.Tensor) -> torch.Tensor:
    """Relative perplexity change `exp(mean(nll - nll_ref)) - 1` of per-window mean NLLs (equal-size windows)."""
    return torch.expm1((nll - nll_ref).mean(-1))
