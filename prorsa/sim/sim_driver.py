"""The simulator's RL driver: submits every step's trajectories turn by turn, and runs the trainer's clock.

(Its twin over the live system is `prorsa/rollout/live_driver.py`.)

A trajectory's turn 0 is submitted at its step's start + `arrival_s`; turn k when turn k−1's output is done plus
that turn's tool latency. A trajectory completes when its last turn's output is done.

Modes:
* `sync`: a step's whole batch must finish; then the trainer trains for `training_s` while rollout idles; then
  the weights update (policy version + 1, every prefix cache cleared) and the next step starts.
* `async` with staleness k: when a step's batch has finished, the next step is submitted at once (rollout goes on
  while the trainer trains; batches queue for the trainer in order). A trajectory started more than k versions
  ago restarts from turn 0 under the new weights when it next submits a turn (`prorsa.staleness`, the rule the
  live driver applies too; work done so far is counted as wasted). Since a step is submitted only when the
  previous batch is done, k = 0 restarts the trajectories that overlap a training phase; k ≥ 1 restarts only when
  training falls more than k batches behind rollout.
The run ends when `steps` batches have been trained, or at `duration_s` of virtual time, whichever comes first.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Protocol

from mypy_extensions import mypyc_attr

from prorsa.sim import events as ev
from prorsa.sim.state import Request, Traj
from prorsa.staleness import must_restart
from prorsa.workload.types import TrajectorySpec

if TYPE_CHECKING:
    from prorsa.sim.core import Simulation

MODES = ("sync", "async")


class StepSource(Protocol):
    """What the driver needs of a workload (prorsa.workload.spec.Workload satisfies it)."""

    name: str

    def step(self, index: int) -> list[TrajectorySpec]: ...


@mypyc_attr(allow_interpreted_subclasses=True)  # deep-copied by `Simulation.fork` (see `prorsa.native`)
class Driver:
    """Submission of turns, completion bookkeeping, training phases and policy versions."""

    def __init__(self, sim: Simulation, workload: StepSource, steps: int | None) -> None:
        self.sim = sim
        self.workload = workload
        self.steps = steps  # None: until the duration cap
        self.version = 0
        self.next_step = 0  # index of the next step to submit
        self.live: dict[int, int] = {}  # step → trajectories not yet finished
        self.live_trajs: dict[int, Traj] = {}  # id(traj) → traj, for aborts
        self.trained = 0  # batches trained
        self.trainer_busy = False
        self.train_queue: deque[int] = deque()
        self.finished_s: float | None = None  # when the last batch finished training
        self.expected = 0  # trajectories submitted (restarts not counted twice)
        self._next_rid = 0
        self._max_model_len = sim.config.max_model_len
        self._metrics = sim.metrics

    # -- steps ------------------------------------------------------------------------------------------------------

    def start(self, now: float) -> None:
        self._submit_step(now)

    def _submit_step(self, now: float) -> None:
        index = self.next_step
        self.next_step += 1
        specs = self.workload.step(index)
        if not specs:
            raise ValueError(f"workload {self.workload.name} gave an empty step {index}")
        self.live[index] = len(specs)
        self.expected += len(specs)
        for spec in specs:
            self._start_attempt(spec, index, 0, now + spec.arrival_s)

    def _start_attempt(self, spec: TrajectorySpec, step: int, attempt: int, at_s: float) -> None:
        group_key = f"{step}:{spec.group}" if spec.group else ""
        traj = Traj(
            spec=spec,
            step=step,
            attempt=attempt,
            version=self.version,  # set again when turn 0 is submitted
            key=f"{step}:{spec.traj_id}:{attempt}",
            group_key=group_key,
            group_tokens=spec.turns[0].new_prompt_tokens if group_key else 0,
            context_tokens=spec.turns[0].new_prompt_tokens,
        )
        self.live_trajs[id(traj)] = traj
        self.sim.queue.push(at_s, ev.ARRIVAL, traj, attempt)

    def _wants_more_steps(self) -> bool:
        return self.steps is None or self.next_step < self.steps

    # -- turns ------------------------------------------------------------------------------------------------------

    def on_arrival(self, traj: Traj, now: float) -> None:
        """Submit the trajectory's current turn."""
        if not traj.alive:
            return  # aborted while in a tool call
        sim = self.sim
        turn = traj.spec.turns[traj.turn]
        observed = sim.observer is not None
        config = sim.config
        if traj.turn and must_restart(config.mode, config.staleness, self.version, traj.version):
            self._abort(traj, now)
            return
        if traj.turn == 0:
            traj.start_s = now
            traj.version = self.version
            sim.metrics.trajectories_started += 1
            if observed:
                sim.emit(
                    ev.TRAJECTORY_STARTED,
                    traj,
                    now,
                    step=traj.step,
                    task=traj.spec.task,
                    group=traj.spec.group,
                    policy_version=traj.version,
                    prompt_tokens=traj.context_tokens,
                    turns=len(traj.spec.turns),
                )
        elif observed:
            sim.emit(ev.TOOL_CALL_END, traj, now, turn=traj.turn - 1)
        if traj.context_tokens > self._max_model_len:
            # The engine would reject the prompt: the trajectory ends here, as the live driver ends it.
            sim.metrics.trajectories_truncated += 1
            self._trajectory_done(traj, now, turns_done=traj.turn)
            return
        self._next_rid += 1
        req = Request(self._next_rid, traj, traj.turn, traj.context_tokens, turn.output_tokens)
        traj.request = req
        metrics, new_tokens = self._metrics, turn.new_prompt_tokens  # turns submitted and the demand row
        metrics.turns_submitted += 1
        metrics.new_prompt_tokens += new_tokens
        row, index = metrics.demand_row, int(now / metrics.window_s)
        if len(row) <= index:
            row.extend([0.0] * (index + 1 - len(row)))
        row[index] += new_tokens
        if observed:
            sim.emit(
                ev.TURN_SUBMITTED,
                traj,
                now,
                turn=traj.turn,
                context_tokens=traj.context_tokens,
                new_tokens=turn.new_prompt_tokens,
            )
        sim.router.route_prefill(req, now)

    def on_turn_done(self, req: Request, now: float) -> None:
        traj = req.traj
        turns = traj.spec.turns
        k = traj.turn
        turn = turns[k]
        traj.request = None
        traj.decoded_tokens += req.output_tokens  # a migrated request carries only what was left to decode
        metrics = self._metrics
        metrics.turns_finished += 1
        metrics.finished_output_tokens += turn.output_tokens
        if k + 1 == len(turns):
            self._trajectory_done(traj, now)
            return
        traj.context_tokens += turn.output_tokens + turns[k + 1].new_prompt_tokens
        traj.turn = k + 1
        if self.sim.observer is not None:
            self.sim.emit(ev.TOOL_CALL_START, traj, now, turn=k, latency_s=turn.tool_latency_s)
        self.sim.queue.push(now + turn.tool_latency_s, ev.ARRIVAL, traj, traj.attempt)

    def _trajectory_done(self, traj: Traj, now: float, turns_done: int | None = None) -> None:
        traj.alive = False
        del self.live_trajs[id(traj)]
        completion = now - traj.start_s
        self.sim.metrics.completion.add(completion)
        self.sim.metrics.trajectories_completed += 1
        if self.sim.observer is not None:
            turns = len(traj.spec.turns) if turns_done is None else turns_done
            self.sim.emit(ev.TRAJECTORY_FINISHED, traj, now, turns=turns, completion_s=completion)
        self.live[traj.step] -= 1
        if self.live[traj.step] == 0:
            del self.live[traj.step]
            self._batch_done(traj.step, now)

    # -- training ---------------------------------------------------------------------------------------------------

    def _batch_done(self, step: int, now: float) -> None:
        self.train_queue.append(step)
        self._start_training(now)
        if self.sim.config.mode == "async" and self._wants_more_steps():
            self._submit_step(now)

    def _start_training(self, now: float) -> None:
        if self.trainer_busy or not self.train_queue:
            return
        step = self.train_queue.popleft()
        self.trainer_busy = True
        self.sim.queue.push(now + self.sim.config.training_s, ev.TRAINING_DONE, step)

    def on_training_done(self, step: int, now: float) -> None:
        self.trainer_busy = False
        self.trained += 1
        self.version += 1
        self.sim.weights_updated(now)
        if self.steps is not None and self.trained >= self.steps:
            self.finished_s = now
            return
        if self.sim.config.mode == "sync":
            self._submit_step(now)
        else:
            self._start_training(now)

    def _abort(self, traj: Traj, now: float) -> None:
        traj.alive = False
        del self.live_trajs[id(traj)]
        metrics = self.sim.metrics
        metrics.trajectories_aborted += 1
        metrics.wasted_decoded_tokens += traj.decoded_tokens
        self.sim.emit(ev.TRAJECTORY_ABORTED, traj, now, reason="stale", policy_version=traj.version)
        self._start_attempt(traj.spec, traj.step, traj.attempt + 1, now)

    def new_rid(self) -> int:
        self._next_rid += 1
        return self._next_rid

    @property
    def done(self) -> bool:
        return self.finished_s is not None
