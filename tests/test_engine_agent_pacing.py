"""The simulated backend paces the engine core on the clock: at a high speed-up it keeps the modelled time (the
core's events run at their modelled times however late the event loop is) and streams every token."""

from __future__ import annotations

import asyncio
import time

from proto import GenerateRequest, SamplingParams
from services.engine_agent.backends.sim_backend import SimBackend
from tests.engine_agent_support import PROFILE, modelled_s


def gen(rid: str, max_tokens: int, prompt_len: int) -> GenerateRequest:
    return GenerateRequest(
        request_id=rid,
        traj_id=f"t-{rid}",
        turn=0,
        prompt_token_ids=[],
        prompt_len=prompt_len,
        sampling=SamplingParams(max_tokens=max_tokens, logprobs=True),
        reply_to="r",
    )


async def test_backend_keeps_pace_with_the_model_at_speedup_200() -> None:
    speedup = 200.0
    requests = [gen(f"b{i}", 2_000, 1_000) for i in range(8)]
    modelled = modelled_s(PROFILE, requests)
    backend = SimBackend(PROFILE, "bench", speedup=speedup)
    await backend.start()

    async def consume(r: GenerateRequest) -> int:
        return sum([len(c.token_ids) async for c in backend.generate(r)])

    try:
        t0 = time.monotonic()
        counts = await asyncio.gather(*(consume(r) for r in requests))
        wall = time.monotonic() - t0
    finally:
        await backend.close()
    ratio = wall * speedup / modelled
    print(f"8 x 2000 tokens at speedup {speedup:g}: modelled {modelled:.2f} s virtual, ratio {ratio:.3f}")
    assert counts == [2_000] * 8
    assert 0.95 < ratio < 3.0  # never faster than modelled; generous above (a shared, loaded machine)
