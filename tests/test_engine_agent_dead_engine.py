"""An engine that dies under its agent (the engine itself, not the agent process): the liveness probe finds it, the
agent reports `unhealthy` (details `engine: failed`), stops pulling, hands on what it held (exactly after what it
streamed) and stops with exit status 1, so its supervisor starts a fresh one; another engine finishes the work and
the client sees one gap-free stream. Also the start-up time-out. (vLLM's engine-core process killed under a live
agent: `tests/test_vllm_health.py`.)"""

from __future__ import annotations

import asyncio
import time

import pytest

import proto
from proto import HealthReply, HealthRequest, Subjects
from services.engine_agent.backend import BackendError
from services.engine_agent.backends.sim_backend import SimBackend
from tests.engine_agent_support import (
    PROFILE,
    Watcher,
    make_agent,
    publish_work,
    request,
    wait_until,
    wait_work_queue_empty,
)

S = Subjects()


async def _health(nc, engine_id: str) -> HealthReply:  # type: ignore[no-untyped-def]
    inbox = nc.new_inbox()
    replies: list[HealthReply] = []

    async def on_reply(m) -> None:  # type: ignore[no-untyped-def]
        replies.append(proto.decode_as(m.data, HealthReply))

    sub = await nc.subscribe(inbox, cb=on_reply)
    await nc.publish(S.health, proto.encode(HealthRequest(ts_s=time.time())), reply=inbox)
    await asyncio.sleep(0.3)
    await sub.unsubscribe()
    return next(r for r in replies if r.details.get("engine_id") == engine_id)


async def test_a_dead_engine_hands_on_its_work_and_the_agent_leaves(nats_server, nc) -> None:
    watcher = Watcher()
    await watcher.attach(nc)
    a = make_agent(nats_server.url, "dying-0", "mixed", speedup=2.0, liveness_interval_s=0.1)
    await a.start()
    b = None
    try:
        rid, n = "long-0", 400
        await publish_work(nc, S.prefill_work_any, request(rid, n, prompt_len=500, sim_output_tokens=n))
        await wait_until(lambda: watcher.tokens_streamed(rid) >= 20, timeout_s=20)
        b = make_agent(nats_server.url, "healthy-0", "mixed", speedup=50.0)
        await b.start()
        backend = a.backend
        assert isinstance(backend, SimBackend) and backend._task is not None
        backend._task.cancel()  # the engine dies; the agent process lives on
        await wait_until(lambda: a.engine_failure != "", timeout_s=5)
        health = await _health(nc, "dying-0")
        assert health.status in ("unhealthy", "stopping") and health.details["engine"] == "failed"
        await asyncio.wait_for(a._stop_event.wait(), 20)  # it leaves by itself
        assert a.exit_code == 1 and a.puller.paused
        await watcher.wait_finished([rid], timeout_s=30)
        watcher.assert_exact_stream(
            rid, n
        )  # nothing lost, nothing twice: resumed after the last streamed chunk
        await wait_work_queue_empty(nc)
    finally:
        await a.stop()
        if b is not None:
            await b.stop()


class NeverStarts(SimBackend):
    async def start(self) -> None:
        await asyncio.sleep(3600)


async def test_an_engine_that_does_not_start_in_time_fails_the_agent(nats_server) -> None:
    from services.engine_agent.agent import AgentConfig, EngineAgent

    agent = EngineAgent(
        nats_server.url,
        engine_id="slow-0",
        backend=NeverStarts(PROFILE, "slow-0", role="mixed", speedup=20.0),
        config=AgentConfig(start_timeout_s=0.3),
    )
    with pytest.raises(BackendError, match="did not start within"):
        await agent.start()
    await agent.stop()
