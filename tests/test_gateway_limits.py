"""The gateway's limits, each answered over HTTP with a JSON error and nothing left stuck: too many turns at once
(429 + Retry-After), work queues that refuse (429 + Retry-After once the admission timeout passes), a prompt past
the model's window (400), and a session idle past `--session-idle-s` closed (a late turn: 409). A real nats-server
and a gateway process; no engine, so turns stay queued."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from prorsa.gateway.launch import free_port
from services.runtime.nats_server import EmbeddedNatsServer
from tests.test_gateway_system import _wait_http

httpx = pytest.importorskip("httpx")
pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def gateway(nats_server: EmbeddedNatsServer) -> Iterator[str]:
    """A gateway with small limits (3 turns at once, a queue of 2, a window of 300 tokens, 1 s idle sessions)."""
    port = free_port()
    args = ["--nats", nats_server.url, "--port", str(port), "--max-concurrent-turns", "3"]
    args += ["--admission-timeout-s", "1", "--max-model-len", "300", "--session-idle-s", "1"]
    env = dict(os.environ, PRORSA_WORK_QUEUE_MAX="2")
    proc = subprocess.Popen([sys.executable, "-m", "prorsa.gateway", *args], env=env)
    try:
        _wait_http(f"http://127.0.0.1:{port}/health")
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_full_work_queue_and_too_many_turns_are_429_with_retry_after(gateway: str) -> None:
    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=30) as client:
            body = {"prompt": [1, 2, 3], "max_tokens": 4}
            queued = [asyncio.create_task(client.post(f"{gateway}/completions", json=body)) for _ in range(2)]
            await asyncio.sleep(1.0)  # both in the queue (no engine pulls): it is full
            refused = await client.post(f"{gateway}/completions", json=body)  # the queue refuses it for 1 s
            busy = asyncio.create_task(client.post(f"{gateway}/completions", json=body))
            await asyncio.sleep(0.3)
            over = await client.post(
                f"{gateway}/completions", json=body
            )  # a 4th turn at once: over the limit
            for t in [*queued, busy]:
                t.cancel()
            return [refused, over]

    refused, over = asyncio.run(main())
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "overloaded", refused.text
    assert over.status_code == 429 and over.json()["error"]["code"] == "too_many_requests", over.text
    assert refused.headers["retry-after"] and over.headers["retry-after"]


def test_a_prompt_past_the_window_is_400(gateway: str) -> None:
    r = httpx.post(f"{gateway}/completions", json={"prompt": list(range(400)), "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_an_idle_session_is_closed(gateway: str) -> None:
    r = httpx.post(f"{gateway}/trajectories/nobody/finish", json={})
    assert r.status_code == 404
    # A session opened by a turn that never completes (no engine) is busy, not idle: open one by hand instead,
    # with a turn refused before it is sent (past the window), which leaves the session open and idle.
    r = httpx.post(
        f"{gateway}/completions",
        json={"prompt": list(range(400)), "max_tokens": 4, "trajectory_id": "idle-1"},
    )
    assert r.status_code == 400
    time.sleep(2.5)  # idle past 1 s; the gateway sweeps every 0.25 s
    late = httpx.post(
        f"{gateway}/completions", json={"prompt": [1], "max_tokens": 1, "trajectory_id": "idle-1"}
    )
    assert late.status_code == 409 and late.json()["error"]["code"] == "session_finished", late.text


async def test_a_stopping_gateway_aborts_its_running_turns_on_their_engines(
    nats_server: EmbeddedNatsServer,
) -> None:
    """SIGTERM: the gateway aborts every running turn on its engine (which answers "abort" and acks it) before it
    stops, instead of leaving engines to decode for clients nobody will answer."""
    import proto
    from proto import RequestFinished, Subjects
    from tests.engine_agent_support import make_agent, wait_until

    agent = make_agent(nats_server.url, "mix-0", "mixed", speedup=1.0)
    await agent.start()
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "prorsa.gateway", "--nats", nats_server.url, "--port", str(port)]
    )
    finished: list[RequestFinished] = []

    async def on_event(msg) -> None:  # noqa: ANN001
        ev = proto.decode(msg.data, msg.subject)
        if isinstance(ev, RequestFinished):
            finished.append(ev)

    try:
        await asyncio.to_thread(_wait_http, f"http://127.0.0.1:{port}/health")
        sub = await agent.nc.subscribe(Subjects().all_engine_events, cb=on_event)
        body = {"prompt": list(range(1, 50)), "max_tokens": 20000, "stream": True}
        async with (
            httpx.AsyncClient(timeout=30) as client,
            client.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body) as r,
        ):
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    break  # the turn streams: stop the gateway under it
            proc.terminate()
            await asyncio.to_thread(proc.wait, 30)
        await wait_until(lambda: bool(finished), timeout_s=10)
        assert finished[0].finish_reason == "abort" and finished[0].output_tokens < 20000
        await sub.unsubscribe()
    finally:
        if proc.poll() is None:
            proc.kill()
        await agent.stop()
