"""The gateway under `prorsa up` (simulated engines, a real nats-server, the real HTTP server on a loopback port),
driven by the official OpenAI client and raw HTTP: multi-turn chat sessions with token ids and logprobs on every
turn and each prompt extending the last, the tracker seeing turns and tool-call gaps, streaming, token-id
completions, /generate, an n = 8 group, every bad input answered, and hundreds of concurrent sessions."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("transformers", reason="the chat template needs transformers")

from tests.up_support import prorsa_up  # noqa: E402

pytestmark = pytest.mark.timeout(240)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "run a command",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        },
    }
]


@dataclass
class Up:
    nats: str
    base_url: str  # .../v1
    key: str
    secrets: Path
    proc: subprocess.Popen

    @property
    def root(self) -> str:
        return self.base_url.removesuffix("/v1")

    def openai(self, **kw: object) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key=self.key, **kw)

    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    secrets = tmp_path_factory.mktemp("up") / "secrets"
    with prorsa_up(["--engines", "2", "--secrets-dir", str(secrets)], ready_s=120) as started:
        nats_url, base = started.printed.get("nats", ""), started.printed.get("openai", "")
        assert nats_url and base and "services healthy" in started.summary, started.output
        assert f"gateway: ok at {base}\n" in started.lines, started.output  # `up` waited for it to answer
        env = (secrets / "trainer.env").read_text()
        key = re.search(r"export OPENAI_API_KEY=(\S+)", env)
        assert key and f"export PRORSA_API_KEY={key.group(1)}" in env and f"OPENAI_BASE_URL={base}" in env
        _wait_http(base.removesuffix("/v1") + "/health")
        yield Up(nats_url, base, key.group(1), secrets, started.proc)


def _wait_http(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} never answered")


async def _snapshots(up: Up, until: object, timeout_s: float = 20.0) -> object:
    """Read tracker snapshots (as the operator) until `until(snapshot)` holds; return that snapshot."""
    import proto
    from proto import LifecycleSnapshot, Subjects
    from services.runtime.bus import connect
    from services.runtime.credentials import BusCredentials

    creds = BusCredentials(nkey_file=str(up.secrets / "operator.nk"), inbox_prefix="_INBOX.operator")
    nc = await connect(up.nats, "test-operator", credentials=creds)
    try:
        sub = await nc.subscribe(Subjects().snapshot)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            msg = await sub.next_msg(timeout=max(0.1, deadline - time.monotonic()))
            snap = proto.decode_as(msg.data, LifecycleSnapshot, msg.subject)
            if until(snap):  # type: ignore[operator]
                return snap
        raise AssertionError("the tracker never showed it")
    finally:
        await nc.close()


def test_multi_turn_chat_session_is_token_exact_and_tracked(up: Up) -> None:
    client = up.openai()
    session = {"X-Prorsa-Trajectory": "ep-chat-1"}
    messages: list[dict] = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "list the files"},
    ]
    previous: list[int] = []
    for turn in range(3):
        r = client.chat.completions.create(
            model="prorsa", messages=messages, max_tokens=6, logprobs=True, tools=TOOLS, extra_headers=session
        )
        body = r.model_dump()
        prompt, out = body["prompt_token_ids"], body["choices"][0]["token_ids"]
        lps = body["choices"][0]["logprobs"]["content"]
        assert len(out) == 6 and len(lps) == 6 and all(lp["logprob"] < 0 for lp in lps)
        assert body["choices"][0]["prorsa"] == body["choices"][0]["prorsa"] | {
            "trajectory_id": "ep-chat-1",
            "turn": turn,
        }
        assert prompt[: len(previous)] == previous  # turn k+1's prompt = turn k's prompt + output + new ids
        previous = prompt + out
        messages += [
            r.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "content": f"out {turn}"},
        ]
        if turn == 0:  # the gap after a response is a tool call, without the client saying so
            snap = asyncio.run(
                _snapshots(
                    up,
                    lambda s: any(
                        t.traj_id == "ep-chat-1" and t.state == "tool_call" for t in s.trajectories
                    ),
                )
            )
            assert snap is not None
    done = httpx.post(f"{up.base_url}/trajectories/ep-chat-1/finish", json={"reward": 1.0}, headers=up.auth())
    assert done.status_code == 200 and done.json()["turns"] == 3
    asyncio.run(_snapshots(up, lambda s: all(t.traj_id != "ep-chat-1" for t in s.trajectories)))
    again = httpx.post(
        f"{up.base_url}/chat/completions",
        json={"messages": messages, "trajectory_id": "ep-chat-1"},
        headers=up.auth(),
    )
    assert again.status_code == 409 and again.json()["error"]["code"] == "session_finished"


def test_streaming_chat_and_token_id_completions_and_generate(up: Up) -> None:
    client = up.openai()
    stream = client.chat.completions.create(
        model="prorsa",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=12,
        logprobs=True,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"trajectory_id": "ep-stream-1"},
    )
    ids: list[int] = []
    lps: list[float] = []
    finish = usage = None
    for chunk in stream:
        d = chunk.model_dump()
        if d.get("usage"):
            usage = d["usage"]
        for c in d["choices"]:
            ids += c.get("token_ids") or []
            lps += [x["logprob"] for x in ((c.get("logprobs") or {}).get("content") or [])]
            finish = c.get("finish_reason") or finish
    assert len(ids) == 12 and len(lps) == 12 and finish == "length" and usage["completion_tokens"] == 12

    comp = client.completions.create(model="prorsa", prompt=[11, 12, 13, 14], max_tokens=5, logprobs=0)
    choice = comp.model_dump()["choices"][0]
    assert choice["prompt_token_ids"] == [11, 12, 13, 14] and len(choice["token_ids"]) == 5
    assert len(choice["logprobs"]["token_logprobs"]) == 5

    gen = httpx.post(
        f"{up.root}/generate",
        json={
            "input_ids": [1, 2, 3],
            "sampling_params": {"max_new_tokens": 4, "temperature": 1.0},
            "return_logprob": True,
        },
        headers=up.auth(),
    ).json()
    assert len(gen["output_ids"]) == 4
    assert [i for _, i, _ in gen["meta_info"]["output_token_logprobs"]] == gen["output_ids"]


def test_n_is_a_group_of_trajectories(up: Up) -> None:
    r = up.openai().chat.completions.create(
        model="prorsa", messages=[{"role": "user", "content": "solve"}], max_tokens=3, n=8
    )
    body = r.model_dump()
    trajs = {c["prorsa"]["trajectory_id"] for c in body["choices"]}
    assert len(body["choices"]) == 8 and len(trajs) == 8
    assert all(len(c["token_ids"]) == 3 for c in body["choices"])
    # One engine for the whole group: the shared prompt is prefilled and cached there once.
    assert len({c["prorsa"]["engine_id"] for c in body["choices"]}) == 1


def test_prefix_breaks_are_counted(up: Up) -> None:
    client = up.openai()
    h = {"X-Prorsa-Trajectory": "ep-break-1"}
    msgs = [{"role": "user", "content": "first"}]
    r = client.chat.completions.create(model="prorsa", messages=msgs, max_tokens=2, extra_headers=h)
    before = _metric(up, "prorsa_prefix_breaks_total")
    edited = [
        {"role": "user", "content": "FIRST, edited"},
        r.choices[0].message.model_dump(exclude_none=True),
    ]
    client.chat.completions.create(
        model="prorsa", messages=[*edited, {"role": "user", "content": "next"}], max_tokens=2, extra_headers=h
    )
    assert _metric(up, "prorsa_prefix_breaks_total") == before + 1


def _metric(up: Up, name: str) -> float:
    text = httpx.get(f"{up.root}/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


@pytest.mark.parametrize(
    ("body", "headers", "status", "code"),
    [
        (b"{not json", None, 400, "invalid_json"),
        ({"messages": [{"role": "user", "content": "x"}], "frobnicate": 1}, None, 400, "invalid_field"),
        (
            {"messages": [{"role": "user", "content": "x"}], "min_p": 0.5},
            None,
            400,
            "unsupported_field",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6},
            None,
            400,
            "context_length_exceeded",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}]},
            {"Authorization": "Bearer wrong"},
            401,
            "invalid_api_key",
        ),
        ({"messages": [{"role": "user", "content": "x"}]}, {}, 401, "invalid_api_key"),
    ],
)
def test_bad_chat_requests_get_http_errors(
    up: Up, body: object, headers: dict | None, status: int, code: str
) -> None:
    h = up.auth() if headers is None else headers
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{up.base_url}/chat/completions", headers={"Content-Type": "application/json", **h}, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["message"]
    if code in ("invalid_field", "unsupported_field"):
        assert err["param"] in ("frobnicate", "min_p")


def test_unknown_session_and_oversized_body(up: Up) -> None:
    r = httpx.post(f"{up.base_url}/trajectories/nobody/finish", json={}, headers=up.auth())
    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_session"
    r = httpx.post(f"{up.base_url}/trajectories/nobody/abort", headers=up.auth())
    assert r.status_code == 404
    bad = httpx.post(
        f"{up.base_url}/completions",
        json={"prompt": [1, 2], "max_tokens": 2},
        headers={**up.auth(), "X-Prorsa-Trajectory": "not a.subject"},
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-prorsa-trajectory"
    big = b'{"prompt": "' + b"x" * (33 * 1024 * 1024) + b'"}'
    r = httpx.post(f"{up.base_url}/completions", content=big, headers=up.auth(), timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_hundreds_of_concurrent_sessions(up: Up) -> None:
    """Each of 200 sessions runs two turns at once with the others: no response lost or crossed."""

    async def session(client: httpx.AsyncClient, i: int) -> None:
        sid = f"ep-many-{i}"
        msgs: list[dict] = [{"role": "user", "content": f"task {i}"}]
        last: list[int] = []
        for turn in range(2):
            r = await client.post(
                f"{up.base_url}/chat/completions",
                json={"messages": msgs, "max_tokens": 4, "trajectory_id": sid},
                headers=up.auth(),
            )
            assert r.status_code == 200, r.text
            body = r.json()
            assert (
                body["choices"][0]["prorsa"]["trajectory_id"] == sid
                and body["choices"][0]["prorsa"]["turn"] == turn
            )
            assert body["prompt_token_ids"][: len(last)] == last
            last = body["prompt_token_ids"] + body["choices"][0]["token_ids"]
            msgs += [body["choices"][0]["message"], {"role": "user", "content": "go on"}]
        r = await client.post(
            f"{up.base_url}/trajectories/{sid}/finish", json={"reward": 0.0}, headers=up.auth()
        )
        assert r.status_code == 200

    async def main() -> None:
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            await asyncio.gather(*(session(client, i) for i in range(200)))

    asyncio.run(main())


async def _engine_finished(up: Up, traj_id: str, timeout_s: float = 30.0) -> object:
    """The engines' RequestFinished of `traj_id`'s turn (read as the operator from the EVENTS stream)."""
    import proto
    from proto import RequestFinished, Subjects
    from services.runtime.bus import connect
    from services.runtime.credentials import BusCredentials

    creds = BusCredentials(nkey_file=str(up.secrets / "operator.nk"), inbox_prefix="_INBOX.operator")
    nc = await connect(up.nats, "test-operator", credentials=creds)
    try:
        sub = await nc.subscribe(Subjects().all_engine_events)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            msg = await sub.next_msg(timeout=max(0.1, deadline - time.monotonic()))
            ev = proto.decode(msg.data, msg.subject)
            if isinstance(ev, RequestFinished) and ev.traj_id == traj_id:
                return ev
        raise AssertionError(f"no RequestFinished for {traj_id}")
    finally:
        await nc.close()


def test_a_client_disconnecting_mid_stream_aborts_the_turn_on_its_engine(up: Up) -> None:
    async def main() -> object:
        watch = asyncio.create_task(_engine_finished(up, "ep-gone-1"))
        await asyncio.sleep(0.3)
        body = {"messages": [{"role": "user", "content": "long"}], "max_tokens": 20000, "stream": True}
        async with (
            httpx.AsyncClient(timeout=30) as client,
            client.stream(
                "POST",
                f"{up.base_url}/chat/completions",
                json={**body, "trajectory_id": "ep-gone-1"},
                headers=up.auth(),
            ) as r,
        ):
            assert r.status_code == 200
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data:")
                if seen >= 3:
                    break  # and go away mid-stream
        t0 = time.monotonic()
        ev = await watch
        return ev, time.monotonic() - t0

    ev, waited = asyncio.run(main())
    assert ev.finish_reason == "abort" and 0 < ev.output_tokens < 20000, ev  # type: ignore[attr-defined]
    assert waited < 10
    assert _metric(up, 'prorsa_gateway_aborts_total{cause="disconnect"}') >= 1


def test_abort_endpoint_stops_the_running_turn_and_closes_the_session(up: Up) -> None:
    async def main() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            turn = asyncio.create_task(
                client.post(
                    f"{up.base_url}/chat/completions",
                    json={
                        "messages": [{"role": "user", "content": "x"}],
                        "max_tokens": 20000,
                        "logprobs": True,
                    },
                    headers={**up.auth(), "X-Prorsa-Trajectory": "ep-abort-1"},
                )
            )
            await asyncio.sleep(1.5)
            aborted = await client.post(f"{up.base_url}/trajectories/ep-abort-1/abort", headers=up.auth())
            return await turn, aborted

    turn, aborted = asyncio.run(main())
    assert aborted.status_code == 200 and aborted.json()["status"] == "aborted"
    choice = turn.json()["choices"][0]
    assert choice["finish_reason"] == "abort" and 0 < len(choice["token_ids"]) < 20000
    assert len(choice["logprobs"]["content"]) == len(choice["token_ids"])  # the partial output, token-exact
    late = httpx.post(
        f"{up.base_url}/chat/completions",
        json={"messages": [{"role": "user", "content": "x"}], "trajectory_id": "ep-abort-1"},
        headers=up.auth(),
    )
    assert late.status_code == 409


def test_litellm_drives_a_tool_calling_session(up: Up) -> None:
    """LiteLLM's OpenAI-compatible provider (as agent scaffolds use it), with `tools`, on one trajectory."""
    os.environ.setdefault(
        "LITELLM_LOCAL_MODEL_COST_MAP", "True"
    )  # no fetch of the price map: no network here
    litellm = pytest.importorskip("litellm")
    msgs: list[dict] = [{"role": "user", "content": "run the tests"}]
    breaks = _metric(up, "prorsa_prefix_breaks_total")
    for _ in range(2):
        r = litellm.completion(
            model="openai/prorsa",
            api_base=up.base_url,
            api_key=up.key,
            messages=msgs,
            tools=TOOLS,
            max_tokens=5,
            logprobs=True,
            extra_headers={"X-Prorsa-Trajectory": "ep-litellm-1"},
        )
        body = r.model_dump()
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "length" and body["choices"][0]["logprobs"]
        msgs += [{"role": "assistant", "content": msg.content or ""}, {"role": "tool", "content": "2 passed"}]
    done = httpx.post(
        f"{up.base_url}/trajectories/ep-litellm-1/finish", json={"reward": 1.0}, headers=up.auth()
    )
    assert done.status_code == 200 and done.json()["turns"] == 2
    # The history LiteLLM sent back extended the first turn token for token: no prefix break was counted.
    assert _metric(up, "prorsa_prefix_breaks_total") == breaks


