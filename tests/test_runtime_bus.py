"""The shared runtime against a real nats-server: round trips, bad input, redelivery, reconnect, health."""

from __future__ import annotations

import asyncio
import time

import nats
import pytest
from nats.js.api import ConsumerConfig

import proto
from proto import ErrorReply, GenerateRequest, HealthReply, HealthRequest, Subjects
from proto.examples import EXAMPLES
from services.runtime.bus import MessageTooLarge, check_size, ensure_streams, max_payload_bytes
from services.runtime.nats_server import EmbeddedNatsServer
from services.runtime.service import Service


class EchoService(Service):
    """A minimal service: consumes `ns.test.in` and republishes what it decodes on `ns.test.out`."""

    name = "echo"

    async def setup(self) -> None:
        self.seen: list[proto.Message] = []

        async def handle(msg: proto.Message, raw: object) -> None:
            self.seen.append(msg)
            await self.publish("prorsa.test.out", msg)

        await self.subscribe("prorsa.test.in", handle)


async def test_every_message_round_trips_through_nats(nc) -> None:
    received: list[proto.Message] = []
    done = asyncio.Event()

    async def cb(msg) -> None:
        received.append(proto.decode(msg.data, msg.subject))
        if len(received) == len(EXAMPLES):
            done.set()

    await nc.subscribe("prorsa.test.rt", cb=cb)
    for m in EXAMPLES.values():
        await nc.publish("prorsa.test.rt", proto.encode(m))
    await asyncio.wait_for(done.wait(), 5)
    assert received == list(EXAMPLES.values())


async def test_bad_input_is_answered_counted_and_survived(nats_server: EmbeddedNatsServer) -> None:
    svc = EchoService(nats_server.url)
    await svc.start()
    nc = await nats.connect(nats_server.url)
    try:
        reply = await nc.request("prorsa.test.in", b"\x00not json", timeout=2)
        err = proto.decode_as(reply.data, ErrorReply)
        assert err.kind == "decode" and err.subject == "prorsa.test.in"
        bad_version = proto.encode(EXAMPLES[HealthRequest]).replace(
            b'"schema_version":2', b'"schema_version":9'
        )
        err = proto.decode_as((await nc.request("prorsa.test.in", bad_version, timeout=2)).data, ErrorReply)
        assert err.kind == "schema_version" and err.field == "schema_version"
        # A good message still flows after the bad ones.
        out = await nc.subscribe("prorsa.test.out")
        await nc.publish("prorsa.test.in", proto.encode(EXAMPLES[HealthRequest]))
        got = await out.next_msg(timeout=2)
        assert proto.decode(got.data) == EXAMPLES[HealthRequest]
        assert svc.metrics.error_counts == {"decode": 1, "schema_version": 1}
    finally:
        await nc.close()
        await svc.stop()


async def test_health_reply(nats_server: EmbeddedNatsServer) -> None:
    svc = EchoService(nats_server.url, instance_id="echo-1")
    await svc.start()
    try:
        from prorsa.health import gather_health

        replies = await gather_health(nats_server.url, wait_s=0.3)
        assert [(r.service, r.instance_id, r.status) for r in replies] == [("echo", "echo-1", "ok")]
        assert isinstance(replies[0], HealthReply)
    finally:
        await svc.stop()


async def test_unacked_work_is_redelivered_to_another_consumer(nc) -> None:
    subjects = Subjects()
    js = nc.jetstream()
    req = EXAMPLES[GenerateRequest]
    await js.publish(subjects.prefill_work_any, proto.encode(req))
    cfg = ConsumerConfig(ack_wait=1.0, filter_subject=subjects.prefill_work_any)
    first = await js.pull_subscribe(subjects.prefill_work_any, durable="prefill-any", config=cfg)
    msgs = await first.fetch(1, timeout=2)
    assert proto.decode(msgs[0].data) == req  # taken, never acked: the engine "died"
    await first.unsubscribe()
    second = await js.pull_subscribe(subjects.prefill_work_any, durable="prefill-any", config=cfg)
    t0 = time.monotonic()
    again = await second.fetch(1, timeout=5)
    assert proto.decode(again[0].data) == req
    assert again[0].metadata.num_delivered == 2
    await again[0].ack()
    assert time.monotonic() - t0 < 5


async def test_service_survives_server_restart(tmp_path) -> None:
    srv = EmbeddedNatsServer(store_dir=str(tmp_path / "js")).start()
    svc = EchoService(srv.url, instance_id="echo-r")
    await svc.start()
    try:
        srv.stop()
        await asyncio.sleep(0.5)
        srv.start()
        # The service's client reconnects on its own; it answers health and keeps echoing.
        from prorsa.health import gather_health

        for _ in range(40):
            replies = await gather_health(srv.url, wait_s=0.25)
            if replies:
                break
        assert [r.instance_id for r in replies] == ["echo-r"]
        nc = await nats.connect(srv.url)
        out = await nc.subscribe("prorsa.test.out")
        await nc.publish("prorsa.test.in", proto.encode(EXAMPLES[HealthRequest]))
        assert proto.decode((await out.next_msg(timeout=3)).data) == EXAMPLES[HealthRequest]
        # The JetStream streams survived on the same store.
        info = await nc.jetstream().stream_info(Subjects().work_stream)
        assert info.config.name == Subjects().work_stream
        await nc.close()
    finally:
        await svc.stop()
        srv.stop(remove_store=True)


async def test_streams_are_created_idempotently(nc) -> None:
    js = nc.jetstream()
    await ensure_streams(js, Subjects())
    await ensure_streams(js, Subjects())
    await ensure_streams(js, Subjects("other-cluster"))
    names = {s.config.name for s in await js.streams_info()}
    assert {
        "PRORSA_WORK",
        "PRORSA_EVENTS",
        "PRORSA_CONTEXT",
        "OTHER_CLUSTER_WORK",
        "OTHER_CLUSTER_CONTEXT",
    } <= names


@pytest.mark.parametrize("signal_name", ["SIGTERM"])
async def test_run_stops_gracefully_on_request(nats_server: EmbeddedNatsServer, signal_name: str) -> None:
    svc = EchoService(nats_server.url)
    task = asyncio.create_task(svc.run())
    await asyncio.sleep(0.5)
    svc.request_stop()
    await asyncio.wait_for(task, 10)
    assert svc.nc is not None and svc.nc.is_closed


async def test_the_payload_limit_is_a_setting_the_server_and_its_clients_share(monkeypatch) -> None:
    monkeypatch.setenv("PRORSA_MAX_PAYLOAD", str(4 << 20))
    assert max_payload_bytes() == 4 << 20
    with EmbeddedNatsServer() as srv:
        nc = await nats.connect(srv.url)
        try:
            assert nc.max_payload == 4 << 20  # what the server announces, and what clients check against
            with pytest.raises(MessageTooLarge, match="exceeds the server's max_payload of 4194304"):
                check_size("prorsa.work.prefill.any", b"x" * ((4 << 20) + 1), nc.max_payload)
        finally:
            await nc.close()
    for bad in ("lots", "1"):  # not a number; below 64 KiB
        monkeypatch.setenv("PRORSA_MAX_PAYLOAD", bad)
        with pytest.raises(ValueError, match="PRORSA_MAX_PAYLOAD"):
            max_payload_bytes()
