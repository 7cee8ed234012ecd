"""95% intervals of quantmla_hf.evaluation.intervals on data whose answer is known."""

from __future__ import annotations

import math

import pytest
import torch

from quantmla_hf.evaluation import intervals
from quantmla_hf.evaluation.intervals import bootstrap, mean_of, perplexity_change, ratio_of_means, t_interval


def test_t_interval_of_known_data():
    # mean 3, sd sqrt(2.5), t_{0.975, 4} = 2.7764451 -> half width 2.7764451 * 1.5811388 / sqrt(5) = 1.9632432
    iv = t_interval(torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]))
    assert iv.value == 3.0
    assert iv.low == pytest.approx(3 - 1.9632432, abs=1e-6) and iv.high == pytest.approx(3 + 1.9632432, abs=1e-6)
    assert iv.excludes(0.5) and not iv.excludes(2.0)
    with pytest.raises(ValueError, match="at least 2"):
        t_interval(torch.tensor([1.0]))


def test_t_quantile_matches_tables():
    """Student t 0.975 quantiles to 6 decimals (printed tables; 1999, 2001 and 100000 degrees of freedom from a
    numerical integration of the density), on both sides of the switch to the asymptotic series at 2000, and the
    two-sided mass at them."""
    for dof, q in ((1, 12.706205), (2, 4.302653), (3, 3.182446), (4, 2.776445), (10, 2.228139), (63, 1.998341),
                   (1000, 1.962339), (1999, 1.961151), (2001, 1.961149), (100000, 1.959988)):
        assert intervals.t_quantile_975(dof) == pytest.approx(q, abs=1.5e-6), dof
    for dof in (1, 2, 7, 30, 500):
        assert intervals.t_two_sided_mass(intervals.t_quantile_975(dof), dof) == pytest.approx(0.95, abs=1e-12)
    assert intervals.t_two_sided_mass(0.0, 5) == 0.0 and intervals.t_two_sided_mass(1e9, 6) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="at least 2"):
        intervals.t_quantile_975(0)


def test_bootstrap_of_degenerate_and_paired_columns():
    b = torch.rand(64, generator=torch.Generator().manual_seed(0)) + 0.5
    # every window exactly half: the paired ratio has no spread at all
    iv = bootstrap(ratio_of_means, 0.5 * b, b)
    assert iv.value == pytest.approx(0.5) and iv.low == pytest.approx(0.5) and iv.high == pytest.approx(0.5)
    # identical NLL columns: zero perplexity change, zero width
    iv = bootstrap(perplexity_change, b, b)
    assert iv.value == 0 and iv.low == 0 and iv.high == 0
    # a constant shift of the NLL by d changes perplexity by exp(d) - 1 exactly
    iv = bootstrap(perplexity_change, b + 0.01, b)
    assert iv.value == pytest.approx(math.expm1(0.01)) and iv.low == pytest.approx(math.expm1(0.01))
    with pytest.raises(ValueError, match="equal-length"):
        bootstrap(ratio_of_means, b, b[:10])


def test_bootstrap_mean_covers_the_true_mean_about_95_percent_and_agrees_with_t():
    gen = torch.Generator().manual_seed(1)
    covered, widths = 0, []
    for i in range(100):
        x = torch.randn(64, generator=gen) + 2.0
        iv = bootstrap(mean_of, x, resamples=300, seed=i)
        covered += not iv.excludes(2.0)
        widths.append((iv.high - iv.low) / (t_interval(x).high - t_interval(x).low))
    assert 0.87 <= covered / 100 <= 1.0
    assert 0.85 < sum(widths) / len(widths) < 1.1  # percentile bootstrap is slightly narrower at n = 64


def test_pairing_resolves_a_small_difference_that_unpaired_spread_hides():
    gen = torch.Generator().manual_seed(2)
    rtn = torch.rand(64, generator=gen) * 0.02 + 0.001  # KL varies 20x across windows
    method = rtn * 0.9  # 10% lower on every window
    iv = bootstrap(ratio_of_means, method, rtn)
    assert iv.high < 1 and iv.value == pytest.approx(0.9)
    # the two means' own intervals overlap: unpaired, this would look like a tie
    a, b = bootstrap(mean_of, method), bootstrap(mean_of, rtn)
    assert a.high > b.low
