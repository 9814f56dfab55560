"""Hostile payloads on every subject an engine agent consumes never crash it: it still answers health, commands
and work afterwards."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nats.js.errors import NotFoundError

import proto
from proto import (
    DecodeHandoff,
    GenerateRequest,
    HealthReply,
    PolicyVersionUpdate,
    RoleSwitchAck,
    RoleSwitchCommand,
)
from proto.examples import EXAMPLES
from tests.engine_agent_support import Watcher, make_agent, publish_work, request

ENGINE = "hostile-0"
S = proto.Subjects()
JS_SUBJECTS = [S.prefill_work_any, S.prefill_work_for(ENGINE), S.decode_work_any]
# Decode handoffs are never addressed to one engine: no engine listens on (or creates a consumer for) this subject.
REMOVED_DECODE_ADDRESSED = f"{S.namespace}.work.decode.engine.{ENGINE}"
CORE_SUBJECTS = [S.engine_command(ENGINE), S.policy_version]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
targets = [GenerateRequest, DecodeHandoff, RoleSwitchCommand, PolicyVersionUpdate]


@st.composite
def mutated(draw: Any) -> bytes:
    """A valid example of a consumed message with one field replaced by an arbitrary JSON value."""
    body = msgspec.json.decode(proto.encode(EXAMPLES[draw(st.sampled_from(targets))]))
    key = draw(st.sampled_from(sorted(body)))
    body[key] = draw(json_values)
    return msgspec.json.encode(body)


@st.composite
def odd_requests(draw: Any) -> bytes:
    """Well-formed requests with odd values: huge prompts and outputs, strange reply subjects, resumes."""
    req = GenerateRequest(
        request_id=draw(st.from_regex(r"[a-z0-9:_-]{1,12}", fullmatch=True)),
        traj_id="t",
        turn=draw(st.integers(0, 5)),
        prompt_token_ids=draw(st.lists(st.integers(-(2**31), 2**31), max_size=5)),
        prompt_len=draw(st.integers(0, 1500)),
        sampling=proto.SamplingParams(max_tokens=draw(st.integers(1, 10**6))),
        reply_to=draw(
            st.sampled_from(
                ["", " ", "a.*", "x.>", "$JS.API.STREAM.DELETE.PRORSA_WORK", "ok.reply", "ok.reply"]
            )
        ),
        sim_output_tokens=draw(st.integers(0, 10**6)),
        resume_token_ids=draw(st.lists(st.integers(0, 100), max_size=3)),
        next_chunk_index=draw(st.integers(0, 10)),
    )
    if draw(st.booleans()):
        handoff = DecodeHandoff(
            request=req,
            prefill_engine="p",
            first_token_id=draw(st.none() | st.integers(0, 10**6)),
            kv_transfer_params=draw(
                st.none() | st.dictionaries(st.text(max_size=12), json_values, max_size=2)
            ),
        )
        return proto.encode(handoff)
    return proto.encode(req)


@st.composite
def odd_commands(draw: Any) -> bytes:
    cmd = RoleSwitchCommand(
        engine_id=draw(st.sampled_from([ENGINE, "someone-else"])),
        role=draw(st.sampled_from(proto.ROLES)),
        epoch=draw(st.integers(1, 10**6)),
        issued_s=draw(st.floats(-1e12, 1e12)),
        drain_timeout_s=draw(st.floats(0, 1e6)),
    )  # type: ignore[arg-type]
    return proto.encode(cmd)


payloads = st.one_of(st.binary(max_size=200), mutated(), odd_requests(), odd_commands())


def draw_barrage(n: int) -> list[tuple[str, bytes]]:
    """`n` (subject, payload) pairs drawn by hypothesis."""
    out: list[tuple[str, bytes]] = []

    @settings(max_examples=n, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(subject=st.sampled_from(JS_SUBJECTS + CORE_SUBJECTS), payload=payloads)
    def collect(subject: str, payload: bytes) -> None:
        out.append((subject, payload))

    collect()
    return out


async def test_hostile_payloads_never_crash_the_agent(nats_server, nc) -> None:
    watcher = Watcher()
    await watcher.attach(nc)
    agent = make_agent(nats_server.url, ENGINE, "mixed", speedup=200.0, max_model_len=1024)
    await agent.start()
    try:
        assert set(JS_SUBJECTS + CORE_SUBJECTS) <= set(agent.consumed)
        assert REMOVED_DECODE_ADDRESSED not in agent.consumed
        js = nc.jetstream()
        with pytest.raises(NotFoundError):
            await js.consumer_info(S.work_stream, f"decode-{ENGINE}")
        barrage = draw_barrage(50)
        for subject, payload in barrage:
            if subject in JS_SUBJECTS:
                await js.publish(subject, payload)
            else:
                await nc.publish(subject, payload, reply=nc.new_inbox())
        # Still alive: it answers health, a command, and serves a request.
        reply = await nc.request(S.health, proto.encode(proto.HealthRequest(ts_s=time.time())), timeout=5)
        health = proto.decode_as(reply.data, HealthReply)
        assert health.instance_id == agent.instance_id and health.status == "ok"
        cmd = RoleSwitchCommand(
            engine_id=ENGINE, role="mixed", epoch=10**9, issued_s=time.time(), drain_timeout_s=0
        )
        ack = proto.decode_as(
            (await nc.request(S.engine_command(ENGINE), proto.encode(cmd), timeout=20)).data, RoleSwitchAck
        )
        assert ack.ok and agent.role == "mixed"
        await publish_work(nc, S.prefill_work_any, request("after-barrage", max_tokens=10, prompt_len=100))
        await watcher.wait_finished(["after-barrage"], timeout_s=20)
        watcher.assert_exact_stream("after-barrage", 10)
        assert "task" not in agent.metrics.error_counts and "handler" not in agent.metrics.error_counts
    finally:
        await agent.stop()