def test_the_readme_quick_start_runs(
    up: Up, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    section = readme.split("## Any agent, any language", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.setenv("OPENAI_BASE_URL", up.base_url)
    monkeypatch.setenv("OPENAI_API_KEY", up.key)
    exec(compile(code, "README.md", "exec"), {})
    assert len(capsys.readouterr().out.splitlines()) == 2  # one line per turn
    late = httpx.post(
        f"{up.base_url}/chat/completions",
        json={"messages": [{"role": "user", "content": "x"}], "trajectory_id": "episode-1"},
        headers=up.auth(),
    )
    assert late.status_code == 409  # the quick start finished its trajectory


def test_a_client_giving_up_on_a_whole_answer_aborts_the_turn(up: Up) -> None:
    """Not streamed: an agent's HTTP timeout closes the connection, and the turn stops on its engine."""

    async def main() -> object:
        watch = asyncio.create_task(_engine_finished(up, "ep-timeout-1"))
        await asyncio.sleep(0.3)
        body = {
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 20000,
            "trajectory_id": "ep-timeout-1",
        }
        async with httpx.AsyncClient(timeout=2.0) as client:
            with pytest.raises(httpx.ReadTimeout):
                await client.post(f"{up.base_url}/chat/completions", json=body, headers=up.auth())
        return await watch

    ev = asyncio.run(main())
    assert ev.finish_reason == "abort" and 0 < ev.output_tokens < 20000, ev  # type: ignore[attr-defined]


def test_the_trainer_control_plane_over_http(up: Up) -> None:
    """Issue 31 over HTTP: a weight update with its barrier (200 naming every engine; 504 naming those that do not
    serve it in time; 409 for a refused checkpoint or a stale version), pause/resume, abort by version with the
    partial outputs and their versions, per-token versions on responses; all behind the key."""
    url = up.base_url
    with httpx.Client(timeout=120) as http:
        assert http.post(f"{url}/weights", json={"version": 1}).status_code == 401
        assert http.post(f"{url}/weights", json={"version": -1}, headers=up.auth()).status_code == 400
        late = http.post(f"{url}/weights", json={"version": 1, "timeout_s": 0.05}, headers=up.auth())
        assert late.status_code == 504, late.text
        assert late.json()["error"]["code"] == "weights_timeout" and late.json()["error"]["engines"]
        ok = http.post(f"{url}/weights", json={"version": 1, "mode": "inflight"}, headers=up.auth())
        assert ok.status_code == 200, ok.text
        engines = ok.json()["engines"]
        assert len(engines) == 2 and set(engines.values()) == {1}
        stale = http.post(f"{url}/weights", json={"version": 0}, headers=up.auth())
        assert stale.status_code == 409 and stale.json()["error"]["code"] == "stale_version"
        refused = http.post(
            f"{url}/weights",
            json={"version": 2, "source": "/etc/not-weights", "timeout_s": 30},
            headers=up.auth(),
        )
        assert refused.status_code == 409, refused.text
        err = refused.json()["error"]
        assert err["code"] == "weights_failed" and sorted(err["engines"]) == sorted(engines)
        assert all("weights root" in why for why in err["failed"].values())
        done = http.post(f"{url}/completions", json={"prompt": [1, 2, 3], "max_tokens": 8}, headers=up.auth())
        choice = done.json()["choices"][0]
        assert choice["token_versions"] == [1] * len(choice["token_ids"]) and len(choice["token_ids"]) == 8
        paused = http.post(f"{url}/pause", json={"reason": "sync"}, headers=up.auth())
        assert paused.status_code == 200 and paused.json()["paused"] and len(paused.json()["engines"]) == 2
        resumed = http.post(f"{url}/resume", json={}, headers=up.auth())
        assert resumed.status_code == 200 and not resumed.json()["paused"]

    async def abort_running() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            turn = asyncio.create_task(
                client.post(
                    f"{url}/completions", json={"prompt": [5, 6, 7], "max_tokens": 20000}, headers=up.auth()
                )
            )
            await asyncio.sleep(1.5)
            aborted = await client.post(f"{url}/abort", json={"older_than": 2}, headers=up.auth())
            return await turn, aborted

    turn, aborted = asyncio.run(abort_running())
    assert aborted.status_code == 200, aborted.text
    (partial,) = aborted.json()["aborted"]
    choice = turn.json()["choices"][0]
    assert choice["finish_reason"] == "abort" and partial["token_ids"] == choice["token_ids"]
    assert partial["token_versions"] == choice["token_versions"] == [1] * len(choice["token_ids"])
