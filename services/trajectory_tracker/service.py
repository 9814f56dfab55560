"""TrackerService: the asyncio shell around TrackerCore.

Input: the EVENTS stream (client lifecycle events on `ns.lifecycle`, engine events on `ns.events.*`).
Output: a LifecycleSnapshot on `subjects.snapshot` every `snapshot_interval_s`.

Restart design. The tracker's state lives in memory, so a restarted tracker must rebuild it. A durable consumer
would resume after the last acknowledged event and the new process would start from an empty map. Instead each
instance creates its own consumer that replays the retained stream from its first message (DeliverPolicy.ALL)
and keeps following it live: the consumer has a generated name and an inactivity threshold, so the server
removes it after the instance dies. Replaying is safe because the core is idempotent, and it is exact because
the core's clock for each event is the stream's storage timestamp (the same on every replay) — so a new instance
reaches the same state, digest for digest, as the one it replaces. Each event is acknowledged after it is applied
(the consumer uses explicit acks, so a crash between apply and ack only causes a harmless redelivery).
Snapshots are withheld until the replay has caught up (nothing pending on the consumer), so a restarted tracker
never publishes a half-rebuilt picture.

Timeouts. `config.silent_after_s` and `lost_after_s` are wall seconds: they guard against outages and crashes,
which last wall seconds whatever the simulated engines' speed-up. The core reads scaled seconds (`now` below), so
the shell hands it the timeouts multiplied by the time scale: at 10× a trajectory is lost after 600 wall seconds of
silence, not 60 (a nats-server restart once made the tracker call finished trajectories lost).

Bad input: bytes that are not a lifecycle or engine event are rejected by the runtime (logged, counted, answered on
the errors subject, terminated). Events the core rejects are counted by kind; the benign kinds (duplicate, stale,
late) only in the health details, the others also as errors with an ErrorReply on the errors subject.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from proto import ENGINE_EVENT_MESSAGES, LIFECYCLE_MESSAGES, ErrorReply, Message
from services.runtime import clock
from services.runtime.bus import EVENTS_MAX_DELIVER
from services.runtime.service import Service
from services.trajectory_tracker.core import BENIGN_KINDS, Rejection, TrackerConfig, TrackerCore
from services.trajectory_tracker.metrics import TrackerMetrics

EVENT_TYPES = (*LIFECYCLE_MESSAGES, *ENGINE_EVENT_MESSAGES)


class TrackerService(Service):
    name = "trajectory_tracker"

    def __init__(
        self,
        nats_url: str,
        namespace: str = "prorsa",
        instance_id: str | None = None,
        metrics_port: int | None = None,
        snapshot_interval_s: float = 1.0,
        config: TrackerConfig | None = None,
        fetch_batch: int = 256,
        consumer_inactive_s: float = 30.0,
    ) -> None:
        super().__init__(nats_url, namespace, instance_id, metrics_port)
        if not (snapshot_interval_s > 0.0):
            raise ValueError("snapshot_interval_s must be > 0")
        wall = config or TrackerConfig()
        scale = clock.time_scale()
        self.core = TrackerCore(
            dataclasses.replace(
                wall, silent_after_s=wall.silent_after_s * scale, lost_after_s=wall.lost_after_s * scale
            )
        )
        self.snapshot_interval_s = snapshot_interval_s
        self.fetch_batch = fetch_batch
        self.consumer_inactive_s = consumer_inactive_s
        self.caught_up = False
        self.last_stream_seq = 0  # stream sequence of the last event applied
        self.snapshots_published = 0
        self._psub: Any = None
        self.domain_metrics = TrackerMetrics(self.metrics)

    async def setup(self) -> None:
        assert self.js is not None
        config = ConsumerConfig(
            deliver_policy=DeliverPolicy.ALL,
            ack_policy=AckPolicy.EXPLICIT,
            filter_subjects=self.subjects.events_stream_subjects,
            inactive_threshold=self.consumer_inactive_s,
            max_deliver=EVENTS_MAX_DELIVER,
            max_ack_pending=max(1024, 4 * self.fetch_batch),
        )
        self._psub = await self.js.pull_subscribe(
            self.subjects.lifecycle, stream=self.subjects.events_stream, config=config
        )
        self.consumed += self.subjects.events_stream_subjects
        self.spawn(
            self.pull_loop(self._psub, self._on_event, EVENT_TYPES, batch=self.fetch_batch), name="events"
        )
        self.spawn(self._snapshot_loop(), name="snapshots")

    async def _on_event(self, event: Message, msg: Msg) -> None:
        meta = msg.metadata
        # Storage time in the stream (identical on every replay), on the shared scaled clock.
        now = meta.timestamp.timestamp() * clock.time_scale()
        rejections = self.core.apply(event, now)
        self.last_stream_seq = meta.sequence.stream
        if meta.num_pending == 0:
            self.caught_up = True
        for r in rejections:
            await self._report(r, msg.subject)
        with contextlib.suppress(Exception):
            await msg.ack()

    async def _report(self, r: Rejection, subject: str) -> None:
        if r.kind in BENIGN_KINDS:
            return
        self.metrics.count_error(r.kind)
        self.log.warning("event_rejected", kind=r.kind, traj_id=r.traj_id, detail=r.detail, subject=subject)
        reply = ErrorReply(
            kind=r.kind, error=r.detail, subject=subject, service=self.instance_id, ts_s=clock.now_s()
        )
        with contextlib.suppress(Exception):
            await self.publish(self.subjects.errors, reply)

    async def _snapshot_loop(self) -> None:
        while not self.stopping:
            await clock.sleep_s(self.snapshot_interval_s)  # scaled seconds, like every `now` here
            if not self.caught_up:
                await self._check_caught_up()
                if not self.caught_up:
                    continue
            await self.publish_snapshot()

    async def _check_caught_up(self) -> None:
        """Caught up when the consumer has nothing pending (covers a replay whose last messages were rejected)."""
        with contextlib.suppress(Exception):
            info = await self._psub.consumer_info()
            if info.num_pending == 0:
                self.caught_up = True

    async def publish_snapshot(self) -> None:
        # The stream's clock may run slightly ahead of ours (another host): never snapshot before the last event.
        now = max(clock.now_s(), self.core.clock_s)
        lost = self.core.expire(now)
        if lost:
            self.log.info("trajectories_lost", count=len(lost), first=lost[0])
        snapshot = self.core.snapshot(now)
        await self.publish(self.subjects.snapshot, snapshot)
        self.domain_metrics.observe(snapshot)
        self.snapshots_published += 1

    def health_details(self) -> dict[str, Any]:
        return {
            "live": self.core.live_count,
            "caught_up": self.caught_up,
            "last_stream_seq": self.last_stream_seq,
            "rejections": dict(self.core.rejections),
            "totals": dict(self.core.totals),
            "snapshots": self.snapshots_published,
        }
