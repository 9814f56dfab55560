"""Bus security against a real nats-server loading the generated config (`bus_secrets.generate`).

The expected grants below are written from the design (DESIGN.md principle 7, issue 14), not read from
`services/runtime/auth.py`, so a table that grants too much or too little fails here. Every probe is sent to the
server and judged by what the server answers: a "Permissions Violation" naming the subject, or silence.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats
import pytest
from nats.errors import NoServersError

import proto
from proto import PolicyVersionUpdate, RoleSwitchCommand
from services.runtime.bus import connect, ensure_streams
from services.runtime.bus_secrets import BusSecrets, generate
from services.runtime.credentials import BusCredentials
from services.runtime.nats_server import EmbeddedNatsServer
from tests.engine_agent_support import make_agent

pytestmark = pytest.mark.timeout(120)

USERS = ("trainer", "engine", "engine-0", "tracker", "forecaster", "allocator", "operator")
ENGINES = ("engine", "engine-0")
SERVICES = ("engine", "engine-0", "tracker", "forecaster", "allocator")
EVERYONE = USERS
NOBODY: tuple[str, ...] = ()

# subject → the users that may publish to it.
PUBLISH: dict[str, tuple[str, ...]] = {
    "prorsa.lifecycle": ("trainer",),
    "prorsa.events.engine-0": ENGINES,
    "prorsa.events.engine-1": ("engine",),
    "prorsa.work.prefill.any": ("trainer", *ENGINES),
    "prorsa.work.prefill.engine.engine-0": ("trainer",),
    "prorsa.work.decode.any": ENGINES,
    "prorsa.work.decode.engine.engine-0": NOBODY,
    "prorsa.stats.engine-0": ENGINES,
    "prorsa.stats.engine-1": ("engine",),
    "prorsa.cmd.engine-0": ("allocator",),
    "prorsa.cmd.engine-1": ("allocator",),
    "prorsa.ack.engine-0": ENGINES,
    "prorsa.ack.engine-1": ("engine",),
    "prorsa.tracker.snapshot": ("tracker",),
    "prorsa.forecast": ("forecaster",),
    "prorsa.allocator.plan": ("allocator",),
    "prorsa.policy.version": ("trainer", "operator"),
    "prorsa.health": ("trainer", "operator"),
    "prorsa.errors": EVERYONE,
    "prorsa.reply.client-1.0": ENGINES,
    "prorsa.unknown": NOBODY,
    "other.lifecycle": NOBODY,
    "$JS.API.STREAM.INFO.PRORSA_WORK": EVERYONE,
    "$JS.API.STREAM.CREATE.PRORSA_WORK": EVERYONE,
    "$JS.API.STREAM.CREATE.HOSTILE": NOBODY,
    "$JS.API.STREAM.UPDATE.PRORSA_WORK": ("operator",),
    "$JS.API.STREAM.UPDATE.PRORSA_EVENTS": ("operator",),
    "$JS.API.STREAM.DELETE.PRORSA_WORK": NOBODY,
    "$JS.API.STREAM.PURGE.PRORSA_EVENTS": NOBODY,
    "$JS.API.STREAM.MSG.DELETE.PRORSA_WORK": NOBODY,
    "$JS.API.CONSUMER.CREATE.PRORSA_WORK.x.prorsa.work.prefill.any": ENGINES,
    "$JS.API.CONSUMER.CREATE.PRORSA_WORK.x.prorsa.work.prefill.engine.engine-0": ENGINES,
    "$JS.API.CONSUMER.CREATE.PRORSA_WORK.x.prorsa.work.prefill.engine.engine-1": ("engine",),
    "$JS.API.CONSUMER.CREATE.PRORSA_WORK.x.prorsa.work.decode.any": ENGINES,
    # Decode handoffs are never addressed to one engine: nobody may create a consumer for such a subject.
    "$JS.API.CONSUMER.CREATE.PRORSA_WORK.x.prorsa.work.decode.engine.engine-0": NOBODY,
    "$JS.API.CONSUMER.CREATE.PRORSA_WORK.x.prorsa.work.>": NOBODY,
    "$JS.API.CONSUMER.CREATE.PRORSA_EVENTS.x": ("tracker",),
    "$JS.API.CONSUMER.MSG.NEXT.PRORSA_WORK.prefill-any": ENGINES,
    "$JS.API.CONSUMER.MSG.NEXT.PRORSA_EVENTS.x": ("tracker",),
    "$JS.API.CONSUMER.DELETE.PRORSA_WORK.prefill-any": NOBODY,
    "$JS.API.CONSUMER.INFO.PRORSA_WORK.prefill-any": ("operator", *ENGINES),
    "$JS.ACK.PRORSA_WORK.prefill-any.1.1.1.1.1": ENGINES,
    "$JS.ACK.PRORSA_EVENTS.x.1.1.1.1.1": ("tracker",),
    # The tracker's checkpoints (an object store): the tracker's alone; nobody else reads or forges them.
    "$O.PRORSA_TRACKER.C.x": ("tracker",),
    "$O.PRORSA_TRACKER.M.x": ("tracker",),
    "$O.OTHER.M.x": NOBODY,
    "$JS.API.STREAM.INFO.OBJ_PRORSA_TRACKER": ("tracker", "operator"),
    "$JS.API.STREAM.CREATE.OBJ_PRORSA_TRACKER": ("tracker",),
    "$JS.API.STREAM.PURGE.OBJ_PRORSA_TRACKER": ("tracker",),
    "$JS.API.STREAM.MSG.GET.OBJ_PRORSA_TRACKER": ("tracker",),
    "$JS.API.STREAM.DELETE.OBJ_PRORSA_TRACKER": NOBODY,
    "$JS.API.STREAM.NAMES": ("tracker", "operator"),
    "$JS.API.CONSUMER.CREATE.OBJ_PRORSA_TRACKER": ("tracker",),
    "$JS.API.CONSUMER.DELETE.OBJ_PRORSA_TRACKER.x": ("tracker",),
    "$JS.FC.OBJ_PRORSA_TRACKER.x": ("tracker",),
    "_INBOX.allocator.x": NOBODY,  # nobody writes into another's inbox (replies go by allow_responses)
    # The policy bucket (issue 31): trainers and the operator write the current version and the pause flag, engines
    # only read and watch them; nobody else touches it, nobody purges it or writes another key.
    "$KV.PRORSA_POLICY.current": ("trainer", "operator"),
    "$KV.PRORSA_POLICY.paused": ("trainer", "operator"),
    "$KV.PRORSA_POLICY.transfer": ("trainer", "operator"),
    "$KV.PRORSA_POLICY.other": NOBODY,
    "$JS.API.DIRECT.GET.KV_PRORSA_POLICY.$KV.PRORSA_POLICY.current": ("trainer", *ENGINES, "operator"),
    "$JS.API.STREAM.INFO.KV_PRORSA_POLICY": EVERYONE,
    "$JS.API.STREAM.CREATE.KV_PRORSA_POLICY": EVERYONE,
    "$JS.API.STREAM.UPDATE.KV_PRORSA_POLICY": ("operator",),
    "$JS.API.STREAM.PURGE.KV_PRORSA_POLICY": NOBODY,
    "$JS.API.STREAM.DELETE.KV_PRORSA_POLICY": NOBODY,
    "$JS.API.CONSUMER.CREATE.KV_PRORSA_POLICY": ENGINES,
    "prorsa.policy.status.engine-0": ENGINES,
    "prorsa.policy.status.engine-1": ("engine",),
}

# subject → the users that may subscribe to it.
SUBSCRIBE: dict[str, tuple[str, ...]] = {
    "prorsa.lifecycle": ("trainer", "forecaster", "allocator", "operator"),
    "prorsa.events.engine-0": ("forecaster", "allocator", "operator"),
    "prorsa.work.prefill.any": ("operator",),
    "prorsa.stats.engine-0": ("trainer", *ENGINES, "allocator", "operator"),
    "prorsa.cmd.engine-0": (*ENGINES, "operator"),
    "prorsa.cmd.engine-1": ("engine", "operator"),
    "prorsa.ack.engine-0": ("trainer", "allocator", "operator"),
    "prorsa.tracker.snapshot": (
        "forecaster",
        "operator",
    ),  # not the allocator: demand reaches it in the forecast
    "prorsa.forecast": ("trainer", "allocator", "operator"),
    "prorsa.allocator.plan": ("trainer", "operator"),
    "prorsa.policy.version": (*ENGINES, "operator"),
    "prorsa.policy.status.engine-0": ("trainer", "operator"),
    "prorsa.health": (*SERVICES, "operator"),
    "prorsa.errors": ("trainer", "operator"),
    "prorsa.reply.client-1.0": ("trainer", "operator"),
    ">": NOBODY,
    "prorsa.>": ("operator",),
    "_INBOX.>": NOBODY,
    "$JS.API.>": NOBODY,
    "$JS.ACK.>": NOBODY,
    **{f"_INBOX.{u}.x": (u,) for u in USERS},
}


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EmbeddedNatsServer, BusSecrets]]:
    secrets = generate(tmp_path_factory.mktemp("bus") / "secrets", engine_ids=("engine-0",))
    with EmbeddedNatsServer(config_file=str(secrets.server_config)) as srv:
        yield srv, secrets


class Violations:
    """The server's permission errors on one connection, by subject."""

    def __init__(self) -> None:
        self.publish: set[str] = set()
        self.subscribe: set[str] = set()

    async def on_error(self, exc: Exception) -> None:
        text = str(exc)
        if "permissions violation" not in text.lower():
            return
        subject = text.split('"')[1]  # nats.py lower-cases the server's error text
        (self.subscribe if "subscription" in text.lower() else self.publish).add(subject)


