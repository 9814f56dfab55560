"""Token fidelity in the SDK: a turn whose prompt does not extend the trajectory's last prompt + output is counted
(`RolloutClient.prefix_breaks`) and logged once per trajectory; turns that extend it are not."""

from __future__ import annotations

import structlog.testing

from prorsa.client.client import RolloutClient
from proto import SamplingParams
from tests.engine_agent_support import make_agent


async def test_prefix_breaks_are_counted_and_logged_once(nats_server, nc) -> None:
    agent = make_agent(nats_server.url, "mix-0", "mixed")
    await agent.start()
    client = await RolloutClient.connect(nats_server.url)
    try:
        traj = await client.start_trajectory("pfx-1")
        prompt = list(range(1, 50))
        out = await traj.generate(prompt, SamplingParams(max_tokens=4))
        extended = [*prompt, *out.token_ids, 7, 8]
        out2 = await traj.generate(extended, SamplingParams(max_tokens=4))
        assert client.prefix_breaks == 0
        retemplated = [*prompt, 9, 9, 9]  # history re-rendered: the sampled ids are gone
        with structlog.testing.capture_logs() as logs:
            await traj.generate(retemplated, SamplingParams(max_tokens=4))
            await traj.generate([*retemplated, 1], SamplingParams(max_tokens=4))  # extends neither
        assert client.prefix_breaks == 2
        assert [e["event"] for e in logs].count("prefix_break") == 1
        assert out2.token_ids and traj.turn == 4
    finally:
        await client.close()
        await agent.stop()
