"""The true demand outlook for a truth-fed run (`prorsa.sim.truth_feed`): what `proto.TaskOutlook` would say with
no error.

Two halves, both from simulator events:
  * the present (`LivePhases`), this run's own: live trajectories per task by phase (queued at the start, prefill
    from each turn's submission or a migration's re-prefill, decode from its decode's start, tool_call from the
    tool call's start, gone when finished or aborted) and the trajectories started so far — facts the tracker
    would report, not forecasts;
  * the turns ahead (`TurnRecord`, frozen into `TurnTruth`), the recorded run's: every turn's submission time,
    task, new tokens, context and output tokens, every tool call's start and latency, every trajectory's finish.
    Seen from `now`, over (now, now + h]: the turns submitted then (their figures' mean and quantiles, `observed`
    their number), the tool calls started then, the trajectories that finished then — exact counts (q10 = q50 =
    q90). As with the forecast's truth, "the truth" is a nearby run's, exact only while the decisions are that
    run's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from proto import MAX_OUTLOOK_S, MAX_OUTLOOK_TOKENS, Estimate, TaskOutlook
from services.forecaster.outlook import outlook_row, sample_estimate

PHASES = ("queued", "prefill", "decode", "tool_call")
_PHASE_OF = {
    "trajectory_started": 0,
    "turn_submitted": 1,
    "request_migrated": 1,
    "decode_started": 2,
    "tool_call_start": 3,
}
_GONE = frozenset({"trajectory_finished", "trajectory_aborted"})


class LivePhases:
    """This run's live trajectories per task by phase, and its trajectories started (module header)."""

    def __init__(self) -> None:
        self.started_total = 0
        self.tasks: dict[str, list[int]] = {}  # task -> live per phase, tasks in order of first start
        self._where: dict[tuple[str, int], tuple[str, int]] = {}  # (traj, attempt) -> (task, phase)
        self._task: dict[str, str] = {}  # traj -> task

    def on_event(self, kind: str, traj_id: str, attempt: int, f: dict[str, Any]) -> None:
        key = (traj_id, attempt)
        if kind == "trajectory_started":
            self.started_total += 1
            self._task[traj_id] = task = str(f.get("task", ""))
            self.tasks.setdefault(task, [0] * len(PHASES))
        phase = _PHASE_OF.get(kind)
        if phase is not None:
            was = self._where.get(key)
            task = was[0] if was is not None else self._task.get(traj_id, "")
            if was is not None:
                self.tasks[task][was[1]] -= 1
            self.tasks.setdefault(task, [0] * len(PHASES))[phase] += 1
            self._where[key] = (task, phase)
        elif kind in _GONE:
            was = self._where.pop(key, None)
            if was is not None:
                self.tasks[was[0]][was[1]] -= 1


@dataclasses.dataclass(frozen=True)
class _Series:
    """One task's recorded events in time order: times and, per figure, one value each."""

    t: np.ndarray
    values: dict[str, np.ndarray]

    def between(self, a: float, b: float) -> tuple[int, int]:
        i, j = np.searchsorted(self.t, [a, b], side="right")
        return int(i), int(j)


def _series(rows: list[tuple[float, ...]], names: tuple[str, ...]) -> _Series:
    arr = np.array(rows, dtype=np.float64).reshape(-1, 1 + len(names))
    order = np.argsort(arr[:, 0], kind="stable")
    arr = arr[order]
    return _Series(arr[:, 0], {n: arr[:, k + 1] for k, n in enumerate(names)})


_EMPTY = _Series(np.zeros(0), {})


@dataclasses.dataclass(frozen=True)
class TurnTruth:
    """The recorded run's turns, tool calls and finishes per task, frozen for queries (`outlook`)."""

    turns: dict[
        str, _Series
    ]  # values: new_tokens, context_tokens, output_tokens (NaN: its decode never began)
    tools: dict[str, _Series]  # values: tool_s
    finishes: dict[str, _Series]

    def outlook(self, now: float, horizon_s: float, present: LivePhases) -> list[TaskOutlook]:
        """Per task live now (this run), its turns over (now, now + horizon_s] (the recorded run)."""
        out = []
        for task, phases in present.tasks.items():
            live = sum(phases)
            if live <= 0:
                continue
            turns = self.turns.get(task, _EMPTY)
            i, j = turns.between(now, now + horizon_s)
            ti, tj = (tools := self.tools.get(task, _EMPTY)).between(now, now + horizon_s)
            fi, fj = self.finishes.get(task, _EMPTY).between(now, now + horizon_s)

            def figure(series: _Series, name: str, a: int, b: int, limit: float) -> Estimate:
                return (
                    sample_estimate(series.values[name][a:b], limit) if b > a else sample_estimate((), limit)
                )

            out.append(
                outlook_row(
                    task,
                    np.array(phases),
                    turns=_exact(j - i, live),
                    finished=_exact(fj - fi, live),
                    new_tokens=figure(turns, "new_tokens", i, j, MAX_OUTLOOK_TOKENS),
                    output_tokens=figure(turns, "output_tokens", i, j, MAX_OUTLOOK_TOKENS),
                    context_tokens=figure(turns, "context_tokens", i, j, MAX_OUTLOOK_TOKENS),
                    tool_s=figure(tools, "tool_s", ti, tj, MAX_OUTLOOK_S),
                )
            )
        return out


def _exact(count: int, observed: int) -> Estimate:
    v = float(count)
    return Estimate(mean=v, q10=v, q50=v, q90=v, observed=observed)


class TurnRecord:
    """Records one run's turns, tool calls and finishes per task (module header); `freeze` for the next run."""

    def __init__(self) -> None:
        self._task: dict[str, str] = {}
        self._turns: dict[str, list[list[float]]] = {}  # task -> [t, new, context, output]
        self._open: dict[
            tuple[str, int, int], list[float]
        ] = {}  # (traj, attempt, turn) -> its row (no output yet)
        self._tools: dict[str, list[tuple[float, float]]] = {}
        self._finishes: dict[str, list[tuple[float]]] = {}

    def on_event(self, kind: str, traj_id: str, now: float, attempt: int, f: dict[str, Any]) -> None:
        if kind == "trajectory_started":
            self._task[traj_id] = str(f.get("task", ""))
            return
        task = self._task.get(traj_id, "")
        if kind == "turn_submitted":
            row = [now, float(f["new_tokens"]), float(f["context_tokens"]), np.nan]
            self._turns.setdefault(task, []).append(row)
            self._open[(traj_id, attempt, int(f["turn"]))] = row
        elif kind == "decode_started":
            row = self._open.pop((traj_id, attempt, int(f["turn"])), None)
            if row is not None:  # the turn's first decode: its whole output (a migrated one decodes the rest)
                row[3] = float(f["output_tokens"])
        elif kind == "tool_call_start":
            self._tools.setdefault(task, []).append((now, float(f["latency_s"])))
        elif kind == "trajectory_finished":
            self._finishes.setdefault(task, []).append((now,))

    def freeze(self) -> TurnTruth:
        return TurnTruth(
            turns={
                k: _series([tuple(r) for r in v], ("new_tokens", "context_tokens", "output_tokens"))
                for k, v in self._turns.items()
            },
            tools={k: _series(v, ("tool_s",)) for k, v in self._tools.items()},
            finishes={k: _series(v, ()) for k, v in self._finishes.items()},
        )
