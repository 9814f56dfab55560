"""Differential test of the one engine core: the same requests through live simulated engine agents over a real
nats-server and through the discrete-event simulator give the same per-request TTFT and finish times.

Both run `EngineCore`; what differs is everything around it — live, the bus, the agents' pulling and streaming,
and the client; in the simulator, nothing. So the gap measures the live path's overhead (multiplied by the time
scale into modelled seconds), and any rule the two kept apart would show as a systematic gap.

Tolerance: each request's TTFT and finish time (from its arrival) within 0.3 modelled s + 10 %. The scale is 2, not
the 10 the rollout tests use: the live path's overhead is wall time, multiplied by the scale into modelled seconds,
and at 10 one scheduler hiccup on a loaded 2-core machine (50 ms) already spent the tolerance (CI saw 0.58 s on one
TTFT). At 2, 0.3 s is 150 ms of wall time; with both cores busy the worst excess measured 0.11 s. Each case runs
about 2.5 s of wall time.

One retry: a live run on a shared 2-core machine can still stall for most of a second once (CI, with other suites
running beside it, saw one request wait 0.7 s of wall time for its first token while the engine's batch ran on),
so a run out of tolerance is repeated once. A rule the two drivers kept apart fails both runs.
"""

from __future__ import annotations

import asyncio

import pytest

from prorsa.client import RolloutClient
from prorsa.client.workload_hint import WorkloadHint, generate_hinted
from prorsa.sim import events as ev
from prorsa.sim.fixed_workload import FixedWorkload
from prorsa.sim.runner import SimConfig, run_simulation
from prorsa.workload.types import TrajectorySpec, Turn
from proto import SamplingParams
from tests.engine_agent_support import make_agent

pytestmark = pytest.mark.timeout(180)

SCALE = 2.0
# (arrival s, prompt tokens, output tokens): a burst that queues and batches, then stragglers that join a running
# batch mid-jump, with prompts long enough to be chunked in a mixed step.
REQUESTS = [
    (0.0, 6_000, 120),
    (0.0, 1_500, 300),
    (0.0, 3_000, 60),
    (0.4, 12_000, 200),
    (1.1, 800, 400),
    (1.5, 2_500, 90),
    (2.7, 9_000, 150),
    (3.0, 400, 250),
]


def _specs() -> list[TrajectorySpec]:
    return [
        TrajectorySpec(f"d{i}", "coding", (Turn(prompt, out, 0.0),), arrival_s=arrival)
        for i, (arrival, prompt, out) in enumerate(REQUESTS)
    ]


class _Times:
    """Per request: first token and last token, modelled seconds after its arrival (the simulator's observer)."""

    def __init__(self) -> None:
        self.start: dict[str, float] = {}
        self.first: dict[str, float] = {}
        self.end: dict[str, float] = {}

    def on_event(self, kind: str, traj_id: str, now: float, **fields: object) -> None:
        if kind == ev.TURN_SUBMITTED:
            self.start[traj_id] = now
        elif kind == ev.PREFILL_DONE:  # the step that completes the prompt samples the first token
            self.first.setdefault(traj_id, now)
        elif kind == ev.TRAJECTORY_FINISHED:
            self.end[traj_id] = now

    def rows(self) -> dict[str, tuple[float, float]]:
        return {t: (self.first[t] - s, self.end[t] - s) for t, s in self.start.items()}


def _simulated(policy: str, engines: int) -> dict[str, tuple[float, float]]:
    times = _Times()
    config = SimConfig(
        workload=FixedWorkload(_specs()),
        engines=engines,
        policy=policy,
        profile="qwen3-235b",
        training_s=0.0,
        observer=times,
    )
    run_simulation(config)
    return {k.removeprefix("s0-"): v for k, v in times.rows().items()}


