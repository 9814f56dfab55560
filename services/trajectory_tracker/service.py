"""TrackerService: the asyncio shell around TrackerCore.

Input: the EVENTS stream (client lifecycle events on `ns.lifecycle`, engine events on `ns.events.*`).
Output: a LifecycleSnapshot on `subjects.snapshot` every `snapshot_interval_s`.

Restart design. The tracker's state lives in memory, so a restarted tracker must rebuild it from the EVENTS stream,
and it must rebuild it exactly: the core's clock for each event is the stream's storage timestamp (the same on
every replay), so replaying the stream reaches the same state, digest for digest, as the instance it replaces.
Each instance creates its own consumer (a generated name and an inactivity threshold, so the server removes it
after the instance dies) rather than a durable one, which would resume after the last acknowledged event into an
empty map. Each event is acknowledged after it is applied (explicit acks; a crash between apply and ack only causes
a redelivery, which the shell skips: an event at or below the last applied stream sequence is already in the state).

Checkpoints. Replaying the whole stream took 20-30 s after a quarter of an hour of rollout, so every
`checkpoint_interval_s` wall seconds (when the state moved) and on a graceful stop the shell writes the core's
state and the stream sequence it reflects (`checkpoint.py`) to the tracker's object store (`checkpoint_store.py`).
A new instance loads the latest checkpoint and replays from the sequence after it (DeliverPolicy.BY_START_SEQUENCE),
which reaches the same state as a full replay (tests/test_tracker_checkpoint_service.py). A checkpoint that is
corrupt, of another schema or bounds, or not of this EVENTS stream (recreated since, or ahead of it) is logged,
counted (`checkpoint_<kind>` errors, `checkpoint.refused` in health) and ignored: the instance replays everything.
One caveat: lost trajectories are folded when a snapshot is taken (`expire` at the shell's wall time), so an
instance restored from a checkpoint keeps the expiries its predecessor made, which a full replay (no snapshots
until caught up) would make only once caught up. Snapshots are withheld until the replay has caught up (nothing
pending on the consumer), so a restarted tracker never publishes a half-rebuilt picture.

Timeouts. `config.silent_after_s` and `lost_after_s` are wall seconds: they guard against outages and crashes,
which last wall seconds whatever the simulated engines' speed-up. The core reads scaled seconds (`now` below), so
the shell hands it the timeouts multiplied by the time scale: at 10× a trajectory is lost after 600 wall seconds of
silence, not 60 (a nats-server restart once made the tracker call finished trajectories lost).

Bad input: bytes that are not a lifecycle or engine event are rejected by the runtime (logged, counted, answered on
the errors subject, terminated). Events the core rejects are counted by kind; the benign kinds (duplicate, stale,
late) only in the health details, the others also as errors with an ErrorReply on the errors subject.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from typing import Any

import nats.errors
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from proto import ENGINE_EVENT_MESSAGES, LIFECYCLE_MESSAGES, ErrorReply, Message
from services.runtime.bus import BUS_ERRORS, EVENTS_MAX_DELIVER
from services.runtime.clock import Clock
from services.runtime.service import Service
from services.trajectory_tracker import checkpoint
from services.trajectory_tracker.checkpoint import CheckpointError
from services.trajectory_tracker.checkpoint_store import CheckpointStore
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
        checkpoint_interval_s: float | None = 5.0,
        *,
        clock: Clock | None = None,
    ) -> None:
        """`checkpoint_interval_s`: wall seconds between checkpoints (None: none written or read)."""
        super().__init__(nats_url, namespace, instance_id, metrics_port, clock)
        if not (snapshot_interval_s > 0.0):
            raise ValueError("snapshot_interval_s must be > 0")
        wall = config or TrackerConfig()
        scale = self.clock.time_scale
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
        self.checkpoint_interval_s = checkpoint_interval_s
        self._store: CheckpointStore | None = None
        self._stream_created = ""  # the EVENTS stream's creation time: a checkpoint names the stream it is of
        self.restored_from_seq: int | None = (
            None  # the checkpoint this instance started from (None: full replay)
        )
        self.checkpoint_seq = 0  # stream sequence of the last checkpoint written
        self.checkpoints_saved = 0
        self.checkpoints_refused: dict[str, int] = {}  # kind -> checkpoints ignored at start
        self.events_applied = (
            0  # by this instance (a restored one replays only what came after its checkpoint)
        )
        self.domain_metrics = TrackerMetrics(self.metrics)

    async def setup(self) -> None:
        assert self.js is not None
        start_seq = await self._restore() if self.checkpoint_interval_s else None
        config = ConsumerConfig(
            deliver_policy=DeliverPolicy.ALL if start_seq is None else DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=start_seq,
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
        if self.checkpoint_interval_s:
            self.spawn(self._checkpoint_loop(self.checkpoint_interval_s), name="checkpoints")

    async def _restore(self) -> int | None:
        """Load the latest checkpoint into the core; returns the stream sequence to replay from (None: all)."""
        assert self.js is not None
        info = await self.js.stream_info(self.subjects.events_stream)
        self._stream_created = str(info.created or "")
        self._store = CheckpointStore(self.js, self.subjects.tracker_checkpoint_bucket)
        await self._store.open()
        try:
            data = await self._store.load()
            if data is None:
                self.log.info("no_checkpoint")
                return None
            ck = checkpoint.decode(data)
            checkpoint.check_stream(ck, self._stream_created, info.state.last_seq)
            self.core = checkpoint.restore(ck, self.core.config)
        except CheckpointError as err:  # never fatal: the stream still holds everything
            self.checkpoints_refused[err.kind] = self.checkpoints_refused.get(err.kind, 0) + 1
            self.metrics.count_error(f"checkpoint_{err.kind}")
            self.log.warning("checkpoint_refused", kind=err.kind, detail=err.detail)
            return None
        self.last_stream_seq = self.checkpoint_seq = self.restored_from_seq = ck.stream_seq
        self.log.info("checkpoint_restored", stream_seq=ck.stream_seq, live=self.core.live_count)
        return ck.stream_seq + 1

    async def _checkpoint_loop(self, interval_s: float) -> None:
        # The first one as soon as the replay has caught up: an instance killed again soon after it started
        # (a crash loop, a fault campaign) leaves its successor a recent checkpoint, not its predecessor's.
        while not self.caught_up and not self.stopping:
            await asyncio.sleep(0.05)
        while not self.stopping:
            await self.save_checkpoint()
            await asyncio.sleep(interval_s)  # wall seconds: a restart's replay time is wall time

    async def save_checkpoint(self) -> bool:
        """Write the state if it moved since the last checkpoint; False when the server could not take it (the
        next tick tries again)."""
        if self._store is None or self.last_stream_seq == self.checkpoint_seq:
            return True
        # Captured in one synchronous step, so the state and the sequence belong together.
        seq = self.last_stream_seq
        try:
            data = checkpoint.encode(checkpoint.capture(self.core, seq, self._stream_created))
        except (
            OverflowError
        ) as exc:  # a total beyond 64 bits, summed from peers' (bounded) counts: keep going
            self.metrics.count_error("checkpoint_encode")
            self.log.error("checkpoint_unencodable", error=repr(exc))
            return False
        try:
            await self._store.save(data)
        except nats.errors.Error as exc:  # the server restarting, or full: the stream still holds the events
            self.metrics.count_error("checkpoint_write")
            self.log.warning("checkpoint_write_failed", error=repr(exc))
            return False
        self.checkpoint_seq = seq
        self.checkpoints_saved += 1
        return True

    async def teardown(self) -> None:
        # A graceful stop leaves a checkpoint of everything applied, so the next instance replays nothing.
        await self.save_checkpoint()
        # Then the pull subscription goes before the connection drains: events the server delivered for the last
        # fetch wait in its queue for a handler that is gone, and nats.py's drain waited for them until its
        # timeout (5 s added to every graceful restart). Unacked, they are the next instance's to replay.
        if self._psub is not None:
            with contextlib.suppress(nats.errors.Error):
                await self._psub.unsubscribe()

    async def _on_event(self, event: Message, msg: Msg) -> None:
        meta = msg.metadata
        if meta.sequence.stream <= self.last_stream_seq:  # a redelivery (a lost ack): already in the state
            with contextlib.suppress(*BUS_ERRORS):
                await msg.ack()
            return
        # Storage time in the stream (identical on every replay), on the shared scaled clock.
        now = meta.timestamp.timestamp() * self.clock.time_scale
        rejections = self.core.apply(event, now)
        self.last_stream_seq = meta.sequence.stream
        self.events_applied += 1
        if meta.num_pending == 0:
            self.caught_up = True
        for r in rejections:
            await self._report(r, msg.subject)
        with contextlib.suppress(*BUS_ERRORS):
            await msg.ack()

    async def _report(self, r: Rejection, subject: str) -> None:
        if r.kind in BENIGN_KINDS:
            return
        self.metrics.count_error(r.kind)
        self.log.warning("event_rejected", kind=r.kind, traj_id=r.traj_id, detail=r.detail, subject=subject)
        reply = ErrorReply(
            kind=r.kind, error=r.detail, subject=subject, service=self.instance_id, ts_s=self.clock.now_s()
        )
        with contextlib.suppress(*BUS_ERRORS):
            await self.publish(self.subjects.errors, reply)

    async def _snapshot_loop(self) -> None:
        while not self.stopping:
            await self.clock.sleep_s(self.snapshot_interval_s)  # scaled seconds, like every `now` here
            if not self.caught_up:
                await self._check_caught_up()
                if not self.caught_up:
                    continue
            await self.publish_snapshot()

    async def _check_caught_up(self) -> None:
        """Caught up when the consumer has nothing pending (covers a replay whose last messages were rejected)."""
        with contextlib.suppress(*BUS_ERRORS):
            info = await self._psub.consumer_info()
            if info.num_pending == 0:
                self.caught_up = True

    async def publish_snapshot(self) -> None:
        # The stream's clock may run slightly ahead of ours (another host): never snapshot before the last event.
        now = max(self.clock.now_s(), self.core.clock_s)
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
            "checkpoint": {
                "restored_from_seq": self.restored_from_seq,
                "events_replayed": self.events_applied,
                "saved": self.checkpoints_saved,
                "last_seq": self.checkpoint_seq,
                "refused": dict(self.checkpoints_refused),
            },
        }
