"""The rollout the fault campaign keeps running while it breaks things, and what it observes of it.

`Load` runs `concurrency` trajectories at all times through the client SDK (closed loop: a finished one is replaced
by a new one), each of `turns` model turns with a short tool call between them. Every result is checked against the
tokens the simulated engine must produce for that request (`SimTokens`, a pure function of the request id), so a
corrupted, truncated or spliced stream counts as a wrong result, never as a success.

It also listens on the bus like a bystander: every token chunk to its client (when and from which engine) and every
`RequestFinished` (a turn finished twice was computed twice). `progress_after` measures recovery from that: the time
until each request that was streaming at a fault makes progress again.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import proto
from prorsa.client import GenerateError, RolloutClient
from prorsa.client.client import ClusterSaturated
from prorsa.client.workload_hint import WorkloadHint, generate_hinted
from proto import RequestFinished, SamplingParams, TokenChunk
from services.engine_agent.backends.sim_tokens import SimTokens
from services.runtime.logging import get_logger

log = get_logger("fault_load", "campaign")


@dataclass(frozen=True, slots=True)
class LoadShape:
    concurrency: int = 12  # trajectories in flight at all times
    turns: int = 3
    output_tokens: int = 120  # per turn
    prompt_tokens: int = 1500  # first prompt; every later turn adds `observation_tokens`
    observation_tokens: int = 200
    tool_s: float = 2.0  # workload seconds of each tool call
    turn_timeout_s: float = 180.0  # wall seconds: a turn not done by then is lost


@dataclass
class Load:
    client: RolloutClient
    shape: LoadShape
    started: dict[str, float] = field(default_factory=dict)  # traj_id -> wall start
    finished: dict[str, float] = field(default_factory=dict)  # traj_id -> wall end
    lost_trajectories: dict[str, tuple[float, str]] = field(default_factory=dict)  # traj_id -> (when, why)
    turns_done: list[float] = field(default_factory=list)  # wall time of each good result
    lost_turns: list[tuple[float, str, str]] = field(default_factory=list)  # (when, request_id, why)
    wrong_results: list[tuple[float, str]] = field(default_factory=list)  # (when, request_id)
    # request_id -> (wall time, engine id, execution tag) of every chunk seen
    chunks: dict[str, list[tuple[float, str, str]]] = field(default_factory=lambda: defaultdict(list))
    finished_events: Counter[str] = field(default_factory=Counter)  # request_id -> RequestFinished seen
    recomputed: list[tuple[float, str]] = field(default_factory=list)  # (when, request_id) finished twice
    _ids: Any = field(default_factory=itertools.count)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def attach(self) -> None:
        nc, s = self.client.nc, self.client.subjects

        async def on_chunk(msg: Any) -> None:
            try:
                c = proto.decode_as(msg.data, TokenChunk, msg.subject)
            except proto.ProtoError:
                return
            self.chunks[c.request_id].append((time.monotonic(), c.engine_id, c.stream))

        async def on_event(msg: Any) -> None:
            try:
                ev = proto.decode(msg.data, msg.subject)
            except proto.ProtoError:
                return
            if isinstance(ev, RequestFinished):
                self.finished_events[ev.request_id] += 1
                if self.finished_events[ev.request_id] == 2:
                    self.recomputed.append((time.monotonic(), ev.request_id))

        await nc.subscribe(f"{s.reply(self.client.client_id)}.>", cb=on_chunk)
        await nc.subscribe(s.all_engine_events, cb=on_event)

    # --- running ----------------------------------------------------------------------------------------------
    async def run(self) -> None:
        """Keep `concurrency` trajectories going until `stop()`; then let those in flight finish."""
        await asyncio.gather(*(self._worker() for _ in range(self.shape.concurrency)))

    def stop(self) -> None:
        self._stop.set()

    async def _worker(self) -> None:
        while not self._stop.is_set():
            traj_id = f"f{next(self._ids)}"
            try:
                await self._trajectory(traj_id)
            except Exception as exc:  # noqa: BLE001 - counted as lost with its cause (the run then fails)
                # Without this a client error ended the worker silently: its trajectory stayed "in flight" with
                # no turn failed (f11526, issue 14) and the load ran one trajectory short from then on.
                self.lost_trajectories[traj_id] = (time.monotonic(), repr(exc)[:200])
                log.exception("trajectory_failed", traj_id=traj_id, error=repr(exc))

    async def _trajectory(self, traj_id: str) -> None:
        sh = self.shape
        self.started[traj_id] = time.monotonic()
        traj = await self.client.start_trajectory(traj_id, task="chaos")
        context = 0
        for k in range(sh.turns):
            context += sh.prompt_tokens if k == 0 else sh.observation_tokens
            request_id = f"{traj_id}:{k}"
            try:
                hint = WorkloadHint(
                    prompt_len=context,
                    output_tokens=sh.output_tokens,
                    cacheable_tokens=max(0, context - sh.observation_tokens),
                )
                res = await generate_hinted(
                    traj,
                    [],
                    SamplingParams(max_tokens=sh.output_tokens, ignore_eos=True),
                    hint,
                    timeout_s=sh.turn_timeout_s,
                )
            except (TimeoutError, GenerateError, ClusterSaturated) as exc:
                now = time.monotonic()
                self.lost_turns.append((now, request_id, repr(exc)[:200]))
                self.lost_trajectories[traj_id] = (now, repr(exc)[:200])
                await traj.finish(status="aborted")
                return
            tokens = SimTokens(request_id)
            want = [tokens.at(i)[0] for i in range(sh.output_tokens)]
            if res.token_ids != want:
                self.wrong_results.append((time.monotonic(), request_id))
                first = next(
                    (i for i, (x, y) in enumerate(zip(res.token_ids, want, strict=False)) if x != y), None
                )
                log.warning(
                    "wrong_result",
                    request_id=request_id,
                    tokens=len(res.token_ids),
                    first_mismatch=first,
                    restarts=res.restarts,
                    executions=sorted({tag for _, _, tag in self.chunks.get(request_id, [])}),
                )
            self.turns_done.append(time.monotonic())
            context += len(res.token_ids)
            if k + 1 < sh.turns:
                await traj.tool_started("tool")
                await self.client.clock.sleep_s(sh.tool_s)
                await traj.tool_finished("tool", observation_tokens=sh.observation_tokens)
        await traj.finish(reward=0.0)
        self.finished[traj_id] = time.monotonic()

    async def drain(self, timeout_s: float) -> list[str]:
        """Wait for the trajectories in flight to end; returns those still unfinished (lost) at the timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.in_flight():
                return []
            await asyncio.sleep(0.2)
        return self.in_flight()

    def in_flight(self) -> list[str]:
        return sorted(set(self.started) - set(self.finished) - set(self.lost_trajectories))

    # --- observing --------------------------------------------------------------------------------------------
    def streaming(self, engine_id: str | None = None) -> list[str]:
        """Requests in flight with at least one chunk (the last from `engine_id`, when given)."""
        out = []
        for rid, pending in list(self.client._pending.items()):
            if pending.done.done() or not self.chunks.get(rid):
                continue
            if engine_id is None or self.chunks[rid][-1][1] == engine_id:
                out.append(rid)
        return out

    async def progress_after(
        self, request_ids: list[str], t0: float, timeout_s: float, new_execution: bool = False
    ) -> float | None:
        """Wall seconds from `t0` until every request in `request_ids` got a chunk after `t0` (with
        `new_execution`: from another execution than its last one before — the chunks a killed engine had sent
        before it died do not count) or ended; None if one of them did not within `timeout_s` (stuck)."""
        before = {r: self.chunks[r][-1][2] if self.chunks.get(r) else None for r in request_ids}
        deadline = t0 + timeout_s
        moved: dict[str, float] = {}
        while True:
            now = time.monotonic()
            for r in request_ids:
                if (
                    r not in moved
                    and (m := self._moved(r, t0, before[r] if new_execution else None)) is not None
                ):
                    moved[r] = m
            if len(moved) == len(request_ids):
                return max(moved.values(), default=now) - t0
            if now > deadline:
                return None
            await asyncio.sleep(0.05)

    def _moved(self, request_id: str, t0: float, old_execution: str | None) -> float | None:
        after = [t for t, _, tag in self.chunks.get(request_id, []) if t > t0 and tag != old_execution]
        if after:
            return after[0]
        pending = self.client._pending.get(request_id)
        return time.monotonic() if pending is None or pending.done.done() else None

    def progress_since(self, t0: float) -> int:
        return sum(1 for t in self.turns_done if t > t0)
