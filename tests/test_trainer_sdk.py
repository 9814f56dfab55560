"""The trainer integrations' parts that need no framework (`prorsa.trainers`): the picklable connection and verl
client on a real nats-server with simulated engines, the checkpoint writer, the settings and sampling checks.
verl and AReaL themselves run in tests/test_trainers.py."""

from __future__ import annotations

import asyncio
import json
import pickle
from pathlib import Path

import pytest

from prorsa.trainers.checkpoint import save_checkpoint
from prorsa.trainers.connection import Connection, NoClusterError
from prorsa.trainers.settings import settings_from
from prorsa.trainers.verl import NOT_MODEL, ProrsaLLMClient, response_versions, sampling_from_dict
from tests.engine_agent_support import make_agent

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
async def engines(nats_server, monkeypatch):
    monkeypatch.setenv("PRORSA_TIME_SCALE", "20")
    agents = [make_agent(nats_server.url, f"e{i}", "mixed", speedup=None) for i in range(2)]
    for a in agents:
        await a.start()
    yield nats_server.url
    for a in agents:
        await a.stop()


async def test_a_client_pickled_after_use_connects_again_in_another_loop(engines: str) -> None:
    """verl pickles its llm_client into each AgentLoopWorker actor: a used client must pickle (the old adapter,
    holding a connected RolloutClient, raised `TypeError: cannot pickle '_asyncio.Task'`), and the copy must
    connect on its own in the loop it runs in."""
    conn = Connection(engines, time_scale=20.0, client_options={"retry_after_s": 60.0})
    llm = ProrsaLLMClient(conn, task="coding", max_tokens=8)
    out = await llm.generate("a", prompt_ids=list(range(1, 60)), sampling_params={"temperature": 1.0})
    assert len(out.token_ids) == 8 and out.extra_fields["token_versions"] == [0] * 8
    here = await conn.client()
    assert await conn.client() is here  # one connection per loop

    copy = pickle.loads(pickle.dumps(llm))
    assert copy.trajectories == {} and copy.connection.url == engines

    async def elsewhere() -> tuple[int, str]:  # another thread, another event loop: as a Ray actor's
        res = await copy.generate("b", prompt_ids=list(range(1, 40)), sampling_params={})
        client_id = (await copy.connection.client()).client_id
        await copy.finish("b")
        await copy.connection.close()
        return len(res.token_ids), client_id

    n, their_id = await asyncio.to_thread(asyncio.run, elsewhere())
    assert n == 8 and their_id != here.client_id
    await llm.finish("a")
    await conn.close()
    assert here.nc.is_closed


async def test_a_session_is_its_own_connection_and_closes(engines: str) -> None:
    conn = Connection(engines, time_scale=20.0)
    shared = await conn.client()
    async with conn.session() as client:
        assert client is not shared and client.nc.is_connected
    assert client.nc.is_closed and shared.nc.is_connected
    await conn.close()


def test_close_all_closes_a_client_in_another_threads_running_loop(engines: str) -> None:
    """AReaL's executor runs episodes in a thread of its own: `destroy` closes that loop's client from outside."""
    import threading

    conn = Connection(engines, time_scale=20.0, discovery_s=0.0)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        client = asyncio.run_coroutine_threadsafe(conn.client(), loop).result(30)
        assert client.nc.is_connected
        conn.close_all()
        assert client.nc.is_closed
        assert asyncio.run_coroutine_threadsafe(conn.client(), loop).result(30) is not client  # a new one
        conn.close_all()
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def test_a_connection_needs_a_url(monkeypatch) -> None:
    monkeypatch.delenv("PRORSA_NATS_URL", raising=False)
    with pytest.raises(NoClusterError, match="PRORSA_NATS_URL"):
        Connection.from_env()
    with pytest.raises(ValueError, match="time scale"):
        Connection("nats://127.0.0.1:4222", time_scale=0.0)


def test_settings_and_sampling_refuse_what_they_cannot_honour() -> None:
    with pytest.raises(ValueError, match=r"unknown Prorsa settings \['weight_root'\]"):
        settings_from({"weight_root": "/x"})
    with pytest.raises(ValueError, match="'n'"):
        sampling_from_dict({"n": 4})
    params = sampling_from_dict({"repetition_penalty": 1.1, "temperature": 0.7, "logprobs": False}, 32)
    assert params.max_tokens == 32 and params.temperature == 0.7 and params.logprobs is False
    assert params.repetition_penalty == 1.1  # the sampler's penalties are passed on


@pytest.mark.parametrize(
    ("mask", "versions", "expected"),
    [
        # a turn on each side of an observation; a response truncated to response_length; no model token
        ([1, 1, 0, 0, 1], [3, 3, 4], [3, 3, NOT_MODEL, NOT_MODEL, 4]),
        ([1, 1], [3, 3, 4, 4], [3, 3]),
        ([0, 0], [], [NOT_MODEL, NOT_MODEL]),
    ],
)
def test_response_versions_follow_the_model_tokens(mask: list, versions: list, expected: list) -> None:
    assert response_versions(mask, versions) == expected


def test_response_versions_refuse_tokens_nobody_served() -> None:
    with pytest.raises(RuntimeError, match="3 model tokens but Prorsa served 2"):
        response_versions([1, 1, 1], [0, 0], "tool_agent")


def test_save_checkpoint_writes_a_model_directory_atomically(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file

    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (base / "tokenizer.json").write_text("{}")
    (base / "model.safetensors").write_bytes(b"old weights")  # replaced, never copied
    embed = torch.ones(4, 2)
    weights = {"embed.weight": embed, "lm_head.weight": embed}  # tied: one storage, two names
    out = save_checkpoint(weights, tmp_path / "root" / "global_step_1", str(base))
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    loaded = load_file(str(out / "model.safetensors"))
    assert torch.equal(loaded["lm_head.weight"], embed)
    assert [p.name for p in out.parent.iterdir()] == ["global_step_1"]  # no temporary directory left
    # A second write of the same version (another replica, a retry) leaves the first untouched.
    assert save_checkpoint({"x": torch.zeros(1)}, out, str(base)) == out
    assert "embed.weight" in load_file(str(out / "model.safetensors"))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        save_checkpoint(weights, tmp_path / "root" / "global_step_2", str(tmp_path))
    with pytest.raises(ValueError, match="no weights"):
        save_checkpoint({}, tmp_path / "root" / "global_step_3", str(base))
