"""ForecasterService: the asyncio shell around ForecasterCore.

Inputs (core NATS, no acks needed: the forecaster's state is soft and rebuilds from live traffic within minutes):
  `subjects.snapshot`                      LifecycleSnapshot from the tracker -> one DemandForecast each;
  `subjects.lifecycle`, `ns.events.*`      lifecycle and engine events (also captured by the EVENTS stream), from
                                           which the core learns exact token flows and lifecycle distributions.
Output: `subjects.forecast`, a DemandForecast from the configured predictor, with its demand outlook (per task, the
live trajectories by phase and the turns ahead: what the allocator plans from), on the consumer's cadence: at the
first snapshot at least `forecast_interval_s` (default 5 s, the allocator's decision interval) after the last
forecast. Every snapshot is still observed (levels and picture, cheap), but the forecast itself — the part that
costs CPU — runs only when the allocator will read it; between two forecasts the allocator would only have kept
the newest. `forecast_interval_s=0` forecasts every snapshot. Bad input is counted (`health_details`).

Refits never block the event loop: when a refit is due, the core hands out a pure job over copied data, which runs
in a worker thread (`asyncio.to_thread`); the core keeps forecasting with the last fitted models until the job's
result is installed back on the loop. At most one refit runs at a time, and refits keep to `refit_cpu_share` of one
core on the wall clock: a refit costs 0.1–0.8 s of CPU and is due every 30 workload seconds, which under a 40x clock
would be back to back (`docs/benchmarks.md`, "Cost live, per service"). CPU by phase (events, snapshots, forecasts,
refits) is in health and in `prorsa_forecaster_cpu_seconds_total{phase}`.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from nats.aio.msg import Msg

from proto import ENGINE_EVENT_MESSAGES, LIFECYCLE_MESSAGES, LifecycleSnapshot, Message
from services.forecaster.core import ForecasterCore
from services.forecaster.metrics import ForecastMetrics
from services.forecaster.series import HORIZONS_S
from services.runtime.clock import Clock
from services.runtime.service import Service

EVENT_TYPES = (*LIFECYCLE_MESSAGES, *ENGINE_EVENT_MESSAGES)


class ForecasterService(Service):
    name = "forecaster"

    def __init__(
        self,
        nats_url: str,
        namespace: str = "prorsa",
        instance_id: str | None = None,
        metrics_port: int | None = None,
        predictor: str = "ensemble",
        horizons_s: Sequence[float] = HORIZONS_S,
        window_s: float = 1.0,
        refit_interval_s: float = 30.0,
        seed: int = 0,
        forecast_interval_s: float = 5.0,
        refit_cpu_share: float = 0.1,
        *,
        clock: Clock | None = None,
    ) -> None:
        super().__init__(nats_url, namespace, instance_id, metrics_port, clock)
        self.forecast_interval_s = forecast_interval_s
        self.refit_cpu_share = refit_cpu_share
        self._refit_not_before = -math.inf  # time.monotonic() (wall) before which no refit starts
        self.refits_deferred = 0  # snapshots at which a due refit waited for the CPU budget
        self._last_forecast_s = -math.inf
        self.snapshots_without_forecast = 0
        self.core = ForecasterCore(
            predictor, horizons_s=horizons_s, window_s=window_s, refit_interval_s=refit_interval_s, seed=seed
        )
        self.domain_metrics = ForecastMetrics(self.metrics, self.core.horizons_s)
        self.forecasts_published = 0
        self.refits = 0
        self._refitting = False
        # CPU seconds by phase (thread CPU time: the refit's thread counts its own): which part of the forecaster
        # costs what, for `prorsa.bench.service_cpu` and the operator (prorsa_forecaster_cpu_seconds_total)
        self.cpu_s: Counter[str] = Counter()
        cpu = self.metrics.counter(
            "prorsa_forecaster_cpu_seconds", "CPU the forecaster spent, by phase", ["phase"]
        )
        self._cpu_metric = {p: cpu.labels(phase=p) for p in ("event", "snapshot", "forecast", "refit")}

    def _count_cpu(self, phase: str, seconds: float) -> None:
        self.cpu_s[phase] += seconds
        self._cpu_metric[phase].inc(seconds)

    async def setup(self) -> None:
        await self.subscribe(self.subjects.snapshot, self._on_snapshot, LifecycleSnapshot)
        await self.subscribe(self.subjects.lifecycle, self._on_event, EVENT_TYPES)
        await self.subscribe(self.subjects.all_engine_events, self._on_event, EVENT_TYPES)

    async def _on_event(self, event: Message, msg: Msg) -> None:
        t0 = time.thread_time()
        self.core.observe_event(event, self.clock.now_s())
        self._count_cpu("event", time.thread_time() - t0)

    async def _on_snapshot(self, snapshot: Message, msg: Msg) -> None:
        assert isinstance(snapshot, LifecycleSnapshot)
        now = snapshot.ts_s
        t0 = time.thread_time()
        self.core.observe_snapshot(snapshot, now)
        self._count_cpu("snapshot", time.thread_time() - t0)
        if now - self._last_forecast_s + 1e-9 < self.forecast_interval_s:
            self.snapshots_without_forecast += 1
        else:
            self._last_forecast_s = now
            t0 = time.thread_time()
            forecast = self.core.forecast(now)
            self._count_cpu("forecast", time.thread_time() - t0)
            await self.publish(self.subjects.forecast, forecast)
            self.domain_metrics.observe_forecast(forecast)
            self.domain_metrics.observe_series(self.core.series)
            self.forecasts_published += 1
        if not self._refitting and self.core.refit_due(now):
            if time.monotonic() < self._refit_not_before:
                self.refits_deferred += 1
                return
            job = self.core.refit_job(now)
            if job is not None:
                self._refitting = True
                self.spawn(self._refit(job), name="refit")

    async def _refit(self, job: Any) -> None:
        def timed() -> tuple[Any, float]:
            t0 = time.thread_time()
            return job(), time.thread_time() - t0

        try:
            fitted, cpu_s = await asyncio.to_thread(timed)  # thread CPU: measured on the refit's own thread
            self._count_cpu("refit", cpu_s)
            # Wall time, not the scaled clock: the budget is the machine's CPU. At 1x a refit round (~0.1-0.8 s of
            # CPU) is due every 30 s and this never binds; under a compressed clock the same cadence in workload
            # seconds would refit back to back and take a core, so the models go a little staler instead.
            if self.refit_cpu_share > 0:
                self._refit_not_before = time.monotonic() + cpu_s / self.refit_cpu_share
            self.core.install(fitted)
            self.refits += 1
        finally:
            self._refitting = False

    def health_details(self) -> dict[str, Any]:
        return {
            "predictor": self.core.name,
            "forecasts": self.forecasts_published,
            "refits": self.refits,
            "refits_deferred": self.refits_deferred,
            "snapshots": self.core.snapshots,
            "events": self.core.learner.events,
            "snapshots_without_forecast": self.snapshots_without_forecast,
            "rejected": dict(self.core.rejected + self.core.learner.rejected),
            "cpu_s": {phase: round(s, 4) for phase, s in self.cpu_s.items()},
        }
