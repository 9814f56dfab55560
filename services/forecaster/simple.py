"""Series predictors with a flat forecast: `naive` (the last window) and `ewma` (an exponentially weighted mean).

Both forecast a per-window level L from the windows seen so far; over a horizon h (k = round(h / W) windows):
flows (prefill, decode tokens) are L * h / W, decode concurrency is L, KV tokens is L.
Quantiles are conformal: the predictor is backtested on its own recent history (what it would have said after
each past window vs what came over the next k windows), and q10/q50/q90 are the point forecast plus those
quantiles of the residuals — calibrated by construction when the series is stationary. With too few matured
residuals the spread falls back to the series' standard deviation (sqrt(k)-scaled for flows).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np
from scipy.signal import lfilter

from services.forecaster.base import (
    MetricForecast,
    Predictor,
    Triple,
    clean_triple,
    linear_quantiles,
    normal_triple,
    register,
)
from services.forecaster.series import FLOW_METRICS, HORIZONS_S, METRICS, SeriesPoint


class SeriesHistory:
    """The last `max_points` windows, as a (points, metric) array built lazily once per new point."""

    def __init__(self, max_points: int = 1800) -> None:
        self._points: deque[SeriesPoint] = deque(maxlen=max_points)
        self._rows: deque[tuple[float, ...]] = deque(maxlen=max_points)
        self._array: np.ndarray | None = None

    def add(self, p: SeriesPoint) -> None:
        self._points.append(p)
        self._rows.append((p.prefill_tokens, p.decode_tokens, p.decode_concurrency, p.kv_tokens))
        self._array = None

    def __len__(self) -> int:
        return len(self._points)

    def points(self) -> list[SeriesPoint]:
        return list(self._points)

    def array(self, metric: str) -> np.ndarray:
        if self._array is None:
            self._array = np.array(self._rows, dtype=np.float64).reshape(-1, len(METRICS))
        return self._array[:, _COLUMN[metric]]


_COLUMN = {m: i for i, m in enumerate(METRICS)}


def horizon_windows(h: float, window_s: float) -> tuple[int, float]:
    """(k windows, flow scale): a flow over h is scale * (sum of k windows), scale = h / (k * window_s)."""
    k = max(1, round(h / window_s))
    return k, h / (k * window_s)


def realised_ahead(x: np.ndarray, k: int, metric: str) -> np.ndarray:
    """For each i with i + k < len(x): what came over windows i+1..i+k (sum, mean, or the last for KV)."""
    n = len(x) - k
    if n <= 0:
        return np.empty(0)
    if metric == "kv_tokens":
        return x[k:]
    c = np.concatenate(([0.0], np.cumsum(x)))
    sums = c[k + 1 : k + 1 + n] - c[1 : 1 + n]
    return sums if metric in FLOW_METRICS else sums / k


def conformal_triple(
    x: np.ndarray,
    levels: np.ndarray,
    metric: str,
    h: float,
    window_s: float,
    calib: int,
    min_residuals: int = 8,
) -> Triple:
    """Point forecast from the last level, spread from backtested residuals (see the module header)."""
    if len(x) == 0:
        return 0.0, 0.0, 0.0
    k, scale = horizon_windows(h, window_s)
    flow = metric in FLOW_METRICS
    mult = k * scale if flow else 1.0
    point = levels[-1] * mult
    actual = realised_ahead(x, k, metric)
    if len(actual) >= min_residuals:
        resid = (actual - levels[: len(actual)] * (k if flow else 1.0))[-calib:] * (scale if flow else 1.0)
        r10, r50, r90 = linear_quantiles(resid, (0.1, 0.5, 0.9))
        return clean_triple(point + r10, point + r50, point + r90)
    if len(x) < 2:
        return clean_triple(point, point, point)
    sd = float(np.std(x)) * (np.sqrt(k) * scale if flow else 1.0)
    return normal_triple(point, sd * sd)


class FlatPredictor(Predictor):
    """A per-window level per metric, forecast flat, with conformal quantiles. Subclasses define `levels`."""

    def __init__(
        self, horizons_s: Sequence[float] = HORIZONS_S, window_s: float = 1.0, calib_points: int = 300
    ) -> None:
        super().__init__(horizons_s, window_s)
        self.calib_points = calib_points
        self.history = SeriesHistory(max_points=calib_points + 4 * int(max(self.horizons_s) / window_s) + 8)

    def _on_point(self, point: SeriesPoint) -> None:
        self.history.add(point)

    def levels(self, x: np.ndarray) -> np.ndarray:
        """The level after each window (levels[i] uses x[0..i])."""
        raise NotImplementedError

    def _forecast(self, now: float, horizons: tuple[float, ...]) -> MetricForecast:
        out: MetricForecast = {}
        for m in METRICS:
            x = self.history.array(m)
            lv = self.levels(x) if len(x) else x
            out[m] = [conformal_triple(x, lv, m, h, self.window_s, self.calib_points) for h in horizons]
        return out


@register("naive")
class NaivePredictor(FlatPredictor):
    """The last window's value."""

    name = "naive"

    def levels(self, x: np.ndarray) -> np.ndarray:
        return x


@register("ewma")
class EwmaPredictor(FlatPredictor):
    """An exponentially weighted mean of the windows (weight `alpha` on the newest)."""

    name = "ewma"

    def __init__(self, alpha: float = 0.2, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        if not (0.0 < alpha <= 1.0):
            raise ValueError("alpha must be in (0, 1]")
        self.alpha = alpha

    def levels(self, x: np.ndarray) -> np.ndarray:
        a = self.alpha
        y, _ = lfilter([a], [1.0, a - 1.0], x, zi=[(1.0 - a) * x[0]])
        return y
