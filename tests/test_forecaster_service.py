"""ForecasterService against a real nats-server: a snapshot in, a forecast out; bad bytes; refits off the loop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

import proto
from prorsa.bench.synthetic import SyntheticWorkload, generate_events
from proto import DemandForecast, EngineEvent, Subjects
from services.forecaster.service import ForecasterService
from services.runtime.nats_server import EmbeddedNatsServer
from services.trajectory_tracker.core import TrackerCore

S = Subjects()


async def _wait_for(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def _collect_forecasts(nc) -> list[DemandForecast]:  # noqa: ANN001
    """Every DemandForecast published from now on, in arrival order."""
    forecasts: list[DemandForecast] = []

    async def on_forecast(msg) -> None:  # noqa: ANN001
        forecasts.append(proto.decode_as(msg.data, DemandForecast))

    await nc.subscribe(S.forecast, cb=on_forecast)
    return forecasts


async def _publish_events(
    nc, svc: ForecasterService, tracker: TrackerCore, events: list, start: int, stop: int
) -> None:  # noqa: ANN001
    """Apply `events[start:stop]` to `tracker` and publish them; wait until the service has observed `stop` events."""
    for t, ev in events[start:stop]:
        tracker.apply(ev, t)
        subject = S.engine_events(ev.engine_id) if isinstance(ev, EngineEvent) else S.lifecycle
        await nc.publish(subject, proto.encode(ev))
    await _wait_for(lambda: svc.core.learner.events == stop)


async def _publish_first_half(nc, svc: ForecasterService, tracker: TrackerCore, events: list) -> None:  # noqa: ANN001
    """Apply the first half of `events` to `tracker` and publish them; wait until the service observed them all."""
    await _publish_events(nc, svc, tracker, events, 0, len(events) // 2)


async def test_a_snapshot_becomes_a_forecast(nats_server: EmbeddedNatsServer, nc) -> None:  # noqa: ANN001
    svc = ForecasterService(nats_server.url, horizons_s=(5.0, 10.0, 30.0))
    await svc.start()
    forecasts = await _collect_forecasts(nc)
    try:
        tracker = TrackerCore()
        events = generate_events(SyntheticWorkload(trajectories=20, seed=3))
        await _publish_first_half(nc, svc, tracker, events)
        await nc.publish(S.snapshot, b"{not a snapshot")  # bad bytes: counted, no crash
        snap = tracker.snapshot(events[len(events) // 2][0])
        await nc.publish(S.snapshot, proto.encode(snap))
        await _wait_for(lambda: len(forecasts) == 1)
        fc = forecasts[0]
        assert fc.predictor == "ensemble" and fc.snapshot_ts_s == snap.ts_s
        assert [h.horizon_s for h in fc.horizons] == [5.0, 10.0, 30.0]
        for h in fc.horizons:
            for q in (h.prefill_tokens, h.decode_tokens, h.decode_concurrency, h.kv_tokens):
                assert 0.0 <= q.q10 <= q.q50 <= q.q90
        assert fc.horizons[0].decode_concurrency.q50 > 0.0
        assert svc.metrics.error_counts.get("decode", 0) == 1
        # the first snapshot made a refit due; it ran on a worker thread and was installed
        await _wait_for(lambda: svc.refits == 1)
        # on the allocator's cadence: a snapshot 1 s later is observed but not forecast, one 5 s later is
        await nc.publish(S.snapshot, proto.encode(tracker.snapshot(snap.ts_s + 1.0)))
        await _wait_for(lambda: svc.snapshots_without_forecast == 1)
        await nc.publish(S.snapshot, proto.encode(tracker.snapshot(snap.ts_s + 5.0)))
        await _wait_for(lambda: len(forecasts) == 2)
        assert svc.health_details()["forecasts"] == 2 and svc.core.snapshots == 3
    finally:
        await svc.stop()


async def test_published_forecasts_encode_after_a_real_snapshot(nats_server: EmbeddedNatsServer, nc) -> None:  # noqa: ANN001
    """The series predictors compute with numpy: before the wire boundary converted their numpy.float64 values,
    msgspec refused to encode the forecast and nothing was published (the TypeError under `prorsa up`)."""
    svc = ForecasterService(
        nats_server.url, predictor="naive", horizons_s=(5.0, 10.0), forecast_interval_s=0.0
    )
    await svc.start()
    forecasts = await _collect_forecasts(nc)
    try:
        tracker = TrackerCore()
        events = generate_events(SyntheticWorkload(trajectories=10, seed=5))
        await _publish_first_half(nc, svc, tracker, events)
        # Snapshots on the service's clock (its events were observed at svc.clock.now_s()), a second apart, so
        # the series windows close and the predictor forecasts from numpy arrays of them.
        t0 = svc.clock.now_s() + 1.0
        for i in range(3):
            await nc.publish(S.snapshot, proto.encode(tracker.snapshot(t0 + i)))
        await _wait_for(lambda: len(forecasts) == 3)
        assert [f.snapshot_ts_s for f in forecasts] == [t0, t0 + 1, t0 + 2]
        assert all(f.predictor == "naive" and len(f.horizons) == 2 for f in forecasts)
        assert svc.forecasts_published == 3
    finally:
        await svc.stop()


@pytest.mark.parametrize(("share", "refits_after"), [(1e-9, 1), (0.0, 2)])
async def test_refits_keep_to_their_cpu_share(
    nats_server: EmbeddedNatsServer,
    nc,  # noqa: ANN001
    share: float,
    refits_after: int,
) -> None:
    """A refit due by the workload clock waits while the last one's CPU over `refit_cpu_share` (wall) has not
    passed — under a compressed clock the workload cadence would otherwise refit back to back — and health says
    what each phase cost. Without a cap (share 0) the same snapshots refit again."""
    svc = ForecasterService(nats_server.url, refit_interval_s=30.0, refit_cpu_share=share)
    await svc.start()
    try:
        tracker = TrackerCore()
        events = generate_events(SyntheticWorkload(trajectories=20, seed=3))
        await _publish_first_half(nc, svc, tracker, events)
        t = events[len(events) // 2][0]
        await nc.publish(S.snapshot, proto.encode(tracker.snapshot(t)))
        await _wait_for(lambda: svc.refits == 1)
        # the second half: new samples, so the models have something new to fit
        await _publish_events(nc, svc, tracker, events, len(events) // 2, len(events))
        later = tracker.snapshot(events[-1][0] + 31.0)  # a refit is due again by the workload clock
        await nc.publish(S.snapshot, proto.encode(later))
        await _wait_for(lambda: svc.core.snapshots == 2)
        await _wait_for(lambda: svc.refits == refits_after)
        details = svc.health_details()
        assert details["refits_deferred"] == (1 if share else 0)
        assert details["cpu_s"]["refit"] > 0.0 and details["cpu_s"]["snapshot"] > 0.0
        assert set(details["cpu_s"]) <= {"event", "snapshot", "forecast", "refit"}
    finally:
        await svc.stop()
