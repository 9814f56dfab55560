"""The ensemble predictor: never worse than its best member on average, follows a change of best member."""

from __future__ import annotations

import numpy as np
import pytest

from services.forecaster.base import MetricForecast, Predictor
from services.forecaster.ensemble import EnsemblePredictor
from services.forecaster.series import METRICS, SeriesPoint, realised

H = (5.0, 10.0, 30.0)


class Stub(Predictor):
    """Forecasts `level(t)` per window for every metric (flows scaled by the horizon), plus noise that is a
    fixed function of (seed, t): asking twice gives the same forecast."""

    name = "stub"

    def __init__(self, level, noise: float = 0.0, seed: int = 0) -> None:  # noqa: ANN001
        super().__init__(H, 1.0)
        self.level = level
        self.noise = noise
        self.seed = seed

    def _forecast(self, now: float, horizons: tuple[float, ...]) -> MetricForecast:
        out: MetricForecast = {}
        rng = np.random.default_rng((self.seed, int(now * 1000)))
        for m in METRICS:
            rows = []
            for h in horizons:
                v = max(0.0, self.level(now) + rng.normal(0.0, self.noise))
                v = v * h if m in ("prefill_tokens", "decode_tokens") else v
                rows.append((0.8 * v, v, 1.2 * v))
            out[m] = rows
        return out


def _run(ens: EnsemblePredictor, truth, n: int, seed: int = 0, skip: int = 0) -> dict[str, np.ndarray]:  # noqa: ANN001
    """Feed windows drawn around truth(t); return each forecaster's mean absolute q50 error on prefill per
    horizon, over the forecasts issued after the first `skip` windows."""
    rng = np.random.default_rng(seed)
    pts: list[SeriesPoint] = []
    issued = []
    for i in range(n):
        t = float(i + 1)
        x = max(0.0, truth(t) + rng.normal(0.0, 20.0))
        p = SeriesPoint(t, 1.0, x, x, x, x)
        pts.append(p)
        ens.observe(p, t)
        forecasts = {"ensemble": ens.predict(t)} | {f"m{k}": m.predict(t) for k, m in enumerate(ens.members)}
        issued.append((t, forecasts))
    errors: dict[str, list[list[float]]] = {}
    for t, forecasts in issued[skip:]:
        for j, h in enumerate(H):
            actual = realised(pts, t, h)
            if actual is None:
                continue
            for name, fc in forecasts.items():
                errors.setdefault(name, [[], [], []])[j].append(
                    abs(fc.horizons[j].prefill_tokens.q50 - actual["prefill_tokens"])
                )
    return {name: np.array([np.mean(e) for e in errs]) for name, errs in errors.items()}


@pytest.mark.parametrize("skip, tolerance", [(0, 1.15), (30, 1.01)])
def test_not_worse_than_its_best_member_on_average(skip: int, tolerance: float) -> None:
    """Over the whole run the first windows (uniform weights, nothing matured) cost a few %; once it has
    learned (after 30 windows here) it matches the best member."""
    truth = lambda t: 1000.0  # noqa: E731
    members = [
        Stub(lambda t: 1000.0, noise=30.0, seed=1),
        Stub(lambda t: 1300.0, seed=2),
        Stub(lambda t: 1000.0, noise=400.0, seed=3),
        Stub(lambda t: 700.0, seed=4),
    ]
    ens = EnsemblePredictor(H, members=members)
    err = _run(ens, truth, 400, skip=skip)
    best = np.min([err[f"m{k}"] for k in range(len(members))], axis=0)
    assert (err["ensemble"] <= tolerance * best).all(), (err, best)
    w = ens.weights()[0]  # prefill, per horizon
    assert (w[:, 0] > 0.9).all()


def test_follows_a_change_of_best_member() -> None:
    truth = lambda t: 1000.0 if t < 200 else 1500.0  # noqa: E731
    a = Stub(lambda t: 1000.0, seed=1)  # right before t = 200, wrong after
    b = Stub(lambda t: 1500.0, seed=2)  # wrong before, right after
    ens = EnsemblePredictor(H, members=[a, b])
    err = _run(ens, truth, 400)
    assert (err["ensemble"] < 0.6 * np.minimum(err["m0"], err["m1"])).all(), err
    assert ens.weights()[0, 0, 1] > 0.99


def test_weights_start_uniform_and_members_see_every_input() -> None:
    members = [Stub(lambda t: 1.0), Stub(lambda t: 2.0)]
    ens = EnsemblePredictor(H, members=members)
    assert ens.weights() == pytest.approx(np.full((4, 3, 2), 0.5))
    ens.observe(SeriesPoint(1.0, 1.0, 1, 1, 1, 1), 1.0)
    assert [m.points for m in members] == [1, 1]
    fc = ens.predict(1.0).horizons[0].decode_concurrency
    assert fc.q50 == pytest.approx(1.5)
