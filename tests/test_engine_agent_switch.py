"""The role-switch protocol against a real nats-server: epoch fencing over request/reply, and switches (and a
graceful stop) with requests in flight that lose and duplicate nothing — in place between equal layouts (nothing
drains; only a switch to prefill moves its decodes, through its own prefix cache: `switch_rule.py`), and as a drain
and restart where the new role's layout differs (`RESTART`: engines whose every role has a layout of its own)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import proto
from proto import (
    EngineStats,
    ErrorReply,
    PrefillDone,
    RoleSwitchAck,
    RoleSwitchCommand,
    Subjects,
)
from tests.engine_agent_support import (
    Watcher,
    make_agent,
    publish_work,
    request,
    wait_until,
    wait_work_queue_empty,
)

S = Subjects()
RESTART = ("prefill", "decode", "mixed")  # restart_roles of an engine whose every switch restarts it


def command(engine_id: str, role: str, epoch: int, drain_timeout_s: float = 5.0) -> RoleSwitchCommand:
    return RoleSwitchCommand(
        engine_id=engine_id, role=role, epoch=epoch, issued_s=time.time(), drain_timeout_s=drain_timeout_s
    )  # type: ignore[arg-type]


async def send(nc: Any, engine_id: str, cmd: RoleSwitchCommand, timeout_s: float = 10.0) -> proto.Message:
    reply = await nc.request(S.engine_command(engine_id), proto.encode(cmd), timeout=timeout_s)
    return proto.decode(reply.data, reply.subject)


async def test_epochs_fence_stale_and_duplicate_commands(nats_server, nc) -> None:
    observed: list[RoleSwitchAck] = []

    async def on_ack(msg: Any) -> None:
        observed.append(proto.decode_as(msg.data, RoleSwitchAck))

    await nc.subscribe(S.engine_ack("sw-0"), cb=on_ack)
    agent = make_agent(nats_server.url, "sw-0", "mixed")
    await agent.start()
    try:
        first = await send(nc, "sw-0", command("sw-0", "prefill", 5))
        assert isinstance(first, RoleSwitchAck)
        assert (first.ok, first.role, first.epoch) == (True, "prefill", 5)
        assert first.switch_s >= 2.0 / 20  # the profile's reconfiguration cost at speedup 20
        assert agent.role == "prefill"
        again = await send(nc, "sw-0", command("sw-0", "decode", 5))  # duplicate epoch: same answer
        assert again == first and agent.role == "prefill"
        stale = await send(nc, "sw-0", command("sw-0", "decode", 4))
        assert isinstance(stale, RoleSwitchAck)
        assert not stale.ok and stale.error.startswith("stale_command") and stale.role == "prefill"
        wrong = await send(nc, "sw-0", command("sw-9", "decode", 6))
        assert isinstance(wrong, ErrorReply) and wrong.kind == "wrong_engine"
        assert (
            agent.role_state.newest_epoch == 5
        )  # neither stale, duplicate nor misaddressed commands moved it
        stats = agent.stats_snapshot()
        assert (stats.role, stats.epoch, stats.switching) == ("prefill", 5, False)
        assert stats.last_switch_s == first.switch_s
        await wait_until(lambda: len(observed) >= 3)
        assert observed[0] == first  # acks are also published for observers
        back = await send(nc, "sw-0", command("sw-0", "mixed", 9))
        assert isinstance(back, RoleSwitchAck) and back.ok and agent.role == "mixed"
    finally:
        await agent.stop()


def prefills_of(watcher: Watcher, rids: list[str]) -> dict[str, list[PrefillDone]]:
    out: dict[str, list[PrefillDone]] = {r: [] for r in rids}
    for e in watcher.of(PrefillDone):
        if e.request_id in out:
            out[e.request_id].append(e)
    return out


async def test_a_decode_engine_switching_in_place_to_prefill_hands_its_decodes_on_through_its_own_cache(
    nats_server, nc
) -> None:
    """Equal layouts: the switch is in place, and nothing drains. A prefill engine would carry its running decodes
    one token per prefill step, so each answer being decoded that will not end within the drain bound is stopped
    and addressed back to the switching engine (`switch_rule.hands_on_decodes`), which prefills it from its own
    prefix cache once it serves as prefill and hands it to a decode engine: every stream exact, one move each, its
    context computed again only for the last token. New prompts addressed to it are prefilled there and decoded
    elsewhere."""
    watcher = Watcher()
    await watcher.attach(nc)
    prefill = make_agent(nats_server.url, "ip-p", "prefill")
    switcher = make_agent(nats_server.url, "ip-d", "decode")
    await prefill.start()
    await switcher.start()
    other = make_agent(nats_server.url, "ip-d2", "decode")
    try:
        rids = [f"ip{i}" for i in range(4)]
        for rid in rids:
            await publish_work(nc, S.prefill_work_any, request(rid, max_tokens=3000))
        await wait_until(lambda: all(watcher.tokens_streamed(r) >= 30 for r in rids))
        await other.start()  # where the decodes go: the switcher will no longer pull handoffs
        ack = await send(nc, "ip-d", command("ip-d", "prefill", 1, drain_timeout_s=0.05))
        assert isinstance(ack, RoleSwitchAck) and ack.ok
        assert (ack.migrated_requests, ack.drained_requests) == (4, 0)  # none ends within the drain bound
        assert switcher.role == "prefill"
        late = [f"ipl{i}" for i in range(2)]
        for rid in late:
            await publish_work(nc, S.prefill_work_for("ip-d"), request(rid, max_tokens=20))
        await watcher.wait_finished(rids + late)
        for rid in rids:
            engines = [
                c.engine_id for c in watcher.assert_exact_stream(rid, 3000)
            ]  # nothing lost or repeated
            assert engines[0] == "ip-d" and engines[-1] == "ip-d2"
            assert engines == sorted(engines, key=lambda e: e != "ip-d")  # one move, never back
        for rid in late:
            final = watcher.assert_exact_stream(rid, 20)[-1]
            assert (final.prefill_engine, final.engine_id) == ("ip-d", "ip-d2")
        prefills = prefills_of(watcher, rids)
        for rid in rids:
            first, again = prefills[rid]
            assert first.engine_id == "ip-p" and again.engine_id == "ip-d"
            # Its prompt and the tokens it streamed were cached where it decoded: only the last one is computed.
            assert again.new_tokens == 1 and again.cached_tokens >= first.new_tokens + 30
        await wait_work_queue_empty(nc)
    finally:
        for a in (prefill, switcher, other):
            await a.stop()


async def test_a_mixed_engine_switching_in_place_to_decode_finishes_everything_it_holds(
    nats_server, nc
) -> None:
    """Prompts it pulled but has not prefilled yet, prefilled or not, finish here (prefill and decode: one
    generate call each); prompts addressed to it after the switch go to the shared queue for a prefill engine,
    and their decodes come back to it, now a decode engine."""
    watcher = Watcher()
    await watcher.attach(nc)
    # Room for the four prompts at once: ~22 modelled s of prefill (1.1 s wall at 20×) the switch lands inside.
    switcher = make_agent(nats_server.url, "im-x", "mixed", prefill_budget_tokens=500_000)
    await switcher.start()
    prefill = make_agent(nats_server.url, "im-p", "prefill")
    try:
        rids = [f"im{i}" for i in range(4)]
        for rid in rids:
            await publish_work(
                nc, S.prefill_work_for("im-x"), request(rid, max_tokens=30, prompt_len=100_000)
            )
        await wait_until(lambda: len(switcher.runner.jobs) == 4)
        assert not any(j.prefilled for j in switcher.runner.jobs.values())
        ack = await send(nc, "im-x", command("im-x", "decode", 1, drain_timeout_s=0.01))
        assert isinstance(ack, RoleSwitchAck) and ack.ok
        assert (ack.migrated_requests, ack.drained_requests) == (0, 0) and len(switcher.runner.jobs) == 4
        await prefill.start()
        late = [f"iml{i}" for i in range(2)]
        for rid in late:  # a client that read its stats before the switch
            await publish_work(nc, S.prefill_work_for("im-x"), request(rid, max_tokens=30))
        await watcher.wait_finished(rids + late, timeout_s=30.0)
        for rid in rids:
            chunks = watcher.assert_exact_stream(rid, 30)
            assert {(c.engine_id, c.prefill_engine) for c in chunks if c.finished} == {("im-x", "im-x")}
        for rid in late:
            final = watcher.assert_exact_stream(rid, 30)[-1]
            assert (final.prefill_engine, final.engine_id) == ("im-p", "im-x")
        assert all(len(p) == 1 for p in prefills_of(watcher, rids + late).values())
        await wait_work_queue_empty(nc)
    finally:
        for a in (switcher, prefill):
            await a.stop()


async def test_a_prefill_engine_switching_in_place_to_decode_finishes_its_prefill_and_hands_it_on(
    nats_server, nc
) -> None:
    """The prompt it is prefilling finishes and its KV is handed on, here decoded by the engine itself (now the
    only decode engine); the prompts waiting in its addressed queue move to the shared queue."""
    watcher = Watcher()
    await watcher.attach(nc)
    # One prompt at a time, so addressed work queues up behind it.
    switcher = make_agent(nats_server.url, "ix-x", "prefill", prefill_budget_tokens=1)
    await switcher.start()
    prefill = make_agent(nats_server.url, "ix-p", "prefill")
    try:
        rids = [f"ix{i}" for i in range(3)]
        for rid in rids:
            await publish_work(
                nc, S.prefill_work_for("ix-x"), request(rid, max_tokens=20, prompt_len=100_000)
            )
        await wait_until(lambda: len(switcher.runner.jobs) == 1)
        (first,) = switcher.runner.jobs
        ack = await send(nc, "ix-x", command("ix-x", "decode", 1, drain_timeout_s=0.01))
        assert isinstance(ack, RoleSwitchAck) and ack.ok
        assert (ack.migrated_requests, ack.drained_requests) == (0, 0)
        await prefill.start()
        await watcher.wait_finished(rids, timeout_s=30.0)
        prefills = prefills_of(watcher, rids)
        assert all(len(p) == 1 for p in prefills.values()), prefills  # nothing prefilled twice
        for rid in rids:
            final = watcher.assert_exact_stream(rid, 20)[-1]
            assert final.engine_id == "ix-x"  # the only decode engine
            assert final.prefill_engine == ("ix-x" if rid == first else "ix-p")
        await wait_work_queue_empty(nc)
    finally:
        for a in (switcher, prefill):
            await a.stop()


async def test_a_prompt_a_fetch_brings_after_an_in_place_switch_to_decode_goes_back_to_its_queue(
    nats_server, nc
) -> None:
    """An in-place switch does not wait for the long polls in flight: one that delivers a prompt after the engine
    became a decode engine gives it back at once (nak), and a prefill engine takes it."""
    watcher = Watcher()
    await watcher.attach(nc)
    switcher = make_agent(
        nats_server.url, "rb-x", "prefill", any_poll_s=3.0
    )  # its fetch of prompts waits long
    await switcher.start()
    prefill = make_agent(nats_server.url, "rb-p", "prefill")
    try:
        await asyncio.sleep(0.2)  # the switcher's long poll of the shared prompt queue is under way
        ack = await send(nc, "rb-x", command("rb-x", "decode", 1))
        assert (
            isinstance(ack, RoleSwitchAck) and ack.ok and ack.switch_s < 1.0
        )  # it did not wait for the poll
        await publish_work(nc, S.prefill_work_any, request("rb0", max_tokens=20))
        await wait_until(lambda: switcher.puller.returned == 1)
        assert not switcher.runner.jobs  # a decode engine runs no prompt
        await prefill.start()
        await watcher.wait_finished(["rb0"])
        final = watcher.assert_exact_stream("rb0", 20)[-1]
        assert (final.prefill_engine, final.engine_id) == ("rb-p", "rb-x")
        assert switcher.health_details()["returned_messages"] == 1
    finally:
        for a in (switcher, prefill):
            await a.stop()


async def test_a_restart_migrates_long_decodes_to_their_prefix_without_loss_or_duplicates(
    nats_server, nc
) -> None:
    """A decode engine restarting into prefill moves its long decodes on, each to the prefill engine that holds its
    prompt (it still takes prompts): re-prefilled there from its cache, decoded by another engine, exact."""
    watcher = Watcher()
    await watcher.attach(nc)
    prefill = make_agent(nats_server.url, "sw-p", "prefill")
    switcher = make_agent(nats_server.url, "sw-d", "decode", restart_roles=RESTART)
    await prefill.start()
    await switcher.start()
    later = make_agent(nats_server.url, "sw-d2", "decode")
    try:
        rids = [f"mig{i}" for i in range(4)]
        for rid in rids:
            await publish_work(nc, S.prefill_work_any, request(rid, max_tokens=1500))
        await wait_until(lambda: all(watcher.tokens_streamed(r) >= 30 for r in rids))
        await later.start()  # the decode engine that will take the migrated requests
        ack = await send(nc, "sw-d", command("sw-d", "prefill", 1, drain_timeout_s=0.05))
        assert isinstance(ack, RoleSwitchAck) and ack.ok
        assert (ack.migrated_requests, ack.drained_requests) == (4, 0)
        assert switcher.role == "prefill" and switcher.stats_snapshot().last_switch_s == ack.switch_s > 0
        await watcher.wait_finished(rids)
        for rid in rids:
            chunks = watcher.assert_exact_stream(rid, 1500)  # gap-free, nothing lost or repeated
            engines = [c.engine_id for c in chunks]
            assert engines[0] == "sw-d" and engines[-1] == "sw-d2"
            assert engines == sorted(engines, key=lambda e: e != "sw-d")  # one move, never back
        again = [e for e in watcher.of(PrefillDone) if e.request_id in rids and e.cached_tokens > 0]
        assert {e.engine_id for e in again} == {"sw-p"} and len(again) == 4  # back where the prompt is cached
    finally:
        for a in (prefill, switcher, later):
            await a.stop()


async def test_decodes_a_restart_expects_to_end_within_the_drain_timeout_finish_first(
    nats_server, nc
) -> None:
    watcher = Watcher()
    await watcher.attach(nc)
    prefill = make_agent(nats_server.url, "dr-p", "prefill")
    switcher = make_agent(nats_server.url, "dr-d", "decode", restart_roles=RESTART)
    await prefill.start()
    await switcher.start()
    try:
        rids = [f"dr{i}" for i in range(3)]
        for rid in rids:
            await publish_work(nc, S.prefill_work_any, request(rid, max_tokens=1000))
        await wait_until(lambda: all(watcher.tokens_streamed(r) >= 10 for r in rids))
        ack = await send(nc, "dr-d", command("dr-d", "prefill", 3, drain_timeout_s=30.0))
        assert isinstance(ack, RoleSwitchAck) and ack.ok
        assert (ack.migrated_requests, ack.drained_requests) == (0, 3)
        await watcher.wait_finished(rids)
        for rid in rids:
            chunks = watcher.assert_exact_stream(rid, 1000)
            assert {c.engine_id for c in chunks} == {"dr-d"}
    finally:
        await prefill.stop()
        await switcher.stop()


async def test_work_addressed_to_an_engine_restarting_out_of_prefill_moves_to_the_shared_queue(
    nats_server, nc
) -> None:
    watcher = Watcher()
    await watcher.attach(nc)
    # One prompt at a time, so addressed work queues up behind it.
    leaving = make_agent(nats_server.url, "fw-x", "prefill", prefill_budget_tokens=1, restart_roles=RESTART)
    decode = make_agent(nats_server.url, "fw-d", "decode")
    await leaving.start()
    await decode.start()
    other = make_agent(nats_server.url, "fw-p", "prefill")
    try:
        rids = [f"fw{i}" for i in range(5)]
        for rid in rids:
            await publish_work(
                nc, S.prefill_work_for("fw-x"), request(rid, max_tokens=20, prompt_len=100_000)
            )
        await wait_until(lambda: len(leaving.runner.jobs) == 1)
        await other.start()
        # A drain timeout with room to spare (3 s of wall time at 20×): the prompt in progress finishes here even
        # on a loaded machine, while the four queued behind it move to the shared queue for fw-p.
        ack = await send(nc, "fw-x", command("fw-x", "decode", 2, drain_timeout_s=60.0))
        assert isinstance(ack, RoleSwitchAck) and ack.ok and ack.drained_requests == 1
        await watcher.wait_finished(rids)
        for rid in rids:
            watcher.assert_exact_stream(rid, 20)
        assert {c.prefill_engine for r in rids for c in watcher.chunks[r] if c.finished} == {"fw-x", "fw-p"}
    finally:
        for a in (leaving, decode, other):
            await a.stop()


async def test_graceful_stop_hands_in_flight_decodes_to_another_engine(nats_server, nc) -> None:
    watcher = Watcher()
    await watcher.attach(nc)
    stats: list[EngineStats] = []

    async def on_stats(msg: Any) -> None:
        stats.append(proto.decode_as(msg.data, EngineStats))

    await nc.subscribe(S.engine_stats("gs-0"), cb=on_stats)
    first = make_agent(nats_server.url, "gs-0", "mixed")
    second = make_agent(nats_server.url, "gs-1", "mixed")
    await first.start()
    await second.start()
    try:
        rids = [f"gs{i}" for i in range(3)]
        for rid in rids:  # addressed to the first engine; the second takes them only once they are handed on
            await publish_work(nc, S.prefill_work_for("gs-0"), request(rid, max_tokens=1200))
        await wait_until(lambda: any(s.running == 3 for s in stats))
        await first.stop()
        await watcher.wait_finished(rids)
        for rid in rids:
            chunks = watcher.assert_exact_stream(rid, 1200)
            assert chunks[0].engine_id == "gs-0" and chunks[-1].engine_id == "gs-1"
    finally:
        await second.stop()


async def test_a_mixed_engine_restarting_as_decode_drains_its_unprefilled_prompts_to_idle(
    nats_server, nc
) -> None:
    """A restart drains to idle: prompts still queued on a mixed engine restarting as decode finish here (prefill
    and decode) within the drain timeout, or go back to the prefill queue untouched."""
    watcher = Watcher()
    await watcher.attach(nc)
    # Room for the four prompts at once: ~22 modelled s of prefill (1.1 s wall at 20×) the switch lands inside.
    switcher = make_agent(
        nats_server.url, "pf-x", "mixed", prefill_budget_tokens=500_000, restart_roles=("decode",)
    )
    await switcher.start()
    other = make_agent(nats_server.url, "pf-p", "prefill")

    async def queue_prompts(rids: list[str]) -> None:
        """Four long prompts addressed to the switcher, held there (none prefilled yet)."""
        for rid in rids:
            await publish_work(
                nc, S.prefill_work_for("pf-x"), request(rid, max_tokens=30, prompt_len=100_000)
            )
        await wait_until(lambda: len(switcher.runner.jobs) == 4)

    try:
        rids = [f"pf{i}" for i in range(4)]
        await queue_prompts(rids)
        assert not any(j.prefilled for j in switcher.runner.jobs.values())
        # Generous drain timeout: every prompt is prefilled and decoded here before the engine reconfigures.
        ack = await send(nc, "pf-x", command("pf-x", "decode", 1, drain_timeout_s=60.0), timeout_s=20.0)
        assert isinstance(ack, RoleSwitchAck) and ack.ok
        assert (ack.migrated_requests, ack.drained_requests) == (0, 4)
        assert not switcher.runner.jobs
        await watcher.wait_finished(rids)
        for rid in rids:
            chunks = watcher.assert_exact_stream(rid, 30)
            assert {c.engine_id for c in chunks} == {"pf-x"}

        # Back to mixed, then the same with no time to drain: every prompt goes back to the prefill queue
        # untouched, a prefill engine takes it and the (now decode) engine decodes the handoff.
        ack = await send(nc, "pf-x", command("pf-x", "mixed", 2))
        assert isinstance(ack, RoleSwitchAck) and ack.ok
        await other.start()
        late = [f"pl{i}" for i in range(4)]
        await queue_prompts(late)
        ack = await send(nc, "pf-x", command("pf-x", "decode", 3, drain_timeout_s=0.01), timeout_s=20.0)
        assert isinstance(ack, RoleSwitchAck) and ack.ok
        assert (ack.migrated_requests, ack.drained_requests) == (4, 0)
        await watcher.wait_finished(late)
        for rid in late:
            watcher.assert_exact_stream(rid, 30)
        assert {c.prefill_engine for r in late for c in watcher.chunks[r] if c.finished} == {"pf-p"}
    finally:
        for a in (switcher, other):
            await a.stop()


async def test_decodes_on_a_mixed_engine_restarting_as_decode_migrate_unless_they_end_within_the_drain(
    nats_server, nc
) -> None:
    """The new role would serve them, but its layout differs: the engine drains before it restarts (the
    simulator's engines run the same rule). Long decodes migrate — their prefix was on the restarting engine, so
    through the shared queue — are re-prefilled elsewhere, and their streams stay exact."""
    watcher = Watcher()
    await watcher.attach(nc)
    switcher = make_agent(nats_server.url, "md-x", "mixed", restart_roles=("decode",))
    await switcher.start()
    prefill = make_agent(nats_server.url, "md-p", "prefill")
    decode = make_agent(nats_server.url, "md-d", "decode")
    try:
        rids = [f"md{i}" for i in range(3)]
        for rid in rids:
            await publish_work(nc, S.prefill_work_for("md-x"), request(rid, max_tokens=1500))
        await wait_until(lambda: all(watcher.tokens_streamed(r) >= 30 for r in rids))
        await prefill.start()
        await decode.start()
        ack = await send(nc, "md-x", command("md-x", "decode", 1, drain_timeout_s=0.05))
        assert isinstance(ack, RoleSwitchAck) and ack.ok
        assert (ack.migrated_requests, ack.drained_requests) == (3, 0)
        assert switcher.role == "decode" and not switcher.runner.jobs
        await watcher.wait_finished(rids)
        for rid in rids:
            chunks = watcher.assert_exact_stream(rid, 1500)
            assert chunks[0].engine_id == "md-x"
            assert {c.prefill_engine for c in chunks if c.finished} == {"md-p"}  # re-prefilled after the move
    finally:
        for a in (switcher, prefill, decode):
            await a.stop()


async def test_a_prompt_addressed_to_a_decode_engine_moves_to_the_shared_queue(nats_server, nc) -> None:
    """A client that read an engine's stats just before it became a decode engine addresses a prompt to it after
    its switch forwarded its queue: the decode engine forwards it too, and a prefill engine serves it at once."""
    watcher = Watcher()
    await watcher.attach(nc)
    decode = make_agent(nats_server.url, "ad-d", "decode")
    prefill = make_agent(nats_server.url, "ad-p", "prefill")
    await decode.start()
    await prefill.start()
    try:
        rids = [f"ad{i}" for i in range(3)]
        for rid in rids:
            await publish_work(nc, S.prefill_work_for("ad-d"), request(rid, max_tokens=20))
        await watcher.wait_finished(rids)
        for rid in rids:
            chunks = watcher.assert_exact_stream(rid, 20)
            assert {c.prefill_engine for c in chunks if c.finished} == {"ad-p"}
            assert {c.engine_id for c in chunks} == {"ad-d"}  # decoded by the only decode engine
    finally:
        for a in (decode, prefill):
            await a.stop()


async def test_a_forward_that_cannot_store_waits_before_the_retry(nats_server, nc) -> None:
    """A decode engine that cannot store a forwarded prompt for a while (a stream publish timing out, as while a
    server restarts) leaves it in its own queue with a delay: the prompt is forwarded once the bus takes it, instead
    of spending its deliveries (`WORK_MAX_DELIVER`) in a tight loop, after which JetStream stops delivering it and
    the turn waits for the client's retry (`retry_after_s`)."""
    watcher = Watcher()
    await watcher.attach(nc)
    decode = make_agent(nats_server.url, "fd-d", "decode")
    prefill = make_agent(nats_server.url, "fd-p", "prefill")
    await decode.start()
    await prefill.start()
    real_publish = decode.js.publish
    failing_until = time.monotonic() + 1.5
    attempts = 0

    async def flaky_publish(subject: str, payload: bytes = b"", **kw: Any) -> Any:
        nonlocal attempts
        if subject == S.prefill_work_any and time.monotonic() < failing_until:
            attempts += 1
            raise TimeoutError("stream publish timed out")
        return await real_publish(subject, payload, **kw)

    decode.js.publish = flaky_publish
    try:
        await publish_work(nc, S.prefill_work_for("fd-d"), request("fd0", max_tokens=20))
        await watcher.wait_finished(["fd0"])
        watcher.assert_exact_stream("fd0", 20)
        assert 1 <= attempts <= 3  # one try a second at most while the bus refuses
    finally:
        for a in (decode, prefill):
            await a.stop()
