"""`ensemble` (formerly registered as `prorsa`, the allocator policy's name; that alias still works with a
DeprecationWarning): an ensemble that follows whichever members have been accurate lately, per metric and horizon.

Weights come from exponentially weighted averaging (Hedge): w_j ∝ exp(-eta * L_j), where L_j is member j's
discounted cumulative loss on matured forecasts. A forecast issued at t for horizon h matures once the series
covers (t, t+h]; its loss is |q50 - realised| / scale, scale being a running mean of |realised| (a WAPE-style
normalisation, so metrics of any size weigh alike), floored at a tenth of its long-run mean: when demand pauses
(an RL step's training phase) the recent scale falls to ~0, and without the floor a member forecasting a trickle
would take the largest loss exactly when nothing is at stake, and lose its weight just before the next burst.
Hedge's guarantee: on the normalised absolute loss, its average loss exceeds the best member's by at most
O(sqrt(log K / T)) on a stationary stretch; the discount (`discount` per matured forecast) lets it move to another
member when the regime changes (start-of-step burst, steady state, long tail). The median is the weighted average of
the members' medians; q10/q90 are the weighted averages of the members' (each calibrated if that member
calibrates), then recalibrated on the ensemble's own matured forecasts (`calibration.py`, `calibrate=True`).

Members observe every input and are asked for a forecast at every `predict`, so they keep being scored; at most one
forecast per series window is kept for scoring. Before anything matured the weights are uniform.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from proto import TaskOutlook
from services.forecaster.base import (
    MetricForecast,
    Predictor,
    clean_triple,
    make_predictor,
    register,
)
from services.forecaster.picture import Picture
from services.forecaster.series import HORIZONS_S, METRICS, SeriesPoint, realised

DEFAULT_MEMBERS: tuple[str, ...] = ("naive", "ewma", "ets", "arima", "lifecycle")


@register("ensemble")
class EnsemblePredictor(Predictor):
    name = "ensemble"

    def __init__(
        self,
        horizons_s: Sequence[float] = HORIZONS_S,
        window_s: float = 1.0,
        members: Sequence[str | Predictor] = DEFAULT_MEMBERS,
        eta: float = 4.0,
        discount: float = 0.97,
        seed: int = 0,
        member_options: dict[str, dict[str, Any]] | None = None,
        min_matured: int = 5,
        calibrate: bool = True,
    ) -> None:
        super().__init__(horizons_s, window_s, calibrate=calibrate)
        opts = member_options or {}
        self.members: list[Predictor] = [
            m
            if isinstance(m, Predictor)
            else _make_member(m, self.horizons_s, window_s, seed, opts.get(m, {}))
            for m in members
        ]
        if not self.members:
            raise ValueError("an ensemble needs at least one member")
        self.eta = eta
        self.discount = discount
        shape = (len(METRICS), len(self.horizons_s), len(self.members))
        self.loss = np.zeros(shape)  # discounted cumulative normalised loss
        self.scale = np.zeros(shape[:2])  # running mean |realised| (last ~50 matured forecasts)
        self.scale_long = np.zeros(shape[:2])  # running mean |realised| over ~1000 matured forecasts
        self.matured = np.zeros(shape[:2], dtype=np.int64)
        self.min_matured = min_matured
        # (issued at, members' q50 per metric × horizon × member, scored per horizon)
        self._pending: deque[tuple[float, np.ndarray, list[bool]]] = deque()
        self._points: deque[SeriesPoint] = deque(maxlen=int(4 * max(self.horizons_s) / window_s) + 16)
        # The members' cleaned forecasts behind the latest `predict` (member name -> metric -> one triple per
        # horizon), so an evaluation can score every member without asking each for its forecast again.
        self.member_forecasts: dict[str, MetricForecast] = {}

    @property
    def member_names(self) -> list[str]:
        return [m.name for m in self.members]

    def weights(self) -> np.ndarray:
        """(metric, horizon, member) weights, each (metric, horizon) summing to 1.

        A horizon's effective loss adds the losses of every shorter horizon: a forecast for 30 s is scored 30 s
        late, while the 5 s ones say sooner which member is doing well now (the ranking rarely flips between
        horizons, and when it does the horizon's own loss still counts). A horizon with fewer than `min_matured`
        scored forecasts uses only the shorter horizons'."""
        loss = self.loss.copy()
        for j in range(1, loss.shape[1]):
            young = self.matured[:, j] < self.min_matured
            loss[young, j] = 0.0
            loss[:, j] += loss[:, j - 1]  # shorter horizons mature sooner: their fresher ranking counts too
        z = -self.eta * (loss - loss.min(axis=2, keepdims=True))
        w = np.exp(z)
        return w / w.sum(axis=2, keepdims=True)

    # --- input ------------------------------------------------------------------------------------------------
    def observe(self, item: SeriesPoint | Picture, now: float) -> None:
        for m in self.members:
            m.observe(item, now)
        super().observe(item, now)

    def _on_point(self, point: SeriesPoint) -> None:
        """Score every (forecast, horizon) that matured with this window; each horizon as soon as it matures."""
        self._points.append(point)
        pts = list(self._points)
        for issued, member_q50, scored in self._pending:
            if issued + self.horizons_s[0] > point.end_s + 1e-9:
                break  # later entries matured even less
            for j, h in enumerate(self.horizons_s):
                if not scored[j] and issued + h <= point.end_s + 1e-9:
                    scored[j] = True
                    self._score(j, realised(pts, issued, h), member_q50)
        while self._pending and all(self._pending[0][2]):
            self._pending.popleft()

    def _score(self, j: int, actual: dict[str, float] | None, member_q50: np.ndarray) -> None:
        if actual is None:  # the series does not cover it (a gap in the windows): skip
            return
        for i, m in enumerate(METRICS):
            a = actual[m]
            n = self.matured[i, j] = self.matured[i, j] + 1
            self.scale[i, j] += (abs(a) - self.scale[i, j]) / min(n, 50)
            self.scale_long[i, j] += (abs(a) - self.scale_long[i, j]) / min(n, 1000)
            floor = max(self.scale[i, j], 0.1 * self.scale_long[i, j], 1e-9)
            loss = np.abs(member_q50[i, j] - a) / floor
            self.loss[i, j] = self.discount * self.loss[i, j] + np.minimum(loss, 10.0)

    # --- output -----------------------------------------------------------------------------------------------
    def _forecast(self, now: float, horizons: tuple[float, ...]) -> MetricForecast:
        forecasts = [
            {k: [clean_triple(*t) for t in v] for k, v in m.forecast_triples(now, horizons).items()}
            for m in self.members
        ]
        w = self.weights()
        out: MetricForecast = {}
        for i, metric in enumerate(METRICS):
            rows = []
            for j, h in enumerate(horizons):
                hj = self._horizon_index(h)
                q = np.array([f[metric][j] for f in forecasts])  # (members, 3)
                q10, q50, q90 = (float(x) for x in w[i, hj] @ q)
                rows.append(clean_triple(q10, q50, q90))
            out[metric] = rows
        self._remember(now, horizons, forecasts)
        self.member_forecasts = {m.name: f for m, f in zip(self.members, forecasts, strict=True)}
        return out

    def outlook(self, now: float, horizon_s: float) -> list[TaskOutlook] | None:
        """The first member's outlook that has a model of its own (the `lifecycle` member's), else None (the
        window's). The outlook is no blend: its figures are per turn and per phase, not series the ensemble
        scores."""
        for m in self.members:
            own = m.outlook(now, horizon_s)
            if own is not None:
                return own
        return None

    def _horizon_index(self, h: float) -> int:
        return int(np.argmin([abs(h - x) for x in self.horizons_s]))

    def _remember(self, now: float, horizons: tuple[float, ...], forecasts: list[MetricForecast]) -> None:
        """Keep the members' q50s for scoring: one forecast per window, for the configured horizons."""
        if horizons != self.horizons_s or not math.isfinite(now):
            return
        if self._pending and math.floor(self._pending[-1][0] / self.window_s) == math.floor(
            now / self.window_s
        ):
            return
        hs = range(len(horizons))
        member_q50 = np.array([[[f[m][j][1] for f in forecasts] for j in hs] for m in METRICS])
        self._pending.append((now, member_q50, [False] * len(horizons)))
        if len(self._pending) > 4 * max(self.horizons_s) / self.window_s + 16:
            self._pending.popleft()

    # --- fitting ----------------------------------------------------------------------------------------------
    def refit_job(self, now: float) -> Callable[[], Any] | None:
        jobs = [(i, m.refit_job(now)) for i, m in enumerate(self.members)]
        jobs = [(i, j) for i, j in jobs if j is not None]
        if not jobs:
            return None

        def job() -> list[tuple[int, Any]]:
            return [(i, j()) for i, j in jobs]

        return job

    def install(self, fitted: list[tuple[int, Any]]) -> None:
        for i, result in fitted:
            self.members[i].install(result)


def _make_member(name: str, horizons: tuple[float, ...], window_s: float, seed: int, opts: dict) -> Predictor:
    kw: dict[str, Any] = {"horizons_s": horizons, "window_s": window_s, **opts}
    if name == "lifecycle":
        kw.setdefault("seed", seed)
    return make_predictor(name, **kw)
