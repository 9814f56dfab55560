"""SGLang's `/generate` with `stream: true` through the gateway: server-sent `data: {text, output_ids, meta_info}`
events, cumulative as SGLang streams by default, the last one the whole answer, then `data: [DONE]`; the ids are what
the simulated engines drew; a turn refused before it streams is still an HTTP error, and a client going away
mid-stream aborts the turn on its engine. A real nats-server, a prefill and a decode engine, the gateway process."""

from __future__ import annotations

import asyncio
import json

import nats
import pytest

import proto
from proto import RequestFinished, Subjects
from services.runtime.nats_server import EmbeddedNatsServer
from tests.engine_agent_support import expected_ids

httpx = pytest.importorskip("httpx")
pytest.importorskip("transformers", reason="the gateway's tokenizer needs transformers")

pytestmark = pytest.mark.timeout(180)


async def _events(client: httpx.AsyncClient, url: str, body: dict) -> tuple[list[dict], list[str]]:
    """The JSON events and every `data:` line, in order."""
    events: list[dict] = []
    lines: list[str] = []
    async with client.stream("POST", url, json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                lines.append(line)
                if line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
    return events, lines


async def test_generate_streams_cumulative_events_then_done(sim_gateway: str) -> None:
    root = sim_gateway.removesuffix("/v1")
    body = {
        "input_ids": [3, 4, 5, 6],
        "sampling_params": {"max_new_tokens": 300, "temperature": 1.0},
        "return_logprob": True,
        "top_logprobs_num": 2,
        "stream": True,
        "trajectory_id": "gen-stream-1",
    }
    async with httpx.AsyncClient(timeout=60) as client:
        events, lines = await _events(client, f"{root}/generate", body)
        whole = await client.post(
            f"{root}/generate",
            json={**body, "stream": False, "trajectory_id": "gen-whole-1"},
        )
    assert lines[-1] == "data: [DONE]" and lines.count("data: [DONE]") == 1
    assert len(events) >= 3, "300 tokens should come in several engine chunks"
    ids = expected_ids("gen-stream-1:0", 300)
    for before, after in zip(events, events[1:], strict=False):
        assert after["output_ids"][: len(before["output_ids"])] == before["output_ids"]  # cumulative
    for event in events[:-1]:
        meta = event["meta_info"]
        assert meta["finish_reason"] is None and meta["completion_tokens"] == len(event["output_ids"])
        assert [i for _, i, _ in meta["output_token_logprobs"]] == event["output_ids"]
        assert len(meta["output_top_logprobs"]) == len(event["output_ids"])
        assert event["output_ids"] == ids[: len(event["output_ids"])]
    last = events[-1]
    assert last["output_ids"] == ids and last["meta_info"]["finish_reason"] == {"type": "length"}
    # The last event is the answer /generate gives unstreamed (another trajectory: same shape, its own ids).
    plain = whole.json()
    assert set(plain) == set(last) and set(plain["meta_info"]) == set(last["meta_info"])
    assert [i for _, i, _ in last["meta_info"]["output_token_logprobs"]] == ids


async def test_generate_stream_refusals_are_http_errors(sim_gateway: str) -> None:
    root = sim_gateway.removesuffix("/v1")
    async with httpx.AsyncClient(timeout=30) as client:
        first = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}, "trajectory_id": "gen-s-2"}
        assert (await client.post(f"{root}/generate", json=first)).status_code == 200
        done = await client.post(f"{sim_gateway}/trajectories/gen-s-2/finish", json={})
        assert done.status_code == 200
        late = await client.post(f"{root}/generate", json={**first, "stream": True})
        assert late.status_code == 409 and late.json()["error"]["code"] == "session_finished"
        bad = await client.post(
            f"{root}/generate", json={"input_ids": [1], "sampling_params": {"min_p": 0.2}, "stream": True}
        )
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "min_p"


async def test_a_client_leaving_a_generate_stream_aborts_the_turn(
    sim_gateway: str, gateway_bus: EmbeddedNatsServer
) -> None:
    nc = await nats.connect(gateway_bus.url)
    finished: asyncio.Future = asyncio.get_running_loop().create_future()

    async def on_event(msg) -> None:  # noqa: ANN001
        ev = proto.decode(msg.data, msg.subject)
        if isinstance(ev, RequestFinished) and ev.traj_id == "gen-gone-1" and not finished.done():
            finished.set_result(ev)

    await nc.subscribe(Subjects().all_engine_events, cb=on_event)
    body = {
        "input_ids": [1, 2, 3],
        "sampling_params": {"max_new_tokens": 20000},
        "stream": True,
        "trajectory_id": "gen-gone-1",
    }
    try:
        async with (
            httpx.AsyncClient(timeout=30) as client,
            client.stream("POST", f"{sim_gateway.removesuffix('/v1')}/generate", json=body) as r,
        ):
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: {")
                if seen >= 2:
                    break  # and go away mid-stream
        ev = await asyncio.wait_for(finished, 15)
        assert ev.finish_reason == "abort" and 0 < ev.output_tokens < 20000
    finally:
        await nc.close()
