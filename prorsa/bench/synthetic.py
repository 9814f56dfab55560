"""A synthetic, time-ordered stream of lifecycle and engine events, for benchmarks and tests of the tracker and
the forecaster (no engines, no simulator: every turn is decoded at a fixed per-sequence rate, uncapped).

Each trajectory: TrajectoryStarted -> per turn: TurnSubmitted, PrefillDone after `prefill_wait_s`, TokenProgress
every `progress_interval_s` while decoding at `decode_rate_tokens_per_s`, RequestFinished; then, except after the
last turn, ToolCallStarted, ToolCallFinished after an exponential tool latency, and the next TurnSubmitted;
finally TrajectoryFinished. Output and new-token counts are lognormal. Seeded: the same arguments give the same
stream.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import msgspec
import numpy as np

from proto import (
    PrefillDone,
    ProgressItem,
    RequestFinished,
    TokenProgress,
    ToolCallFinished,
    ToolCallStarted,
    TrajectoryFinished,
    TrajectoryStarted,
    TurnSubmitted,
)


@dataclass(frozen=True)
class SyntheticWorkload:
    trajectories: int = 200
    tasks: tuple[str, ...] = ("coding", "math")
    arrival_spread_s: float = 5.0  # first turns arrive uniformly over [0, spread)
    turns_mean: float = 6.0  # turns per trajectory: 1 + Poisson(turns_mean - 1)
    first_prompt_tokens: int = 2000
    output_tokens_median: float = 200.0
    new_tokens_median: float = 150.0
    tool_latency_mean_s: float = 1.0
    prefill_wait_s: float = 0.05
    decode_rate_tokens_per_s: float = 50.0
    progress_interval_s: float = 0.5
    seed: int = 0


def generate_events(w: SyntheticWorkload) -> list[tuple[float, object]]:
    """(time, event) pairs in time order."""
    rng = np.random.default_rng(w.seed)
    heap: list[tuple[float, int, object]] = []
    n = 0

    def push(t: float, ev: object) -> None:
        nonlocal n
        heapq.heappush(heap, (t, n, ev))
        n += 1

    for i in range(w.trajectories):
        _one_trajectory(w, rng, f"t{i}", w.tasks[i % len(w.tasks)], push, lambda _k: 0)
    # Number each source's events in time order, as a real client or engine does.
    seqs: dict[str, int] = {}
    out = []
    for t, _, ev in sorted(heap, key=lambda x: (x[0], x[1])):
        src = getattr(ev, "engine_id", None) or ev.source  # type: ignore[attr-defined]
        seqs[src] = seqs.get(src, 0) + 1
        out.append((t, msgspec.structs.replace(ev, seq=seqs[src])))
    return out


def _one_trajectory(w: SyntheticWorkload, rng: np.random.Generator, tid: str, task: str, push, nxt) -> None:  # noqa: ANN001
    t = float(rng.uniform(0.0, w.arrival_spread_s))
    push(
        t,
        TrajectoryStarted(
            traj_id=tid,
            ts_s=t,
            source="client",
            seq=nxt("client"),
            task=task,
            prompt_tokens=w.first_prompt_tokens,
        ),
    )
    turns = 1 + int(rng.poisson(max(0.0, w.turns_mean - 1.0)))
    context = 0
    for k in range(turns):
        new = (
            w.first_prompt_tokens if k == 0 else max(1, int(rng.lognormal(np.log(w.new_tokens_median), 0.5)))
        )
        prompt = context + new
        rid = f"{tid}:{k}"
        push(
            t,
            TurnSubmitted(
                traj_id=tid,
                ts_s=t,
                source="client",
                seq=nxt("client"),
                turn=k,
                request_id=rid,
                prompt_tokens=prompt,
                new_tokens=new,
            ),
        )
        t += w.prefill_wait_s
        push(
            t,
            PrefillDone(
                engine_id="pre",
                ts_s=t,
                seq=nxt("pre"),
                request_id=rid,
                traj_id=tid,
                turn=k,
                new_tokens=new,
                cached_tokens=prompt - new,
            ),
        )
        out = max(1, int(rng.lognormal(np.log(w.output_tokens_median), 0.7)))
        dur = out / w.decode_rate_tokens_per_s
        step = w.progress_interval_s
        j = 1
        while j * step < dur:
            g = int(j * step * w.decode_rate_tokens_per_s)
            push(
                t + j * step,
                TokenProgress(
                    engine_id="dec",
                    ts_s=t + j * step,
                    seq=nxt("dec"),
                    items=[ProgressItem(request_id=rid, traj_id=tid, turn=k, output_tokens=g)],
                ),
            )
            j += 1
        t += dur
        push(
            t,
            RequestFinished(
                engine_id="dec",
                ts_s=t,
                seq=nxt("dec"),
                request_id=rid,
                traj_id=tid,
                turn=k,
                prompt_tokens=prompt,
                cached_tokens=prompt - new,
                output_tokens=out,
                finish_reason="stop",
                ttft_s=w.prefill_wait_s,
                e2e_s=w.prefill_wait_s + dur,
            ),
        )
        context = prompt + out
        if k == turns - 1:
            break
        push(t, ToolCallStarted(traj_id=tid, ts_s=t, source="client", seq=nxt("client"), turn=k, tool="bash"))
        t += float(rng.exponential(w.tool_latency_mean_s))
        push(
            t,
            ToolCallFinished(
                traj_id=tid,
                ts_s=t,
                source="client",
                seq=nxt("client"),
                turn=k,
                tool="bash",
                observation_tokens=0,
            ),
        )
    push(t, TrajectoryFinished(traj_id=tid, ts_s=t, source="client", seq=nxt("client"), turns=turns))
