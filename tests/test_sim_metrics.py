"""The simulator's streaming completion-time histogram agrees with numpy's percentiles (what the live rollout's
summary reports) to its 1 % bucket resolution, small samples included (a demo has 8 trajectories)."""

from __future__ import annotations

import numpy as np
import pytest

from prorsa.sim.metrics import LogHistogram


@pytest.mark.parametrize("n", [1, 2, 3, 8, 100, 5_000])
def test_quantiles_match_numpy_percentiles(n: int) -> None:
    values = np.random.default_rng(n).lognormal(5.0, 1.0, n)
    hist = LogHistogram()
    for v in values:
        hist.add(float(v))
    assert hist.mean() == pytest.approx(values.mean())
    for q in (0.0, 0.1, 0.5, 0.9, 0.99, 1.0):
        assert hist.quantile(q) == pytest.approx(np.percentile(values, 100 * q), rel=0.011), q
    assert hist.quantile(1.0) == values.max() and hist.quantile(0.0) == values.min()


def test_empty_histogram_reports_zero() -> None:
    assert LogHistogram().quantile(0.99) == 0.0
