"""The predictor interface: one small base class, a name -> factory registry, and the inputs predictors see.

A predictor observes two kinds of input, cleaned once here so no subclass repeats it:
  - `SeriesPoint`: one closed window of the demand series (see `series.py`). Non-finite or negative values become
    0 (counted in `sanitised`); a point not newer than the previous one is dropped.
  - `Picture`: the live trajectories of one tracker snapshot as arrays (`picture.py` builds it), with the
    lifecycle distributions and the caller's hints.
It answers `predict(now, horizons) -> DemandForecast` with q10 <= q50 <= q90, all >= 0, for every horizon; with
`calibrate=True` its q10/q90 are recalibrated online on its own matured forecasts (`calibration.py`). Once it has
seen a picture, every quantile — the model's, then the calibrated one — is kept within the physically possible
range of the newest picture (`bounds.py`); this happens here, in `forecast_triples`, the one path every
forecast takes (a member's inside the ensemble too).
Predictors that fit a model offer `refit_job(now)`: a pure callable over copied inputs that may run on another
thread, whose result `install()` adopts on the caller's thread; `refit(now)` does both synchronously.
"""

from __future__ import annotations

import math
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import numpy as np

from proto import DemandForecast, HorizonForecast, Quantiles, TaskOutlook
from services.forecaster.bounds import demand_bound
from services.forecaster.calibration import Calibrator
from services.forecaster.picture import QUEUED, Picture
from services.forecaster.series import HORIZONS_S, METRICS, SeriesPoint

# One forecast per metric and horizon: (q10, q50, q90).
Triple = tuple[float, float, float]
MetricForecast = dict[str, list[Triple]]

Z90 = 1.2815515655446004  # standard normal 0.9 quantile


def normal_triple(mean: float, var: float) -> Triple:
    """(q10, q50, q90) of a normal approximation, clipped at 0."""
    sd = math.sqrt(var) if var > 0.0 else 0.0
    return clean_triple(mean - Z90 * sd, mean, mean + Z90 * sd)


def linear_quantiles(x: np.ndarray, qs: Sequence[float]) -> list[float]:
    """`np.quantile(x, qs)` of a 1-d array (numpy's default 'linear' method, with its arithmetic, so the same
    floats) as Python floats. Why: np.quantile's generic path costs ~0.1 ms a call on a few hundred values, and a
    forecast calls it dozens of times per tick; one sort and a few scalar steps cost a few microseconds.
    Non-finite values or an empty array go to np.quantile itself (which raises on empty input)."""
    n = len(x)
    if n == 0 or not np.isfinite(x).all():
        return [float(v) for v in np.quantile(x, qs)]
    s = np.sort(x).tolist()
    out = []
    for q in qs:
        v = (n - 1) * q
        if v >= n - 1:  # numpy takes the last value (its lower index becomes -1)
            lo, a, b = -1, s[-1], s[-1]
        elif v < 0:
            lo, a, b = 0, s[0], s[0]
        else:
            lo = math.floor(v)
            a, b = s[lo], s[lo + 1]
        t = v - lo
        d = b - a
        out.append(b - d * (1 - t) if t >= 0.5 else a + d * t)  # numpy's _lerp, exact at both ends
    return out


def clean_triple(q10: float, q50: float, q90: float) -> Triple:
    """Finite, non-negative and ordered, as Python floats: predictors compute with numpy, whose scalars
    (numpy.float64) msgspec refuses to encode, so this is where they leave for the wire."""
    vals = [float(v) if math.isfinite(v) and v > 0.0 else 0.0 for v in (q10, q50, q90)]
    vals.sort()
    return vals[0], vals[1], vals[2]


def bounded(fc: MetricForecast, bound: dict[str, list[float]] | None) -> MetricForecast:
    """`fc` cleaned (`clean_triple`: finite, >= 0, ordered) and, with a bound, each quantile at most the bound."""
    out: MetricForecast = {}
    for m, rows in fc.items():
        cap = bound.get(m) if bound is not None else None
        clean = [clean_triple(*t) for t in rows]
        if cap is not None:
            clean = [(min(a, u), min(b, u), min(c, u)) for (a, b, c), u in zip(clean, cap, strict=True)]
        out[m] = clean
    return out


