"""The live forecast feed: a tracker and a forecaster fed by the simulator, asked at every policy decision.

Only policies that read a forecast (`AllocatorPolicy.uses_forecast`) get a feed; the others run without it, so
their runs cost exactly what they did. Wiring (all in virtual time):
  * every simulator event goes to a `LiveBridge` (the forecast-eval `SimBridge`'s event -> proto message mapping,
    queued) and, for the driver's hints, to an `ArrivalSchedule`;
  * at a decision at `now` (`ForecastFeed.at`): each request decoding at `now` gets a report of its tokens at
    `now`, read from the simulated engine's state (its step counter plus the steps of the decode jump in progress
    completed by `now`) — what a real engine, which publishes progress every step, would have reported by `now`.
    Then, for every series window end w since the last decision and for `now` itself, as in the forecast-eval's
    tick: the queued messages before w, each decoding request's progress by w (linear between its reports, the
    last of which is the one at `now` or earlier), the messages at w, applied to the `TrackerCore` and the
    `ForecasterCore`. Then `tracker.expire(now)`, the snapshot, `observe_snapshot(snapshot, now,
    pending=<hints>)`, the forecast (with its demand outlook: the policy reads the live trajectories there, never
    the snapshot), and a refit inline when the core says one is due (virtual time does not move while a model
    fits).
Why not the forecast-eval's way: there, messages are held until every decoding request has reported again after
the tick, and progress is interpolated between two reports — the later one lies in the future of the tick. A
decision cannot wait for the future, so the feed reads the engine's state at `now` instead, and never sees an
event stamped after `now` (`tests/test_sim_forecast_feed.py` checks this by stamping). Why interpolate per window:
the engine reports progress only at the end of a decode jump (seconds apart in a long tail); handing the
forecaster all tokens of a jump in the window of the decision made it measure a per-sequence decode rate 3-4x too
high in the tail (decode WAPE at 10 s: 0.39 without, 0.09 with, on swe, 64 trajectories).

The tracker sees a snapshot only at decisions (every `interval_s`, 5 s for prorsa), not every second as the live
service would: between two decisions the forecaster's demand levels (decode concurrency, KV) carry forward, while
its token flows are counted in the windows they happened in.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from prorsa.forecast_eval.bridge import SimBridge, _Req
from prorsa.forecast_eval.hints import ArrivalSchedule, RecordingWorkload
from proto import DemandForecast, LifecycleSnapshot
from services.forecaster.core import ForecasterCore
from services.forecaster.series import HORIZONS_S
from services.trajectory_tracker.core import BENIGN_KINDS, TrackerCore

if TYPE_CHECKING:
    from prorsa.sim.engine import SimEngine
    from prorsa.sim.events import SimObserver
    from prorsa.sim.runner import SimConfig
    from prorsa.sim.sim_driver import StepSource
    from prorsa.sim.state import Request

# Progress read at a decision is stamped this much before it, so the forecaster's series counts it in the window
# that the decision closes (windows are [k W, (k+1) W); a flow at exactly k W would open the next one).
_BEFORE_NOW_S = 1e-6


def decoded_at(engine: SimEngine, req: Request, now: float) -> int:
    """Output tokens of `req` (decoding on `engine`) out by `now`: the one its prefill sampled, its completed steps,
    and the steps of the engine's decode jump in progress that end at or before `now` (`EngineCore.steps_at`)."""
    return min(engine.steps_at(now), req.target_step) - req.start_step + 1


class _NoLedger:
    """The live feed needs no record of realised demand (a truth-fed run keeps its own, `prorsa.sim.truth_feed`)."""

    prefill_total_tokens = decode_total_tokens = 0.0

    def add_prefill(self, t: float, tokens: float) -> None:
        pass

    def add_decode(self, t0: float, t1: float, tokens: float) -> None:
        pass


class LiveBridge(SimBridge):
    """`SimBridge` released at decision times without waiting for later reports (module header).

    `report_now` adds, for every request decoding at `now`, a report of its tokens at `now` read from its
    engine; `progress_at` then interpolates between reports up to `now` as in the forecast-eval. Memory stays
    bounded: `progress_at` consumes reports and forgets closed requests, and the heap of open requests (used only
    by the hold-back's `ready`) is not kept."""

    def __init__(self) -> None:
        super().__init__()
        self.ledger = _NoLedger()  # type: ignore[assignment]

    def _open(self, r: _Req, now: float) -> None:
        r.open = True  # no heap: `ready` is never asked

    def report_now(self, now: float, engines: Iterable[SimEngine]) -> None:
        """Report what each request decoding at `now` had generated by then (if it advanced since its last
        report). Between two of its reports an engine's step counter moves only in the jump in progress, so the
        engine's state at `now` is exact."""
        for engine in engines:
            for req in engine.seqs.values():
                tid = self._ids.get((req.traj.spec.traj_id, req.traj.attempt))
                r = self._reqs.get(f"{tid}:{req.turn}") if tid is not None else None
                if r is None or not r.reports:
                    continue  # an aborted attempt's last decode, or not started in the bridge
                total = r.offset + decoded_at(engine, req, now)
                if total > r.reports[-1][1] and now > r.reports[-1][0]:
                    r.reports.append((now, total))


