"""ForecasterCore: events and snapshots in, one DemandForecast per call out. Pure and synchronous.

Wiring (the same in the live service and in the simulator):
  observe_event(event, now)      every lifecycle and engine event: exact token flows and lifecycle distributions
                                 (see `learner.py` for why the events and not only the snapshots);
  observe_snapshot(snapshot, now, pending=..., decode_rate_tokens_per_s=...)
                                 every tracker snapshot: the levels of the series and the live picture;
  observe_columns(columns, now, ...)
                                 the same for the tracker's columnar snapshot (`TrackerCore.columns`), in process:
                                 no per-trajectory objects, the fast path for 10,000 live trajectories;
  forecast(now)                  the configured predictor's DemandForecast for the configured horizons, with the
                                 demand outlook the allocator plans from (`outlook.py`: per task, the live
                                 trajectories by phase and the turns ahead);
  refit_due(now) / refit_job(now) / install(result)
                                 scheduled refits: the job is a pure callable over copied data, safe to run on a
                                 worker thread while the core keeps serving with the last fitted models;
                                 `refit(now)` runs it inline (simulator, tests).
All times are the caller's clock in seconds; the series windows live on a fixed grid of that clock.

Bad input is counted in `rejected` (reason -> count) and skipped, never raised: a snapshot older than the last
one (out of order) or with a non-finite time, and the bad rows the picture drops (`picture.py`: non-finite,
negative or absurd values, a trajectory listed twice). Duplicate or late events add nothing (`learner.py`).
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Callable, Sequence
from typing import Any

from proto import DemandForecast, LifecycleSnapshot, TaskOutlook
from services.forecaster.base import Predictor, make_predictor, resolve_name
from services.forecaster.distributions import Distributions
from services.forecaster.learner import EventLearner
from services.forecaster.outlook import window_outlook
from services.forecaster.picture import (
    PendingArrival,
    Picture,
    SnapshotColumnsLike,
    build_picture,
    build_picture_columns,
)
from services.forecaster.series import HORIZONS_S, SeriesPoint, Windower


class ForecasterCore:
    def __init__(
        self,
        predictor: str | Predictor = "ensemble",
        horizons_s: Sequence[float] = HORIZONS_S,
        window_s: float = 1.0,
        refit_interval_s: float = 30.0,
        seed: int = 0,
        predictor_options: dict[str, Any] | None = None,
        sample_capacity: int = 2048,
        series_points: int = 3600,
    ) -> None:
        self.horizons_s = tuple(float(h) for h in horizons_s)
        self.window_s = window_s
        self.refit_interval_s = refit_interval_s
        if isinstance(predictor, Predictor):
            self.predictor = predictor
        else:
            opts = dict(predictor_options or {})
            predictor = resolve_name(predictor)
            if predictor in ("lifecycle", "ensemble"):
                opts.setdefault("seed", seed)
            self.predictor = make_predictor(predictor, horizons_s=self.horizons_s, window_s=window_s, **opts)
        self.distributions = Distributions(capacity=sample_capacity)
        self.learner = EventLearner(Windower(window_s), self.distributions)
        # The closed windows of the demand series (the last hour at 1 s windows): what `series.realised` scores.
        self.series: deque[SeriesPoint] = deque(maxlen=series_points)
        self.last_refit_s = -math.inf
        self._version_at_refit = 0
        self._kinds_at_refit = 0
        self.snapshots = 0
        self.last_snapshot_ts_s = 0.0
        self.rejected: Counter[str] = Counter()  # bad input skipped, by reason (module header)
        self._seen_snapshot = False

    @property
    def name(self) -> str:
        return self.predictor.name

    def _feed(self, points: list[SeriesPoint]) -> None:
        for p in points:
            self.series.append(p)
            self.predictor.observe(p, p.end_s)

    def observe_event(self, event: Any, now: float) -> None:
        """One lifecycle or engine event at `now` (anything else is ignored)."""
        if not math.isfinite(now):
            self.rejected["event_time_not_finite"] += 1
            return
        self._feed(self.learner.observe(event, now))

    def observe_snapshot(
        self,
        snapshot: LifecycleSnapshot,
        now: float | None = None,
        pending: Sequence[PendingArrival] = (),
        decode_rate_tokens_per_s: float | None = None,
    ) -> None:
        """One tracker snapshot (`now` defaults to its timestamp). `pending`: the driver's upcoming first turns;
        `decode_rate_tokens_per_s`: an observed per-sequence decode rate that overrides the learned one."""
        pic = build_picture(snapshot, self.distributions, tuple(pending), decode_rate_tokens_per_s)
        self._observe_picture(pic, now)

    def observe_columns(
        self,
        columns: SnapshotColumnsLike,
        now: float | None = None,
        pending: Sequence[PendingArrival] = (),
        decode_rate_tokens_per_s: float | None = None,
    ) -> None:
        """`observe_snapshot` for a columnar snapshot (the tracker's `SnapshotColumns`); same effect, same
        forecasts, without building an object per trajectory."""
        pic = build_picture_columns(columns, self.distributions, tuple(pending), decode_rate_tokens_per_s)
        self._observe_picture(pic, now)

    def _observe_picture(self, pic: Picture, now: float | None) -> None:
        now = pic.ts_s if now is None else now
        if not (math.isfinite(pic.ts_s) and math.isfinite(now)):
            self.rejected["snapshot_time_not_finite"] += 1
            return
        if self._seen_snapshot and pic.ts_s < self.last_snapshot_ts_s:
            self.rejected["snapshot_out_of_order"] += 1
            return
        if pic.rejected:
            self.rejected.update(pic.rejected)
        self._seen_snapshot = True
        self._feed(self.learner.windower.set_levels(now, pic.decode_concurrency, pic.kv_tokens))
        self.predictor.observe(pic, now)
        self.snapshots += 1
        self.last_snapshot_ts_s = pic.ts_s

    def forecast(self, now: float, horizons: Sequence[float] | None = None) -> DemandForecast:
        """The predictor's forecast, with the demand outlook (`outlook.py`) over the shortest configured horizon
        once a snapshot was seen: the predictor's own, else the last window's turns (the events since the
        previous forecast)."""
        fc = self.predictor.predict(now, horizons or self.horizons_s)
        window = self.learner.window.take(now)
        pic = self.predictor.picture
        horizon = min(self.horizons_s)
        outlook: list[TaskOutlook] = []
        if pic is not None:
            own = self.predictor.outlook(now, horizon)
            outlook = own if own is not None else window_outlook(pic, window, horizon)
        # float(): the wire boundary; msgspec cannot encode numpy scalars (a caller's `now` may be one)
        return DemandForecast(
            ts_s=float(fc.ts_s),
            predictor=fc.predictor,
            horizons=fc.horizons,
            snapshot_ts_s=float(self.last_snapshot_ts_s),
            outlook=outlook,
            outlook_horizon_s=horizon if pic is not None else 0.0,
            started_total=pic.started_total if pic is not None else 0,
        )

    # --- refits -----------------------------------------------------------------------------------------------
    def refit_due(self, now: float) -> bool:
        """Every `refit_interval_s`; early on whenever the learned observations doubled since the last refit (a model
        fitted on the first dozen observations should not wait a whole interval to be replaced); and whenever a
        task's kind got its first sample (its prior, a round stand-in, should not outlive it: on azure-code the
        prior's 256 output tokens against a few dozen real ones were most of the decode error)."""
        if now - self.last_refit_s >= self.refit_interval_s:
            return True
        if self.distributions.kinds_seen > self._kinds_at_refit:
            return True  # a kind's first sample: its prior (a round stand-in) should not outlive it
        return self.distributions.version >= 2 * self._version_at_refit + 20

    def refit_job(self, now: float) -> Callable[[], Any] | None:
        """The predictor's refit as a pure callable (None: nothing to fit yet). Marks the refit as scheduled."""
        job = self.predictor.refit_job(now)
        if job is not None:
            self.last_refit_s = now
            self._version_at_refit = self.distributions.version
            self._kinds_at_refit = self.distributions.kinds_seen
        return job

    def install(self, fitted: Any) -> None:
        self.predictor.install(fitted)

    def refit(self, now: float) -> None:
        job = self.refit_job(now)
        if job is not None:
            self.install(job())