class Predictor(ABC):
    """Base class; subclasses set `name` and implement `_forecast`, optionally `_on_point`/`_on_picture`."""

    name: ClassVar[str] = ""

    def __init__(
        self, horizons_s: Sequence[float] = HORIZONS_S, window_s: float = 1.0, calibrate: bool = False
    ) -> None:
        if not horizons_s or any(not (h > 0.0) for h in horizons_s):
            raise ValueError("horizons must be > 0")
        if not (window_s > 0.0):
            raise ValueError("window_s must be > 0")
        self.horizons_s = tuple(float(h) for h in horizons_s)
        self.window_s = window_s
        self.sanitised = 0  # input values replaced because they were negative or not finite
        self.last_end_s = -math.inf
        self.points = 0
        # q10/q90 recalibrated online on this predictor's own matured forecasts (calibration.py)
        self.calibrator = Calibrator(self.horizons_s, window_s) if calibrate else None
        self.picture: Picture | None = None  # the newest picture: the live trajectories the bound counts

    # --- input ------------------------------------------------------------------------------------------------
    def observe(self, item: SeriesPoint | Picture, now: float) -> None:
        """Take one series window or one picture (see the module header)."""
        if isinstance(item, SeriesPoint):
            point = self._sanitise(item)
            if point is not None:
                self.last_end_s = point.end_s
                self.points += 1
                if self.calibrator is not None:
                    self.calibrator.observe(point)
                self._on_point(point)
        elif isinstance(item, Picture):
            self.picture = item
            self._on_picture(item)
        else:
            raise TypeError(f"cannot observe {type(item).__name__}")

    def _sanitise(self, p: SeriesPoint) -> SeriesPoint | None:
        if not math.isfinite(p.end_s) or p.end_s <= self.last_end_s:
            self.sanitised += 1
            return None
        vals = [p.value(m) for m in METRICS]
        clean = [v if math.isfinite(v) and v >= 0.0 else 0.0 for v in vals]
        if clean != vals:
            self.sanitised += 1
            p = SeriesPoint(p.end_s, p.window_s, *clean)
        return p

    def _on_point(self, point: SeriesPoint) -> None:
        """A new, clean window (override; the default ignores it)."""
        return None

    def _on_picture(self, picture: Picture) -> None:
        """A new picture (override; the default ignores it)."""
        return None

    # --- output -----------------------------------------------------------------------------------------------
    def predict(self, now: float, horizons: Sequence[float] | None = None) -> DemandForecast:
        hs = tuple(float(h) for h in (horizons or self.horizons_s))
        fc = self.forecast_triples(now, hs)
        out = []
        for i, h in enumerate(hs):
            q = {
                m: Quantiles(**dict(zip(("q10", "q50", "q90"), clean_triple(*fc[m][i]), strict=True)))
                for m in METRICS
            }
            out.append(HorizonForecast(horizon_s=h, **q))
        return DemandForecast(ts_s=float(now), predictor=self.name, horizons=out)

    def forecast_triples(self, now: float, horizons: tuple[float, ...]) -> MetricForecast:
        """`_forecast`, calibrated when this predictor calibrates, within the demand bound (module header): what
        `predict` publishes. The model's forecast is bounded before calibration too, so the calibrator never
        learns from, or scales, a band wider than what is possible."""
        bound = self.bound(now, horizons)
        fc = bounded(self._forecast(now, horizons), bound)
        if self.calibrator is not None:
            fc = bounded(self.calibrator.adjust(now, horizons, fc), bound)
        return fc

    def bound(self, now: float, horizons: Sequence[float]) -> dict[str, list[float]] | None:
        """The upper end of the physically possible range per metric and horizon (`bounds.py`), from the newest
        picture; None before a picture with the run's distributions was seen (then only >= 0 holds)."""
        pic = self.picture
        if pic is None or pic.distributions is None:
            return None
        queued = pic.context[pic.state == QUEUED]
        pending = [(max(0.0, p.at_s - now), float(p.prompt_tokens)) for p in pic.pending]
        return demand_bound(
            pic.distributions.limits, pic.n, queued, float(pic.context.sum()), pending, horizons
        )

    def outlook(self, now: float, horizon_s: float) -> list[TaskOutlook] | None:
        """Per live task, the trajectories by phase and the turns over the next `horizon_s` (`outlook.py`), from this
        predictor's own model; None (the default: every series predictor) when it has none, and the caller takes
        the naive rule, the last window's turns (`outlook.window_outlook`)."""
        return None

    @abstractmethod
    def _forecast(self, now: float, horizons: tuple[float, ...]) -> MetricForecast:
        """metric -> one (q10, q50, q90) per horizon, in order (cleaned by `predict`)."""

    # --- fitting ----------------------------------------------------------------------------------------------
    def refit_job(self, now: float) -> Callable[[], Any] | None:
        """A pure callable over copied inputs (safe on another thread), or None when nothing needs fitting."""
        return None

    def install(self, fitted: Any) -> None:
        """Adopt a refit job's result (on the caller's thread; the default has nothing to adopt)."""
        return None

    def refit(self, now: float) -> None:
        job = self.refit_job(now)
        if job is not None:
            self.install(job())


Factory = Callable[..., Predictor]
REGISTRY: dict[str, Factory] = {}


def register(name: str) -> Callable[[Factory], Factory]:
    def deco(factory: Factory) -> Factory:
        REGISTRY[name] = factory
        return factory

    return deco


# Deprecated names -> registered names. `prorsa` was the ensemble's name, the same as the allocator policy's, so
# "prorsa with prorsa" was ambiguous in flags and reports; it keeps working for old command lines and configs.
ALIASES: dict[str, str] = {"prorsa": "ensemble"}


def resolve_name(name: str) -> str:
    """The registered name for `name` (a deprecated alias warns once per call site)."""
    new = ALIASES.get(name)
    if new is None:
        return name
    warnings.warn(f"predictor {name!r} is deprecated; use {new!r}", DeprecationWarning, stacklevel=3)
    return new


def make_predictor(name: str, **options: Any) -> Predictor:
    """Build a registered predictor (or a deprecated alias of one). Raises KeyError naming the known predictors
    for an unknown name."""
    import services.forecaster.predictors  # noqa: F401 - registers every predictor

    name = resolve_name(name)
    try:
        factory = REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown predictor {name!r}; known: {', '.join(sorted(REGISTRY))}") from None
    return factory(**options)
