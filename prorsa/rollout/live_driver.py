"""The live RL driver: replays a workload's trajectories over the live system through the client SDK.

(Its twin in the simulator, in virtual time, is `prorsa/sim/sim_driver.py`.)

Each trajectory runs as its own task: turn k is submitted once turn k−1's output is back and its tool call (the
trace's or profile's latency) has finished; its prompt is the whole history (for real engines: the previous prompt,
the output ids the engine returned, and random ids standing for the tool's observation).

RL modes (the same semantics as the simulator's):
- sync (on-policy): a step's batch must all finish; then the trainer trains for `training_s` while rollout idles;
  then a weights update (`PolicyVersionUpdate`, version + 1) and the next step.
- async with staleness k: the next step starts as soon as a step's batch is done, while training runs alongside;
  a trajectory whose policy version falls more than k versions behind is aborted when it next submits a turn and
  restarted under the new weights (counted in `restarts`; the rule is `prorsa.staleness`, the simulator's too).
A trajectory starts `arrival_s` after its step does, as in the simulator.

Times are read from the client's clock (`client.clock`, the shared scaled clock of `services.runtime.clock`): with
simulated engines at a speed-up the whole system runs PRORSA_TIME_SCALE workload seconds per wall second, so tool
latencies, training phases and every reported duration are in workload seconds.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

import proto
from prorsa.client import GenerateError, RolloutClient
from prorsa.client.workload_hint import WorkloadHint, generate_hinted
from prorsa.rollout.metrics import RolloutMetrics, TrajectoryRecord
from prorsa.staleness import must_restart
from prorsa.workload.types import TrajectorySpec
from proto import PolicyVersionUpdate, SamplingParams
from services.runtime.logging import get_logger

log = get_logger("rollout_driver", "main")


@dataclass(frozen=True)
class RolloutConfig:
    steps: int = 1
    mode: str = "sync"  # "sync" | "async"
    staleness: int = 0
    training_s: float = 30.0  # virtual seconds per training phase
    send_token_ids: bool = False  # real engines need ids; the simulated backend only needs lengths
    token_scale: float = 1.0  # multiply every token count (fits a trace to a tiny real model)
    vocab_size: int = 32000
    seed: int = 0
    turn_timeout_s: float = 600.0


ProgressFn = Callable[[str, int, int], None]  # (what, done, total)


class RolloutDriver:
    def __init__(
        self, client: RolloutClient, config: RolloutConfig, progress: ProgressFn | None = None
    ) -> None:
        self.client = client
        self.clock = client.clock  # the client's: the turns it stamps and the durations here share one scale
        self.config = config
        self.progress = progress or (lambda what, done, total: None)
        self.metrics = RolloutMetrics()
        self.version = 0
        self._t0 = 0.0
        self._rng = np.random.default_rng(config.seed)
        self._done = 0

    def now_v(self) -> float:
        """Virtual seconds since the rollout began."""
        return self.clock.monotonic_s() - self._t0

    async def run(self, steps: list[list[TrajectorySpec]]) -> RolloutMetrics:
        self._t0 = self.clock.monotonic_s()
        total = sum(len(s) for s in steps)
        for i, batch in enumerate(steps):
            for spec in batch:
                self.metrics.records[spec.traj_id] = TrajectoryRecord(
                    spec.traj_id, i, spec.task, len(spec.turns)
                )
        training: asyncio.Task | None = None
        for batch in steps:
            t_step = self.now_v()
            await asyncio.gather(*(self._trajectory(spec, total, t_step) for spec in batch))
            self.metrics.step_rollout_s.append(self.now_v() - t_step)
            if self.config.mode == "sync":
                await self._train()
            else:
                if training is not None:
                    await training  # one training phase at a time: the trainer is a single job
                training = asyncio.create_task(self._train())
        if training is not None:
            await training
        self.metrics.total_s = self.now_v()
        return self.metrics

    async def _train(self) -> None:
        await self.clock.sleep_s(self.config.training_s)
        self.version += 1
        # Async mode trains while turns run: load between engine steps (tokens stamped with their version) rather
        # than stop pulling until held turns end. Sync mode updates between steps, with nothing to drain.
        mode = "inflight" if self.config.mode == "async" else "drain"
        update = PolicyVersionUpdate(version=self.version, ts_s=self.clock.now_s(), mode=mode)
        await self.client.nc.publish(self.client.subjects.policy_version, proto.encode(update))

    async def _trajectory(self, spec: TrajectorySpec, total: int, t_step: float) -> None:
        """Run one trajectory from its arrival (`arrival_s` after its step began, as the simulator submits it)."""
        rec = self.metrics.records[spec.traj_id]
        await self.clock.sleep_s(t_step + spec.arrival_s - self.now_v())
        rec.start_s = self.now_v()
        attempt = 0
        while not await self._attempt(spec, rec, attempt):
            attempt += 1
            rec.restarts += 1
        rec.end_s = self.now_v()
        rec.completed = True
        self._done += 1
        self.progress("trajectories", self._done, total)

    async def _attempt(self, spec: TrajectorySpec, rec: TrajectoryRecord, attempt: int) -> bool:
        """Run every turn; False if the trajectory went too stale (async mode) and must restart."""
        cfg = self.config
        version = self.version
        traj_id = spec.traj_id if attempt == 0 else f"{spec.traj_id}-r{attempt}"
        traj = await self.client.start_trajectory(
            traj_id,
            task=spec.task,
            policy_version=version,
            group=spec.group,
            prompt_tokens=self._scaled(spec.turns[0].new_prompt_tokens),
        )
        ids: list[int] = []
        context = 0
        rec.turns_done = rec.prompt_tokens = rec.cached_tokens = rec.output_tokens = rec.tool_calls = 0
        rec.ttft_s = rec.generate_s = rec.tool_s = 0.0
        for k, turn in enumerate(spec.turns):
            if must_restart(cfg.mode, cfg.staleness, self.version, version):
                await traj.finish(status="aborted")
                return False
            new = self._scaled(turn.new_prompt_tokens) if k else max(1, self._scaled(turn.new_prompt_tokens))
            if cfg.send_token_ids:
                ids = ids + self._rng.integers(1, cfg.vocab_size, size=new).tolist()
            cacheable = context
            context += new
            out_tokens = max(1, self._scaled(turn.output_tokens))
            t_submit = self.now_v()
            try:
                res = await generate_hinted(
                    traj,
                    ids,
                    SamplingParams(max_tokens=out_tokens, ignore_eos=True, seed=cfg.seed),
                    WorkloadHint(prompt_len=context, output_tokens=out_tokens, cacheable_tokens=cacheable),
                    timeout_s=cfg.turn_timeout_s,
                )
            except GenerateError as exc:
                # The context outgrew the model (the engine says so): the trajectory ends here, as an agent
                # loop ends one whose context is full; retrying the same prompt cannot succeed.
                log.warning("trajectory_truncated", traj_id=traj_id, turn=k, error=str(exc))
                rec.truncated = True
                break
            if cfg.send_token_ids:
                ids = ids + list(res.token_ids)
            context += len(res.token_ids)
            rec.turns_done += 1
            rec.ttft_s += res.ttft_s
            rec.generate_s += self.now_v() - t_submit
            rec.prompt_tokens += res.prompt_tokens
            rec.cached_tokens += res.cached_tokens
            rec.output_tokens += len(res.token_ids)
            if k + 1 < len(spec.turns):
                await traj.tool_started("tool")
                t_tool = self.now_v()
                await self.clock.sleep_s(turn.tool_latency_s)
                rec.tool_s += self.now_v() - t_tool
                rec.tool_calls += 1
                await traj.tool_finished(
                    "tool", observation_tokens=self._scaled(spec.turns[k + 1].new_prompt_tokens)
                )
        await traj.finish(reward=0.0)
        return True

    def _scaled(self, tokens: int) -> int:
        return int(round(tokens * self.config.token_scale))
