"""Online calibration of q10 / q90: conformalised quantiles with an adaptive miscoverage level. Pure.

Why: the allocator plans on q10 and q90, so they must cover what they claim on work the forecaster was never
tuned on. A model's own band (the lifecycle model's normal approximation of a sum of per-trajectory moments, an
ensemble's weighted members) is right only as far as the model is; the run's own recent residuals say how far
that is, for this trace, this task mix and this engine load, with nothing fitted offline.

Method, per metric i and horizon j (the predictor's configured horizons; a forecast for another horizon uses
the nearest one's adjustment):
  1. Every forecast (at most one per series window) is remembered raw, with the calibrated band it was issued
     with. Once the series covers (t, t+h] (`series.realised`, the same definitions the evaluation scores), its
     scores are e_hi = (y - q50) / s_hi and e_lo = (q50 - y) / s_lo, where s_hi = max(q90 - q50, f S) and
     s_lo = max(q50 - q10, f S) are the model's own half-widths, floored at f = 5 % of S, the long-run mean |y|
     (normalised conformal scores with the band as the local scale: Romano et al. 2019, "conformalized quantile
     regression"); the last `window` of each kept.
  2. The calibrated band is q50 + s_hi * k_hi and q50 - s_lo * k_lo, k = Q(e, 1 - b) clipped to [0, K_MAX]: each
     half of the model's band is stretched or shrunk by a factor learnt from its own errors. q50 is left alone
     (it is what WAPE scores), and the band never crosses it.
  3. The levels b adapt (Gibbs & Candes 2021, "adaptive conformal inference"): when a matured forecast's issued
     q90 was exceeded, b_hi <- b_hi + gamma * (alpha - 1), else b_hi <- b_hi + gamma * alpha (likewise for q10
     from below). Whatever the series does — bursts at a step's start, a long tail — the long-run share of
     misses on each side then tends to alpha = 0.1: coverage90 (y <= q90) -> 0.90 and coverage80 (q10 <= y <=
     q90) -> 0.80, within (b's range) / (gamma * forecasts). Feedback comes h late; that only slows it.
The rule at a regime change, and its bound: a burst, a silence or a drain the model did not see coming gives large
scores, and the level b falls after each miss, so the band widens — by at most K_MAX = 4 times the model's own
half-width (or 4 f S = 0.2 S where that half-width is narrower than f S), on each side. Why the factor is taken
around the median and capped: an earlier version added s * Q(e) to q90 with s the band's full width at the time of
issue, so scores learnt while the band was narrow (a silence: s at its floor, scores of 20) multiplied a band that
later widened a hundredfold, and with b at its floor Q was the window's largest score: the demo's decode band
reached 8e7 tokens/s against a few hundred realised (issue 32). Scale-free factors on the current half-widths
cannot compound that way, and the cap states how far a regime change can move a band.
Until `min_scores` forecasts matured for (i, j), the model's band is used as it is. Non-finite inputs are ignored.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

import numpy as np

from services.forecaster.series import METRICS, SeriesPoint, realised

# (q10, q50, q90) per metric and horizon, as in base.MetricForecast (kept local: base imports this module)
_Forecast = dict[str, list[tuple[float, float, float]]]

# The most a calibrated half-band may be stretched: k in [0, K_MAX] times the model's half-width (module header).
K_MAX = 4.0


class Calibrator:
    """See the module header. `observe(point)` for every clean series window; `adjust(now, horizons, fc)` for
    every forecast (returns the calibrated copy)."""

    def __init__(
        self,
        horizons_s: Sequence[float],
        window_s: float,
        alpha: float = 0.1,
        gamma: float = 0.02,
        window: int = 400,
        min_scores: int = 20,
        scale_floor: float = 0.05,
    ) -> None:
        if not (0.0 < alpha < 0.5) or not (gamma > 0.0):
            raise ValueError("alpha must be in (0, 0.5) and gamma > 0")
        self.horizons_s = tuple(float(h) for h in horizons_s)
        self.window_s = window_s
        self.alpha = alpha
        self.gamma = gamma
        self.min_scores = min_scores
        self.scale_floor = scale_floor
        shape = (len(METRICS), len(self.horizons_s))
        # adaptive miss levels of the upper (index 0) and lower (index 1) bound
        self.level = np.full((2, *shape), alpha)
        self.scale_long = np.zeros(shape)  # running mean |y| (~1000 matured forecasts)
        self.matured = np.zeros(shape, dtype=np.int64)
        self.misses = np.zeros((2, *shape), dtype=np.int64)  # issued bands missed (above q90, below q10)
        self._scores = [[[deque(maxlen=window) for _ in self.horizons_s] for _ in METRICS] for _ in (0, 1)]
        self._offsets: np.ndarray | None = None  # cached (2, metric, horizon) quantiles of the scores
        # (issued at, raw (metric, horizon, 3), issued calibrated q10/q90 (metric, horizon, 2), scored per horizon)
        self._pending: deque[tuple[float, np.ndarray, np.ndarray, list[bool]]] = deque()
        self._points: deque[SeriesPoint] = deque(maxlen=int(2 * max(self.horizons_s) / window_s) + 16)

    # --- input ------------------------------------------------------------------------------------------------
    def observe(self, point: SeriesPoint) -> None:
        """A new closed window: score every (forecast, horizon) it matured."""
        self._points.append(point)
        pts: list[SeriesPoint] | None = None
        for issued, raw, cal, scored in self._pending:
            if issued + self.horizons_s[0] > point.end_s + 1e-9:
                break  # later entries matured even less
            for j, h in enumerate(self.horizons_s):
                if not scored[j] and issued + h <= point.end_s + 1e-9:
                    scored[j] = True
                    pts = list(self._points) if pts is None else pts
                    actual = realised(pts, issued, h)
                    if actual is not None:
                        self._score(j, actual, raw, cal)
        while self._pending and all(self._pending[0][3]):
            self._pending.popleft()

    def _score(self, j: int, actual: dict[str, float], raw: np.ndarray, cal: np.ndarray) -> None:
        for i, m in enumerate(METRICS):
            y = actual[m]
            if not math.isfinite(y):
                continue
            n = self.matured[i, j] = self.matured[i, j] + 1
            self.scale_long[i, j] += (abs(y) - self.scale_long[i, j]) / min(n, 1000)
            q10, q50, q90 = raw[i, j]
            s_hi, s_lo = self._half_widths(i, j, q10, q50, q90)
            self._scores[0][i][j].append((y - q50) / s_hi)
            self._scores[1][i][j].append((q50 - y) / s_lo)
            tol = 1e-9 * max(abs(y), 1.0)
            for side, miss in ((0, y > cal[i, j, 1] + tol), (1, y < cal[i, j, 0] - tol)):
                self.misses[side, i, j] += int(miss)
                b = self.level[side, i, j] + self.gamma * (self.alpha - float(miss))
                self.level[side, i, j] = min(max(b, 1e-3), 0.9)
        self._offsets = None

    def _half_widths(self, i: int, j: int, q10: float, q50: float, q90: float) -> tuple[float, float]:
        """(s_hi, s_lo): the model's half-widths above and below q50, floored at f S (module header)."""
        floor = max(self.scale_floor * self.scale_long[i, j], 1e-9)
        return max(q90 - q50, floor), max(q50 - q10, floor)

    # --- output -----------------------------------------------------------------------------------------------
    def offsets(self) -> np.ndarray:
        """(2, metric, horizon): the factors k_hi (upper) and k_lo (lower) the half-widths are multiplied by, in
        [0, K_MAX]; NaN where too few forecasts matured."""
        if self._offsets is None:
            out = np.full((2, len(METRICS), len(self.horizons_s)), np.nan)
            for side in (0, 1):
                for i in range(len(METRICS)):
                    for j in range(len(self.horizons_s)):
                        sc = self._scores[side][i][j]
                        if len(sc) >= self.min_scores:
                            k = _upper_quantile(sc, 1.0 - self.level[side, i, j])
                            out[side, i, j] = min(max(k, 0.0), K_MAX)
            self._offsets = out
        return self._offsets

    def adjust(self, now: float, horizons: tuple[float, ...], fc: _Forecast) -> _Forecast:
        """The calibrated copy of `fc` (remembered for scoring when `horizons` are the configured ones)."""
        off = self.offsets()
        idx = [self._index(h) for h in horizons]
        out: _Forecast = {}
        for i, m in enumerate(METRICS):
            rows = []
            for k, (q10, q50, q90) in enumerate(fc[m]):
                j = idx[k]
                hi, lo = off[0, i, j], off[1, i, j]
                if not (math.isfinite(q10) and math.isfinite(q90)) or math.isnan(hi):
                    rows.append((q10, q50, q90))
                    continue
                s_hi, s_lo = self._half_widths(i, j, q10, q50, q90)
                # k >= 0: never across the median (q50 is the model's, whatever the band does)
                rows.append((q50 - s_lo * lo, q50, q50 + s_hi * hi))
            out[m] = rows
        if horizons == self.horizons_s:
            self._remember(now, fc, out)
        return out

    def _index(self, h: float) -> int:
        return min(range(len(self.horizons_s)), key=lambda j: abs(h - self.horizons_s[j]))

    def _remember(self, now: float, raw: _Forecast, cal: _Forecast) -> None:
        if not math.isfinite(now):
            return
        if self._pending and math.floor(self._pending[-1][0] / self.window_s) == math.floor(
            now / self.window_s
        ):
            return  # one forecast per window is scored
        r = np.array([raw[m] for m in METRICS], dtype=np.float64)  # (metric, horizon, 3)
        c = np.array([[(q10, q90) for q10, _, q90 in cal[m]] for m in METRICS], dtype=np.float64)
        if not (np.isfinite(r).all() and np.isfinite(c).all()):
            return
        self._pending.append((now, r, c, [False] * len(self.horizons_s)))
        if len(self._pending) > 4 * max(self.horizons_s) / self.window_s + 16:
            self._pending.popleft()

    def coverage(self) -> dict[str, float]:
        """Share of matured forecasts whose issued band held, per side (pooled over metrics and horizons)."""
        n = max(int(self.matured.sum()), 1)
        return {"above_q90": float(self.misses[0].sum()) / n, "below_q10": float(self.misses[1].sum()) / n}


def _upper_quantile(scores: deque[float], q: float) -> float:
    """The ceil(q (n + 1))-th smallest score (split conformal's finite-sample rank), the largest beyond n."""
    n = len(scores)
    k = min(max(math.ceil(q * (n + 1)), 1), n)
    return float(np.partition(np.fromiter(scores, float, n), k - 1)[k - 1])
