"""Issue 14, finding 3: one message must never stop a service. Every decode failure (msgspec's or any other, such as
the RecursionError of deep nesting) is counted and the message terminated; consumers bound their deliveries; a
service whose task died says so in health; health answers only a valid request."""

from __future__ import annotations

import asyncio
import time

import nats

import proto
from prorsa.health import gather_health
from proto import HealthReply, HealthRequest, Subjects, TrajectoryStarted
from services.runtime.bus import EVENTS_MAX_DELIVER, WORK_MAX_DELIVER
from services.runtime.nats_server import EmbeddedNatsServer
from services.runtime.service import Service
from services.trajectory_tracker.service import TrackerService
from tests.engine_agent_support import Watcher, make_agent, publish_work, request, wait_until

S = Subjects()
DEEP_OBJECT = b'{"a":' * 5000  # msgspec's decoder recurses per level: RecursionError, not a msgspec error
DEEP_ARRAY = b"[" * 200_000


def test_deep_nesting_raises_only_proto_error() -> None:
    for data in (DEEP_OBJECT, DEEP_ARRAY, b'{"type":"trajectory_started","x":' + DEEP_OBJECT):
        try:
            proto.decode(data, "prorsa.lifecycle", TrajectoryStarted)
        except proto.ProtoError as err:
            assert err.kind == "decode" and err.subject == "prorsa.lifecycle"
        else:
            raise AssertionError("decoded a hostile payload")


async def test_tracker_survives_deep_nesting_and_keeps_applying(nats_server: EmbeddedNatsServer, nc) -> None:  # noqa: ANN001
    svc = TrackerService(nats_server.url, snapshot_interval_s=0.1)
    await svc.start()
    js = nc.jetstream()
    try:
        for _ in range(3):
            await js.publish(S.lifecycle, DEEP_OBJECT)
        await js.publish(
            S.lifecycle, proto.encode(TrajectoryStarted(traj_id="after", ts_s=time.time(), source="c", seq=1))
        )
        await wait_until(lambda: svc.core.live_count == 1, timeout_s=8)
        assert svc.bad_input == 3 and svc.metrics.error_counts["decode"] == 3
        assert not svc.failed_tasks
        # Terminated, not left for redelivery: nothing is pending acknowledgement on the tracker's consumer.
        info = await svc._psub.consumer_info()
        assert info.num_ack_pending == 0 and info.config.max_deliver == EVENTS_MAX_DELIVER
        replies = await gather_health(nats_server.url, wait_s=0.3)
        assert [(r.status, r.details["bad_input"]) for r in replies] == [("ok", 3)]
    finally:
        await svc.stop()


async def test_engine_terminates_poison_work_and_serves_on(nats_server: EmbeddedNatsServer, nc) -> None:  # noqa: ANN001
    agent = make_agent(nats_server.url, "poison-0", "mixed")
    await agent.start()
    watcher = Watcher()
    await watcher.attach(nc)
    try:
        for subject in (S.prefill_work_any, S.prefill_work_for("poison-0"), S.decode_work_any):
            await nc.jetstream().publish(subject, DEEP_OBJECT)
        await publish_work(nc, S.prefill_work_any, request("after-poison", max_tokens=5))
        await watcher.wait_finished(["after-poison"], timeout_s=10)
        await wait_until(lambda: agent.bad_input >= 3, timeout_s=5)
        for (kind, own), psub in agent.puller.subs.items():
            info = await psub.consumer_info()
            assert info.config.max_deliver == WORK_MAX_DELIVER, (kind, own)
            assert info.num_ack_pending == 0 and info.num_redelivered == 0, (kind, own, info)
        assert not agent.failed_tasks
    finally:
        await agent.stop()


class Crashy(Service):
    name = "crashy"

    async def setup(self) -> None:
        async def boom() -> None:
            raise RuntimeError("consuming loop died")

        self.spawn(boom(), name="events")


async def test_a_service_whose_task_died_reports_unhealthy(nats_server: EmbeddedNatsServer) -> None:
    svc = Crashy(nats_server.url, instance_id="crashy-1")
    await svc.start()
    try:
        await wait_until(lambda: bool(svc.failed_tasks), timeout_s=5)
        replies = await gather_health(nats_server.url, wait_s=0.3)
        assert [r.status for r in replies] == ["unhealthy"]
        assert "events" in replies[0].details["failed_tasks"]
    finally:
        await svc.stop()


class Buggy(Service):
    """A handler with a bug on one trajectory id."""

    name = "buggy"

    async def setup(self) -> None:
        self.seen: list[str] = []
        await self.subscribe(S.lifecycle, self._on_started, TrajectoryStarted)

    async def _on_started(self, msg: proto.Message, raw: object) -> None:
        assert isinstance(msg, TrajectoryStarted)
        if msg.traj_id == "bug":
            raise KeyError("our bug")
        self.seen.append(msg.traj_id)


async def test_a_handler_bug_is_surfaced_in_health_until_the_handler_succeeds(
    nats_server: EmbeddedNatsServer,
) -> None:
    svc = Buggy(nats_server.url, instance_id="buggy-1")
    await svc.start()
    nc = await nats.connect(nats_server.url)
    try:
        started = TrajectoryStarted(traj_id="bug", ts_s=time.time(), source="c", seq=1)
        await nc.publish(S.lifecycle, proto.encode(started))
        await wait_until(lambda: svc.metrics.error_counts.get("handler") == 1, timeout_s=5)
        (reply,) = await gather_health(nats_server.url, wait_s=0.3)
        assert reply.status == "degraded" and "KeyError" in reply.details["bugs"][f"handler:{S.lifecycle}"]
        assert svc.bad_input == 0  # our bug, not bad input
        good = TrajectoryStarted(traj_id="good", ts_s=time.time(), source="c", seq=2)
        await nc.publish(S.lifecycle, proto.encode(good))
        await wait_until(lambda: svc.seen == ["good"], timeout_s=5)
        assert svc.health_status == "ok" and not svc.bugs
    finally:
        await nc.close()
        await svc.stop()


async def test_health_answers_only_a_valid_request(nats_server: EmbeddedNatsServer) -> None:
    services = [Crashy(nats_server.url, instance_id=f"h-{i}") for i in range(3)]
    for s in services:
        await s.start()
    nc = await nats.connect(nats_server.url)
    try:
        inbox = nc.new_inbox()
        got: list[bytes] = []

        async def on_reply(msg) -> None:  # noqa: ANN001
            got.append(msg.data)

        await nc.subscribe(inbox, cb=on_reply)
        for payload in (b"x", b"[]", DEEP_OBJECT, b'{"type":"health_reply"}'):
            await nc.publish(S.health, payload, reply=inbox)
        await nc.flush()
        await asyncio.sleep(0.3)
        assert got == []
        assert all(s.metrics.error_counts.get("health_request") == 4 for s in services)
        await nc.publish(S.health, proto.encode(HealthRequest(ts_s=time.time())), reply=inbox)
        await asyncio.sleep(0.3)
        assert sorted(proto.decode_as(d, HealthReply).instance_id for d in got) == ["h-0", "h-1", "h-2"]
    finally:
        await nc.close()
        for s in services:
            await s.stop()
