"""Sessions across a gateway restart: a session's turns live in its gateway process, so one that restarts cannot
continue them token-exactly. A request continuing such a session is answered 409 `session_lost` with a JSON error
naming the session and telling the client to start a new one (never continued from a guess, never started afresh
under an id whose request ids the engines have seen); `/finish` or `/abort` of it closes the trajectory on the bus;
a new session is served as ever. A real nats-server, a simulated engine, gateway processes killed and restarted."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import nats
import pytest

import proto
from prorsa.gateway.launch import free_port, wait_gateway
from proto import Subjects, TrajectoryFinished
from services.runtime.context_log_io import holds
from services.runtime.nats_server import EmbeddedNatsServer
from tests.engine_agent_support import make_agent
from tests.gateway_support import errors, start_gateway

httpx = pytest.importorskip("httpx")
pytest.importorskip("transformers", reason="the chat template needs transformers")

pytestmark = pytest.mark.timeout(180)


async def _gateway(url: str) -> tuple[object, str]:
    port = free_port()
    proc = start_gateway(url, port)
    base = f"http://127.0.0.1:{port}/v1"
    assert await asyncio.to_thread(wait_gateway, base, 60), "the gateway never answered /health"
    return proc, base


@pytest.fixture
async def engine(nats_server: EmbeddedNatsServer) -> AsyncIterator[None]:
    agent = make_agent(nats_server.url, "mix-0", "mixed")
    await agent.start()
    try:
        yield
    finally:
        await agent.stop()


async def test_a_session_of_a_restarted_gateway_is_refused_by_name_and_can_be_closed(
    nats_server: EmbeddedNatsServer, engine: None
) -> None:
    chat = [{"role": "user", "content": "list the files"}]
    first, base = await _gateway(nats_server.url)
    try:
        async with httpx.AsyncClient(timeout=60) as http:
            r = await http.post(
                f"{base}/chat/completions",
                json={"messages": chat, "max_tokens": 4, "trajectory_id": "rs-chat"},
            )
            assert r.status_code == 200, r.text
            reply = r.json()["choices"][0]["message"]
            r = await http.post(
                f"{base}/completions", json={"prompt": [1, 2, 3], "max_tokens": 3, "trajectory_id": "rs-ids"}
            )
            assert r.status_code == 200, r.text
            ids = r.json()["choices"][0]["token_ids"]
    finally:
        first.kill()  # a crash: nothing of its sessions is handed on
        await asyncio.to_thread(first.wait, 30)

    second, base = await _gateway(nats_server.url)
    nc = await nats.connect(nats_server.url)
    finished: list[TrajectoryFinished] = []

    async def on_lifecycle(msg) -> None:  # noqa: ANN001
        ev = proto.decode(msg.data, msg.subject)
        if isinstance(ev, TrajectoryFinished):
            finished.append(ev)

    await nc.subscribe(Subjects().lifecycle, cb=on_lifecycle)
    try:
        async with httpx.AsyncClient(timeout=60) as http:
            lost_before = errors(base, "session_lost")
            history = [*chat, reply, {"role": "tool", "content": "a.py"}]
            again = await http.post(
                f"{base}/chat/completions",
                json={"messages": history, "max_tokens": 4, "trajectory_id": "rs-chat"},
            )
            assert again.status_code == 409, again.text
            err = again.json()["error"]
            assert err["code"] == "session_lost" and "'rs-chat'" in err["message"]
            assert "new session" in err["message"] and "/v1/trajectories/rs-chat/finish" in err["message"]
            more = await http.post(
                f"{base}/completions",
                json={"prompt": [1, 2, 3, *ids, 9], "max_tokens": 3, "trajectory_id": "rs-ids"},
            )
            assert more.status_code == 409 and more.json()["error"]["code"] == "session_lost"
            assert errors(base, "session_lost") == lost_before + 2  # counted

            # A session the bus does not hold is new: served as ever.
            fresh = await http.post(
                f"{base}/completions", json={"prompt": [4, 5], "max_tokens": 2, "trajectory_id": "rs-new"}
            )
            assert fresh.status_code == 200 and fresh.json()["choices"][0]["prorsa"]["turn"] == 0

            # Closing the lost sessions: on the bus, with the reward; a later turn is refused as finished.
            done = await http.post(f"{base}/trajectories/rs-chat/finish", json={"reward": 1.0})
            assert done.status_code == 200 and done.json() == {
                "id": "rs-chat",
                "object": "trajectory",
                "status": "finished",
                "turns": None,
            }
            aborted = await http.post(f"{base}/trajectories/rs-ids/abort")
            assert aborted.status_code == 200 and aborted.json()["status"] == "aborted"
            late = await http.post(
                f"{base}/chat/completions",
                json={"messages": history, "max_tokens": 4, "trajectory_id": "rs-chat"},
            )
            assert late.status_code == 409 and late.json()["error"]["code"] == "session_finished"
            nobody = await http.post(f"{base}/trajectories/rs-nobody/finish", json={})
            assert nobody.status_code == 404 and nobody.json()["error"]["code"] == "unknown_session"
        for _ in range(100):
            if {e.traj_id for e in finished} >= {"rs-chat", "rs-ids"}:
                break
            await asyncio.sleep(0.05)
        by_id = {e.traj_id: e for e in finished}
        assert by_id["rs-chat"].status == "finished" and by_id["rs-chat"].reward == 1.0
        assert by_id["rs-ids"].status == "aborted"
        js = nc.jetstream()
        assert not await holds(js, Subjects(), "rs-chat") and not await holds(js, Subjects(), "rs-ids")
        assert await holds(js, Subjects(), "rs-new")  # still open: its gateway holds it
    finally:
        await nc.close()
        second.terminate()
        await asyncio.to_thread(second.wait, 30)
