"""The statistics bench_ab.py reports with its ratios (run by the ``build`` session)."""

from __future__ import annotations

import random
import statistics

from bench_ab import median_interval, summarise


def test_the_interval_uses_the_order_statistics_of_the_sign_test() -> None:
    values = [float(v) for v in range(20, 0, -1)]
    assert median_interval(values) == (6.0, 15.0)  # n = 20: the 6th and 15th of 20 (P(X <= 5) = 0.021)
    assert median_interval(values[:6]) == (15.0, 20.0)  # n = 6: the whole range already covers 96.9 %
    assert median_interval([3.0, 1.0, 2.0]) == (1.0, 3.0)  # too few for 95 %: the whole range
    assert median_interval([2.0]) == (2.0, 2.0)


def test_the_interval_covers_the_true_median_as_often_as_it_claims() -> None:
    draw = random.Random(0)
    true_median = 2**0.5  # of a lognormal(0, 1) scaled by sqrt 2: skewed, as step-time ratios are
    trials, covered = 2000, 0
    for _ in range(trials):
        low, high = median_interval([2**0.5 * draw.lognormvariate(0, 1) for _ in range(30)])
        covered += low <= true_median <= high
    assert 0.95 <= covered / trials <= 0.99  # exact coverage at n = 30 is 1 - 2 P(X <= 9) = 0.957


def test_the_summary_pools_every_round_of_every_repeat_for_the_interval() -> None:
    first = {"floor": [1.0] * 6, "torch-ddp": [2.0] * 6, "x": [2.0, 2.2, 2.4, 2.6, 2.8, 3.0]}
    second = {"floor": [1.0] * 6, "torch-ddp": [2.0] * 6, "x": [1.0, 1.2, 1.4, 1.6, 1.8, 2.0]}
    row = summarise([first, second])["x"]
    assert row["vs_torch_ddp"] == statistics.median([1.25, 0.75])
    pooled = sorted(v / 2.0 for v in first["x"] + second["x"])
    assert (row["vs_torch_ddp_lo"], row["vs_torch_ddp_hi"]) == (pooled[2], pooled[9])  # n = 12: 3rd, 10th
