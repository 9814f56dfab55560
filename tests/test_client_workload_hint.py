"""The trainer's `Trajectory.generate` speaks only of tokens and sampling; the rollout driver's `WorkloadHint`
reaches a simulated engine through `generate_hinted`, a path the SDK's public surface does not expose.

One simulated engine over a real nats-server serves the turns; the requests are also read off the bus as the engine
sees them (a core subscription on the prefill work subject).
"""

from __future__ import annotations

import asyncio
import inspect

import pytest

import prorsa.client
import proto
from prorsa.client import RolloutClient, Trajectory
from prorsa.client.workload_hint import WorkloadHint, generate_hinted
from proto import GenerateRequest, SamplingParams, Subjects
from tests.engine_agent_support import make_agent

pytestmark = pytest.mark.timeout(120)


def test_the_trainer_api_has_no_simulator_knobs() -> None:
    params = inspect.signature(Trajectory.generate).parameters
    assert list(params) == [
        "self",
        "prompt_token_ids",
        "sampling",
        "on_tokens",
        "timeout_s",
        "on_chunk",
        "min_policy_version",  # the staleness bound: an RL knob, not a simulator one
    ]
    assert not any(name.startswith("sim") or "hint" in name.lower() for name in prorsa.client.__all__)


async def test_plain_and_hinted_turns_on_a_simulated_engine(nats_server) -> None:
    agent = make_agent(nats_server.url, "sim-0", "mixed", speedup=50.0)
    await agent.start()
    client = await RolloutClient.connect(nats_server.url, retry_after_s=60.0)
    seen: dict[str, GenerateRequest] = {}

    async def on_request(msg) -> None:  # noqa: ANN001
        req = proto.decode_as(msg.data, GenerateRequest, msg.subject)
        seen[req.request_id] = req

    await client.nc.subscribe(Subjects().prefill_work_any, cb=on_request)
    await client.nc.subscribe(Subjects().prefill_work_for("sim-0"), cb=on_request)
    try:
        plain = await client.start_trajectory("plain")
        out = await asyncio.wait_for(plain.generate([5, 6, 7], SamplingParams(max_tokens=9)), 60)
        assert len(out.token_ids) == 9  # no hint: the engine runs to max_tokens

        hinted = await client.start_trajectory("hinted")
        first = await asyncio.wait_for(
            generate_hinted(hinted, [], SamplingParams(max_tokens=80), WorkloadHint(1200, output_tokens=7)),
            60,
        )
        assert len(first.token_ids) == 7 and first.cached_tokens == 0  # the workload's length, not max_tokens
        hint = WorkloadHint(prompt_len=1500, output_tokens=5, cacheable_tokens=1000)
        second = await asyncio.wait_for(generate_hinted(hinted, [], SamplingParams(max_tokens=80), hint), 60)
        # The engine holds 1207 tokens of this trajectory's prefix; the hint bounds what it may reuse.
        assert len(second.token_ids) == 5 and second.cached_tokens == 1000
        await asyncio.sleep(0.2)

        wire = {
            rid: (r.prompt_token_ids, r.prompt_len, r.sim_output_tokens, r.sim_cacheable_tokens)
            for rid, r in seen.items()
        }
        assert wire == {
            "plain:0": ([5, 6, 7], 3, 0, 0),
            "hinted:0": ([], 1200, 7, 0),
            "hinted:1": ([], 1500, 5, 1000),
        }
    finally:
        await client.close()
        await agent.stop()


async def test_a_hint_that_contradicts_the_ids_is_refused(nats_server) -> None:
    client = await RolloutClient.connect(nats_server.url)
    try:
        traj = await client.start_trajectory("bad")
        with pytest.raises(ValueError, match="prompt_len 4 != 3 prompt ids"):
            await generate_hinted(traj, [1, 2, 3], SamplingParams(max_tokens=1), WorkloadHint(prompt_len=4))
        assert traj.turn == 0  # nothing was sent
        with pytest.raises(ValueError, match="output_tokens must be >= 0"):
            WorkloadHint(prompt_len=1, output_tokens=-1)
    finally:
        await client.close()