class ForecastFeed:
    """A `SimObserver` feeding a `TrackerCore` and one `ForecasterCore`; `at(now, engines)` per decision."""

    def __init__(
        self,
        predictor: str = "prorsa",
        schedule: ArrivalSchedule | None = None,
        horizons_s: tuple[float, ...] = HORIZONS_S,
        window_s: float = 1.0,
        refit_interval_s: float = 30.0,
        seed: int = 0,
    ) -> None:
        """Raises ValueError for an unknown predictor name."""
        try:
            self.core = ForecasterCore(
                predictor, horizons_s, window_s=window_s, refit_interval_s=refit_interval_s, seed=seed
            )
        except KeyError as exc:
            raise ValueError(exc.args[0]) from None
        self.bridge = LiveBridge()
        self.tracker = TrackerCore()
        self.schedule = schedule
        self._step_of: dict[str, int] = {}
        self.last_event_s = -math.inf  # newest event seen (events arrive in time order)
        self._next_window = 1  # index of the next series window end to interpolate progress at
        self.decisions = 0
        self.refits = 0
        self.bad_rejections: dict[str, int] = {}  # tracker rejections other than duplicate/stale/late
        self.last_snapshot: LifecycleSnapshot | None = None  # the forecaster's input at the last decision

    def on_event(self, kind: str, traj_id: str, now: float, **f: Any) -> None:
        self.last_event_s = now
        self.bridge.on_event(kind, traj_id, now, **f)
        if self.schedule is None:
            return
        if kind == "trajectory_started":
            self._step_of[traj_id] = int(f["step"])
            self.schedule.started(int(f["step"]), traj_id, int(f.get("attempt", 0)), now)
        elif kind == "trajectory_finished":
            self.schedule.finished(self._step_of.pop(traj_id, 0), now)

    def at(self, now: float, engines: Iterable[SimEngine]) -> DemandForecast:
        """The forecast at `now`, from what happened up to `now` (module header); the tracker's snapshot it was
        made from stays in `last_snapshot`."""
        self.bridge.report_now(now, engines)
        w = self.core.window_s
        while self._next_window * w < now:  # the series windows closed since the last decision
            self._flush(self._next_window * w)
            self._next_window += 1
        self._flush(now)
        self._next_window = math.floor(now / w) + 1
        self.tracker.expire(now)
        snapshot = self.last_snapshot = self.tracker.snapshot(now)
        pending = self.schedule.pending(now) if self.schedule is not None else ()
        self.core.observe_snapshot(snapshot, now, pending=pending)
        forecast = self.core.forecast(now)
        if self.core.refit_due(now):
            self.core.refit(now)  # inline: in virtual time a refit takes no time
            self.refits += 1
        self.decisions += 1
        return forecast

    def _flush(self, t: float) -> None:
        """Apply the messages up to `t`, with each decoding request's progress by `t` interpolated between its
        reports (stamped just before `t`, so the series window that `t` closes counts it)."""
        for ts, msg in self.bridge.flush(t, _BEFORE_NOW_S):
            self._apply(msg, ts)

    def _apply(self, msg: Any, t: float) -> None:
        for r in self.tracker.apply(msg, t):
            if r.kind not in BENIGN_KINDS:
                self.bad_rejections[r.kind] = self.bad_rejections.get(r.kind, 0) + 1
        self.core.observe_event(msg, t)


def live_feed(config: SimConfig, workload: StepSource) -> tuple[RecordingWorkload, ForecastFeed]:
    """The feed for one run of `config` (predictor `config.forecaster`, the driver's `started` hints: first turns
    of steps already submitted), and the workload to run it on (recorded, so the hints can read the steps).
    Raises ValueError for an unknown predictor."""
    recorded = RecordingWorkload(workload)
    schedule = ArrivalSchedule(
        recorded, "started", sync=config.mode == "sync", training_s=config.training_s, steps=config.steps
    )
    return recorded, ForecastFeed(config.forecaster, schedule, seed=config.seed)


class Tee:
    """Hands every simulator event to each observer in turn (the feed first, then the user's)."""

    def __init__(self, *observers: SimObserver) -> None:
        self.observers = observers

    def on_event(self, kind: str, traj_id: str, now: float, **fields: Any) -> None:
        for obs in self.observers:
            obs.on_event(kind, traj_id, now, **fields)