async def _live(url: str, roles: tuple[str, ...]) -> dict[str, tuple[float, float]]:
    agents = [make_agent(url, f"e{i}", role, speedup=None) for i, role in enumerate(roles)]
    for a in agents:
        await a.start()
    client = await RolloutClient.connect(url, retry_after_s=60.0)
    clock = client.clock
    t0 = clock.monotonic_s()
    out: dict[str, tuple[float, float]] = {}

    async def one(i: int, arrival: float, prompt: int, n: int) -> None:
        await clock.sleep_s(t0 + arrival - clock.monotonic_s())
        traj = await client.start_trajectory(f"d{i}", task="coding", prompt_tokens=prompt)
        submitted = clock.monotonic_s()
        first: list[float] = []

        def on_tokens(ids: list[int]) -> None:
            if ids and not first:
                first.append(clock.monotonic_s())

        res = await generate_hinted(
            traj,
            [],
            SamplingParams(max_tokens=n, ignore_eos=True),
            WorkloadHint(prompt_len=prompt, output_tokens=n),
            on_tokens=on_tokens,
        )
        done = clock.monotonic_s()
        assert len(res.token_ids) == n
        out[f"d{i}"] = (first[0] - submitted, done - submitted)
        await traj.finish(reward=0.0)

    try:
        await asyncio.gather(*(one(i, *r) for i, r in enumerate(REQUESTS)))
    finally:
        await client.close()
        for a in agents:
            await a.stop()
    return out


@pytest.mark.parametrize(
    ("policy", "roles"), [("colocated", ("mixed",)), ("static:1:1", ("prefill", "decode"))]
)
async def test_live_engines_and_the_simulator_agree_per_request(
    nats_server, monkeypatch, policy: str, roles: tuple[str, ...]
) -> None:
    monkeypatch.setenv("PRORSA_TIME_SCALE", str(SCALE))
    sim = _simulated(policy, len(roles))
    for attempt in (1, 2):
        live = await _live(nats_server.url, roles)
        assert sorted(live) == sorted(sim) == [f"d{i}" for i in range(len(REQUESTS))]
        worst, out = 0.0, []
        for rid in sorted(sim):
            (ttft_l, e2e_l), (ttft_s, e2e_s) = live[rid], sim[rid]
            print(
                f"{policy} run {attempt} {rid}: ttft live {ttft_l:.3f} sim {ttft_s:.3f}; "
                f"finish live {e2e_l:.3f} sim {e2e_s:.3f}"
            )
            for got, want in ((ttft_l, ttft_s), (e2e_l, e2e_s)):
                if abs(got - want) > 0.3 + 0.1 * want:
                    out.append(f"{rid}: live {got:.3f} s vs simulated {want:.3f} s")
                worst = max(worst, abs(got - want) - 0.1 * want)
        print(f"{policy} run {attempt}: worst excess over 10 % {worst:.3f} s")
        if not out:
            return
    raise AssertionError(f"out of tolerance in both runs, the second: {out}")


@pytest.mark.parametrize(
    ("policy", "roles"),
    [("colocated", ("mixed", "mixed")), ("static:1:2", ("prefill", "decode", "decode"))],
)
async def test_live_placement_and_the_simulated_one_agree_on_average(
    nats_server, monkeypatch, policy: str, roles: tuple[str, ...]
) -> None:
    """Several engines of a role: which engine pulls which prompt or handoff. Live, that is a race between the
    engines' fetches at the server (each run assigns differently: one request's finish moved 1.21–1.60 s over four
    runs against 1.29 s simulated), so the requests are compared on average: mean TTFT and mean finish time within
    0.3 s + 10 %, as one request is above (one retry, as above)."""
    monkeypatch.setenv("PRORSA_TIME_SCALE", str(SCALE))
    sim = _simulated(policy, len(roles))
    for attempt in (1, 2):
        live = await _live(nats_server.url, roles)
        assert sorted(live) == sorted(sim) == [f"d{i}" for i in range(len(REQUESTS))]
        out = []
        for i, what in enumerate(("TTFT", "finish")):
            got = sum(v[i] for v in live.values()) / len(live)
            want = sum(v[i] for v in sim.values()) / len(sim)
            print(f"{policy} run {attempt} mean {what}: live {got:.3f} s, simulated {want:.3f} s")
            if abs(got - want) > 0.3 + 0.1 * want:
                out.append(f"mean {what}: live {got:.3f} s vs simulated {want:.3f} s")
        if not out:
            return
    raise AssertionError(f"out of tolerance in both runs, the second: {out}")
