"""`ets` and `arima`: statsmodels models fitted off the event loop, re-anchored on every new window in numpy.

Fitting (maximum likelihood in statsmodels) takes 0.1–0.5 s per series, so it runs on a schedule as a pure job
(`refit_job`, on a thread in the service, inline in the simulator) over a copy of the last `fit_points` windows.
Both models are linear Gaussian state-space models (statsmodels' state-space ExponentialSmoothing, and ARIMA,
which is SARIMAX underneath), so a fit is captured as its system matrices and final predicted state; between
refits `KalmanState` filters each new window in a few microseconds and forecasts from the latest state. The
forecast of a flow over k windows is the sum y_1 + ... + y_k, whose mean and variance come from the state-space
recursion augmented with the running sum; concurrency is that sum / k; KV is y_k. Quantiles are the model's
Gaussian prediction intervals (mean ± 1.2816 sd), clipped at 0.

Series are divided by their mean absolute value before fitting (tokens per window reach 1e5; the optimiser is
happier near 1). A series too short or constant, or a fit that fails, falls back to the `ewma` forecast for that
metric until the next successful refit.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from services.forecaster.base import MetricForecast, Predictor, Triple, normal_triple, register
from services.forecaster.series import FLOW_METRICS, HORIZONS_S, METRICS, SeriesPoint
from services.forecaster.simple import EwmaPredictor, horizon_windows

# What statsmodels' fit raises on a degenerate series (a singular matrix, a non-stationary or non-finite fit, an
# overflow or a division by zero on extreme values); anything else is our bug and propagates.
FIT_ERRORS: tuple[type[Exception], ...] = (np.linalg.LinAlgError, ValueError, ArithmeticError)


@dataclass(frozen=True)
class StateSpaceFit:
    """System matrices of a fitted model (scaled units) and its predicted state after the last fitted window."""

    Z: np.ndarray  # (m,) design (one observed series)
    d: float  # observation intercept
    H: float  # observation noise variance
    T: np.ndarray  # (m, m) transition
    c: np.ndarray  # (m,) state intercept
    RQR: np.ndarray  # (m, m) state noise covariance
    a: np.ndarray  # (m,) predicted state for the next window
    P: np.ndarray  # (m, m) its covariance
    scale: float  # the series was divided by this before fitting


def extract_fit(res: Any, scale: float) -> StateSpaceFit:
    """Matrices of a fitted statsmodels MLEResults (concentrated scale applied to the noise covariances)."""
    ssm = res.model.ssm
    fr = res.filter_results
    s = float(fr.scale) if getattr(fr, "filter_concentrated", False) else 1.0

    def last(name: str) -> np.ndarray:
        m = np.asarray(ssm[name], dtype=np.float64)
        base_ndim = 1 if name.endswith("intercept") else 2
        return m[..., -1] if m.ndim > base_ndim else m

    R = last("selection")
    return StateSpaceFit(
        Z=np.ravel(last("design")),
        d=float(np.ravel(last("obs_intercept"))[0]),
        H=float(np.ravel(last("obs_cov"))[0]) * s,
        T=last("transition"),
        c=np.ravel(last("state_intercept")),
        RQR=R @ (last("state_cov") * s) @ R.T,
        a=np.array(fr.predicted_state[:, -1], dtype=np.float64),
        P=np.array(fr.predicted_state_cov[:, :, -1], dtype=np.float64),
        scale=scale,
    )


class KalmanState:
    """The Kalman filter of one fitted model, updated window by window (predicted-state form)."""

    def __init__(self, fit: StateSpaceFit) -> None:
        self.fit = fit
        self.a = fit.a.copy()
        self.P = fit.P.copy()
        self._cache: dict[int, tuple[np.ndarray, float, float, np.ndarray, float, float]] = {}

    def update(self, y: float) -> None:
        f = self.fit
        y = y / f.scale
        PZ = self.P @ f.Z  # (m,)
        F = float(f.Z @ PZ) + f.H
        if not (F > 0.0) or not math.isfinite(F):
            return
        K = (f.T @ PZ) / F  # (m,) Kalman gain of the predicted-state form
        v = y - f.d - float(f.Z @ self.a)
        self.a = f.c + f.T @ self.a + K * v
        self.P = f.T @ self.P @ f.T.T + f.RQR - np.outer(K, K) * F
        self.P = 0.5 * (self.P + self.P.T)

    def forecast(self, k: int) -> tuple[float, float, float, float]:
        """(mean, var) of y_1 + ... + y_k and of y_k, in series units.

        With M_l = Z (I + T + ... + T^(l-1)) and N_l = Z T^(l-1), from the predicted state (a, P):
          S_k: mean M_k a + sum_{l<k} M_l c + k d,  var M_k P M_k' + sum_{l<k} M_l RQR M_l' + k H;
          y_k: mean N_k a + M_(k-1) c + d,          var N_k P N_k' + sum_{l<k} N_l RQR N_l' + H.
        Everything but the (a, P) terms depends on the fit alone and is computed once per k."""
        M, const_mean, const_var, N, y_const_mean, y_const_var = self._terms(k)
        f, a, P = self.fit, self.a, self.P
        s = f.scale
        sum_mean = float(M @ a) + const_mean
        sum_var = float(M @ P @ M) + const_var
        y_mean = float(N @ a) + y_const_mean
        y_var = float(N @ P @ N) + y_const_var
        return sum_mean * s, max(sum_var, 0.0) * s * s, y_mean * s, max(y_var, 0.0) * s * s

    def _terms(self, k: int) -> tuple[np.ndarray, float, float, np.ndarray, float, float]:
        cached = self._cache.get(k)
        if cached is None:
            f = self.fit
            m_prev = np.zeros(len(f.a))  # M_(l-1)
            n_l = f.Z.copy()  # N_1
            sum_mc = sum_mqm = sum_nqn = 0.0
            for _ in range(1, k):
                m_l = m_prev + n_l  # M_l = M_(l-1) + N_l
                sum_mc += float(m_l @ f.c)
                sum_mqm += float(m_l @ f.RQR @ m_l)
                sum_nqn += float(n_l @ f.RQR @ n_l)
                m_prev, n_l = m_l, n_l @ f.T
            m_k = m_prev + n_l
            cached = (m_k, sum_mc + k * f.d, sum_mqm + k * f.H, n_l, float(m_prev @ f.c) + f.d, sum_nqn + f.H)
            self._cache[k] = cached
        return cached


def _fit_series(
    y: np.ndarray, make_model: Callable[[np.ndarray], Any], demean: bool = False
) -> StateSpaceFit | None:
    """`demean`: fit the series minus its mean (a model without a constant) and put the mean back as the
    observation intercept (see `ArimaPredictor`)."""
    if len(y) < 12 or float(np.ptp(y)) == 0.0:
        return None
    scale = float(np.mean(np.abs(y))) or 1.0
    z = y / scale
    mean = float(np.mean(z)) if demean else 0.0
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = make_model(z - mean if demean else z)
        fit = extract_fit(res, scale)
        if demean:
            fit = dataclasses.replace(fit, d=fit.d + mean)
    except FIT_ERRORS:  # a failed or degenerate fit: the metric falls back to ewma
        return None
    arrays = (fit.Z, fit.T, fit.c, fit.RQR, fit.a, fit.P)
    if not all(np.all(np.isfinite(x)) for x in arrays) or not math.isfinite(fit.H):
        return None
    return fit


class StateSpacePredictor(Predictor):
    """Shared machinery of `ets` and `arima` (subclasses provide `fit_model`)."""

    demean = False  # fit the demeaned series (see `_fit_series`)

    def __init__(
        self,
        horizons_s: Sequence[float] = HORIZONS_S,
        window_s: float = 1.0,
        fit_points: int = 240,
        min_fit_points: int = 30,
        refit_points: int | None = None,
    ) -> None:
        super().__init__(horizons_s, window_s)
        self.fit_points = fit_points
        self.min_fit_points = min_fit_points
        # A fit on `fit_points` windows barely moves until a good share of them is new: refit only after
        # `refit_points` new windows (default a quarter of the fit), whatever the caller's schedule. Between fits
        # the Kalman filter follows every window anyway.
        self.refit_points = refit_points if refit_points is not None else max(1, fit_points // 4)
        self._points_at_fit = -1  # `self.points` when the last refit job was handed out (-1: none yet)
        self.fallback = EwmaPredictor(horizons_s=horizons_s, window_s=window_s)
        self.states: dict[str, KalmanState] = {}
        self._recent: list[SeriesPoint] = []  # windows since the last refit job's data was copied
        self._job_end_s = -math.inf
        self.fits = 0

    @staticmethod
    def fit_model(y: np.ndarray) -> Any:
        raise NotImplementedError

    def _on_point(self, point: SeriesPoint) -> None:
        self.fallback.observe(point, point.end_s)
        self._recent.append(point)
        if len(self._recent) > 4 * self.fit_points:
            del self._recent[: len(self._recent) - 4 * self.fit_points]
        for m, st in self.states.items():
            st.update(point.value(m))

    def refit_job(self, now: float) -> Callable[[], Any] | None:
        pts = self.fallback.history.points()[-self.fit_points :]
        if len(pts) < self.min_fit_points:
            return None
        if self._points_at_fit >= 0 and self.points - self._points_at_fit < self.refit_points:
            return None
        self._points_at_fit = self.points
        series = {m: np.array([p.value(m) for p in pts]) for m in METRICS}
        end_s = pts[-1].end_s
        fit_model, demean = self.fit_model, self.demean

        def job() -> tuple[float, dict[str, StateSpaceFit | None]]:
            return end_s, {m: _fit_series(y, fit_model, demean) for m, y in series.items()}

        return job

    def install(self, fitted: tuple[float, dict[str, StateSpaceFit | None]]) -> None:
        end_s, fits = fitted
        self.fits += 1
        later = [p for p in self._recent if p.end_s > end_s]  # windows that arrived while the job ran
        self.states = {}
        for m, fit in fits.items():
            if fit is None:
                continue
            st = KalmanState(fit)
            for p in later:
                st.update(p.value(m))
            self.states[m] = st
        self._recent = later

    def _forecast(self, now: float, horizons: tuple[float, ...]) -> MetricForecast:
        fb = self.fallback._forecast(now, horizons) if len(self.states) < len(METRICS) else {}
        out: MetricForecast = {}
        for m in METRICS:
            st = self.states.get(m)
            out[m] = fb[m] if st is None else [self._triple(st, m, h) for h in horizons]
        return out

    def _triple(self, st: KalmanState, metric: str, h: float) -> Triple:
        k, scale = horizon_windows(h, self.window_s)
        s_mean, s_var, y_mean, y_var = st.forecast(k)
        if metric in FLOW_METRICS:
            return normal_triple(s_mean * scale, s_var * scale * scale)
        if metric == "decode_concurrency":
            return normal_triple(s_mean / k, s_var / (k * k))
        return normal_triple(y_mean, y_var)


@register("ets")
class EtsPredictor(StateSpacePredictor):
    """Exponential smoothing (statsmodels state-space ETS; `damped_trend` adds a damped trend)."""

    name = "ets"

    def __init__(self, damped_trend: bool = False, **kw: Any) -> None:
        super().__init__(**kw)
        self.damped_trend = damped_trend
        if damped_trend:
            self.fit_model = self._fit_damped  # type: ignore[method-assign]

    @staticmethod
    def fit_model(y: np.ndarray) -> Any:
        from statsmodels.tsa.statespace.exponential_smoothing import ExponentialSmoothing

        return ExponentialSmoothing(y).fit(disp=False)

    @staticmethod
    def _fit_damped(y: np.ndarray) -> Any:
        from statsmodels.tsa.statespace.exponential_smoothing import ExponentialSmoothing

        return ExponentialSmoothing(y, trend=True, damped_trend=True).fit(disp=False)


@register("arima")
class ArimaPredictor(StateSpacePredictor):
    """ARIMA(p, d, q) with a constant (the mean) when d == 0 (statsmodels.tsa.arima; `method` is ARIMA.fit's)."""

    name = "arima"

    def __init__(
        self, order: tuple[int, int, int] = (1, 0, 1), method: str = "innovations_mle", **kw: Any
    ) -> None:
        super().__init__(**kw)
        self.order = tuple(order)
        order_ = self.order
        # With d == 0 the constant is the series mean: fitted as a demeaned series without a trend term. A trend
        # term makes statsmodels wrap the MLE in an iterated GLS (several full fits); the demeaned fit reaches
        # the same likelihood (to a fraction of a unit on the simulator's series) 2-3x faster.
        self.demean = order_[1] == 0

        def fit(y: np.ndarray) -> Any:
            from statsmodels.tsa.arima.model import ARIMA

            # innovations_mle reaches the same maximum likelihood as the state-space optimiser ~3x faster; the
            # result is still a state-space fit (filtered), which is what the Kalman re-anchoring needs.
            return ARIMA(y, order=order_, trend="n").fit(method=method)

        self.fit_model = fit  # type: ignore[method-assign]