async def connect_as(
    srv: EmbeddedNatsServer, secrets: BusSecrets, user: str, errors: Violations | None = None
):
    opts = {"error_cb": errors.on_error} if errors is not None else {}
    return await connect(srv.url, f"test-{user}", credentials=secrets.credentials(user), **opts)


async def wait_for(cond, timeout_s: float = 5.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def test_anonymous_and_unknown_clients_are_refused(secure) -> None:
    srv, secrets = secure
    with pytest.raises((NoServersError, nats.errors.Error)):
        await nats.connect(srv.url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2)
    stranger = generate(Path(secrets.path).parent / "stranger")  # valid nkeys the server never heard of
    with pytest.raises((NoServersError, nats.errors.Error)):
        await nats.connect(
            srv.url,
            allow_reconnect=False,
            max_reconnect_attempts=0,
            connect_timeout=2,
            **stranger.credentials("operator").connect_options(),
        )


@pytest.mark.parametrize("user", USERS)
async def test_each_role_is_refused_every_subject_it_has_no_business_with(secure, user: str) -> None:
    srv, secrets = secure
    errors = Violations()
    nc = await connect_as(srv, secrets, user, errors)
    try:
        for subject in PUBLISH:
            await nc.publish(subject, b"{}")
        for subject in SUBSCRIBE:
            await nc.subscribe(subject)
        await nc.flush()
        await asyncio.sleep(0.2)  # the server's -ERRs for the last probes
        want_pub = {s.lower() for s, who in PUBLISH.items() if user not in who}
        want_sub = {s.lower() for s, who in SUBSCRIBE.items() if user not in who}
        assert errors.publish == want_pub, (
            f"{user}: refused but allowed {sorted(errors.publish - want_pub)}; "
            f"allowed but forbidden {sorted(want_pub - errors.publish)}"
        )
        assert errors.subscribe == want_sub, (
            f"{user}: refused but allowed {sorted(errors.subscribe - want_sub)}; "
            f"allowed but forbidden {sorted(want_sub - errors.subscribe)}"
        )
    finally:
        await nc.close()


async def test_only_the_tracker_keeps_checkpoints(secure) -> None:
    """The tracker's grants are enough for nats.py's object store (create, write, read back) and nobody else's are."""
    from services.trajectory_tracker.checkpoint_store import CheckpointStore

    srv, secrets = secure
    tracker = await connect_as(srv, secrets, "tracker", errors := Violations())
    try:
        await ensure_streams(tracker.jetstream(), proto.Subjects())
        store = CheckpointStore(tracker.jetstream(), proto.Subjects().tracker_checkpoint_bucket)
        await store.open()
        data = bytes(range(256)) * 1200  # 300 kB: three chunks
        await store.save(data)
        await store.save(data[::-1])  # a replacement purges the old chunks
        assert await store.load() == data[::-1]
        assert not errors.publish and not errors.subscribe
    finally:
        await tracker.close()
    for user in ("trainer", "engine-0", "forecaster", "allocator"):
        nc = await connect_as(srv, secrets, user, Violations())
        try:
            other = CheckpointStore(nc.jetstream(timeout=1.0), proto.Subjects().tracker_checkpoint_bucket)
            with pytest.raises(nats.errors.Error):
                await other.open()
                await other.save(b"forged")
        finally:
            await nc.close()


async def test_a_refused_publish_reaches_nobody(secure) -> None:
    """The violation is not just reported: the message is dropped, so an engine never sees a forged command."""
    srv, secrets = secure
    operator = await connect_as(srv, secrets, "operator")
    seen: list[str] = []

    async def cb(msg) -> None:  # noqa: ANN001
        seen.append(msg.subject)

    await operator.subscribe("prorsa.>", cb=cb)
    await operator.flush()
    cmd = RoleSwitchCommand(engine_id="engine-0", role="decode", epoch=1000, issued_s=time.time())
    for user in ("trainer", "engine", "engine-0", "tracker", "forecaster"):
        nc = await connect_as(srv, secrets, user, Violations())
        await nc.publish("prorsa.cmd.engine-0", proto.encode(cmd))
        await nc.flush()
        await nc.close()
    allocator = await connect_as(srv, secrets, "allocator")
    await allocator.publish("prorsa.cmd.engine-0", proto.encode(cmd))
    await allocator.flush()
    await wait_for(lambda: seen)
    await asyncio.sleep(0.1)
    assert seen == ["prorsa.cmd.engine-0"]  # the allocator's only
    await allocator.close()
    await operator.close()


@pytest.fixture
async def secure_engine(secure, monkeypatch) -> AsyncIterator:
    """engine-0 on its own credentials, the streams made by the operator, plus the attackers' connections."""
    monkeypatch.setenv("PRORSA_TIME_SCALE", "20")
    srv, secrets = secure
    op = await connect_as(srv, secrets, "operator")
    await ensure_streams(op.jetstream(), proto.Subjects())
    agent = make_agent(srv.url, "engine-0", "mixed", weights_root=str(secrets.path / "weights"))
    agent.credentials = secrets.credentials("engine-0")
    await agent.start()
    try:
        yield srv, secrets, agent
    finally:
        await agent.stop()
        await op.close()


async def test_the_anonymous_attacks_of_issue_14_fail(secure_engine) -> None:
    srv, secrets, agent = secure_engine
    # 1. Role switches from anyone but the allocator: refused by the server, the engine never moves.
    for user in ("trainer", "engine", "operator"):
        errors = Violations()
        nc = await connect_as(srv, secrets, user, errors)
        for epoch in (1000, 2**64 - 1):
            raw = proto.encode(
                RoleSwitchCommand(engine_id="engine-0", role="decode", epoch=1000, issued_s=0.0)
            )
            raw = raw.replace(b'"epoch":1000', b'"epoch":%d' % epoch)
            await nc.publish("prorsa.cmd.engine-0", raw)
        await nc.flush()
        await wait_for(lambda errors=errors: "prorsa.cmd.engine-0" in errors.publish)
        await nc.close()
    # 2. Hostile weights from a trainer credential (allowed to announce weights): refused by the engine,
    #    counted and answered, and a legitimate version 1 is still taken afterwards.
    trainer = await connect_as(srv, secrets, "trainer")
    errors_seen: list[proto.ErrorReply] = []

    async def on_error(msg) -> None:  # noqa: ANN001
        errors_seen.append(proto.decode_as(msg.data, proto.ErrorReply, msg.subject))

    await trainer.subscribe("prorsa.errors", cb=on_error)
    hostile = [
        b'{"type":"policy_version_update","schema_version":2,"version":%d,"ts_s":0.0,'
        b'"weights_path":"/etc/hostile-weights"}' % 2**63,
        proto.encode(PolicyVersionUpdate(version=7, ts_s=0.0, weights_path="/etc/hostile-weights")),
        proto.encode(PolicyVersionUpdate(version=8, ts_s=0.0, weights_path="../../etc/passwd")),
        proto.encode(PolicyVersionUpdate(version=2_000_000, ts_s=0.0)),
    ]
    for raw in hostile:
        await trainer.publish("prorsa.policy.version", raw)
    await trainer.flush()
    await wait_for(lambda: len(errors_seen) == len(hostile))
    kinds = sorted(e.kind for e in errors_seen)
    assert kinds == ["decode", "version_jump", "weights_path", "weights_path"], errors_seen
    assert [e.field for e in errors_seen if e.kind == "decode"] == ["version"]
    assert agent.policy_version == 0
    counts = agent.metrics.error_counts
    assert counts["decode"] == 1 and counts["weights_path"] == 2 and counts["version_jump"] == 1
    await trainer.publish("prorsa.policy.version", proto.encode(PolicyVersionUpdate(version=1, ts_s=0.0)))
    await wait_for(lambda: agent.policy_version == 1)
    await trainer.close()
    assert agent.role == "mixed" and agent.role_state.newest_epoch == 0


async def test_even_the_allocator_cannot_send_an_absurd_epoch(secure_engine) -> None:
    srv, secrets, agent = secure_engine
    allocator = await connect_as(srv, secrets, "allocator")

    async def ask(epoch: int) -> proto.Message:
        raw = proto.encode(RoleSwitchCommand(engine_id="engine-0", role="decode", epoch=1, issued_s=0.0))
        raw = raw.replace(b'"epoch":1', b'"epoch":%d' % epoch)
        reply = await allocator.request("prorsa.cmd.engine-0", raw, timeout=5)
        return proto.decode(reply.data, reply.subject)

    too_big = await ask(2**64 - 1)
    assert isinstance(too_big, proto.ErrorReply) and too_big.field == "epoch"
    jump = await ask(2**33)
    assert isinstance(jump, proto.ErrorReply) and jump.kind == "epoch_jump"
    ok = await ask(1)
    assert isinstance(ok, proto.RoleSwitchAck) and ok.ok and ok.role == "decode"
    assert agent.role_state.newest_epoch == 1
    assert agent.metrics.error_counts["epoch_jump"] == 1
    await allocator.close()


async def test_credentials_come_from_the_environment(secure, monkeypatch) -> None:
    srv, secrets = secure
    for var, value in secrets.credentials("trainer").to_env().items():
        monkeypatch.setenv(var, value)
    nc = await connect(srv.url, "env-trainer")  # no credentials given: PRORSA_NATS_* are used
    ack = await nc.jetstream().publish("prorsa.lifecycle", b"{}")
    assert ack.stream == "PRORSA_EVENTS"
    await nc.close()
    env_file = (secrets.path / "trainer.env").read_text()
    assert "PRORSA_NATS_NKEY=" in env_file and "_INBOX.trainer" in env_file
    seed = (secrets.path / "trainer.nk").read_text().strip()
    assert (
        seed.startswith("SU")
        and seed not in env_file
        and seed not in (secrets.path / "auth.conf").read_text()
    )
    for f in secrets.path.iterdir():
        assert f.stat().st_mode & 0o077 == 0, f
    assert secrets.path.stat().st_mode & 0o077 == 0


def test_an_empty_environment_is_anonymous() -> None:
    assert BusCredentials.from_env({}).anonymous
    assert BusCredentials.from_env({}).connect_options() == {}


async def test_weights_go_through_the_policy_bucket_and_only_trainers_write_it(secure_engine) -> None:
    """Issue 31: the trainer's credentials are enough for `update_weights` and `pause`/`resume` (write the bucket,
    read the engines' statuses), the engine's for loading the current version and watching (read only); every other
    role is refused the bucket by the server, and a forged version from one never reaches an engine."""
    from prorsa.client.client import RolloutClient

    srv, secrets, agent = secure_engine
    client = await RolloutClient.connect(srv.url, secrets.credentials("trainer"))
    try:
        ack = await client.update_weights(1, timeout_s=20)
        assert ack.engines == {"engine-0": 1} and agent.policy_version == 1
        assert await client.pause(timeout_s=10) == ["engine-0"] and agent.weights.state.paused
        assert await client.resume(timeout_s=10) == ["engine-0"] and not agent.weights.state.paused
    finally:
        await client.close()
    forged = proto.encode(PolicyVersionUpdate(version=999, ts_s=0.0))
    for user in ("engine-0", "engine", "forecaster", "allocator", "tracker"):
        nc = await connect_as(srv, secrets, user, errors := Violations())
        try:
            with pytest.raises(nats.errors.Error):
                await nc.jetstream(timeout=1.0).publish("$KV.PRORSA_POLICY.current", forged)
            await wait_for(lambda errors=errors: "$kv.prorsa_policy.current" in errors.publish)
        finally:
            await nc.close()
    engine = await connect_as(srv, secrets, "engine-0")
    try:  # an engine reads the current version (what it loads at start)
        entry = await (await engine.jetstream().key_value("PRORSA_POLICY")).get("current")
        assert proto.decode_as(entry.value, PolicyVersionUpdate).version == 1
    finally:
        await engine.close()
    await asyncio.sleep(0.3)
    assert agent.policy_version == 1 and agent.weights.state.newest == 1
