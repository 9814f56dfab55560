"""An engine agent reports `degraded` (details: starting) while its backend starts, and `ok` once it serves, so
`prorsa up` waits for real engines that take a minute to load instead of calling them healthy at once."""

from __future__ import annotations

import asyncio
import time

import proto
from proto import HealthReply, HealthRequest, Subjects
from services.engine_agent.agent import AgentConfig, EngineAgent
from services.engine_agent.backends.sim_backend import SimBackend
from tests.engine_agent_support import PROFILE

S = Subjects()


class SlowStartBackend(SimBackend):
    """The simulated backend, whose start waits for the test to release it."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.release = asyncio.Event()

    async def start(self) -> None:
        await self.release.wait()
        await super().start()


async def health(nc) -> HealthReply:  # type: ignore[no-untyped-def]
    reply = await nc.request(S.health, proto.encode(HealthRequest(ts_s=time.time())), timeout=5)
    return proto.decode_as(reply.data, HealthReply)


async def test_health_is_degraded_until_the_backend_serves(nats_server, nc) -> None:
    slow = SlowStartBackend(PROFILE, "slow-0", role="mixed", speedup=20.0)
    agent = EngineAgent(nats_server.url, engine_id="slow-0", backend=slow, config=AgentConfig(ack_wait_s=5.0))
    starting = asyncio.create_task(agent.start())
    try:
        for _ in range(100):  # the health subscription comes up before the backend starts
            await asyncio.sleep(0.05)
            try:
                first = await health(nc)
                break
            except Exception:
                continue
        assert first.status == "degraded" and first.details["starting"] is True
        slow.release.set()
        await asyncio.wait_for(starting, 10)
        ready = await health(nc)
        assert ready.status == "ok" and ready.details["starting"] is False
    finally:
        slow.release.set()
        await starting
        await agent.stop()
