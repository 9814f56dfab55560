"""What the last RL step of a task mix looked like, replayed through the turn model when the next one starts.

Pure. An RL rollout repeats itself: every step submits a fresh batch of trajectories of the same task mix, and
the batch goes through the same phases — a burst of first prompts, a loop whose contexts grow turn by turn, a tail
where the last trajectories finish. A split chosen in the middle of a step pays for the move (drained work, prefix
caches the new prefill engines must rebuild: tens of thousands of tokens per trajectory late in a step), so the
mid-step decision rightly holds back from moves whose gain is near the model's error. At a step's start those costs
are gone: the trajectories are new, so no engine holds a prefix worth keeping (and a synchronous step follows a
weights update, which clears every cache). That is when the split for the whole step should be chosen, and the
best guide to the coming step is the last one of the same task mix.

So `StepMemory` records, decision by decision while a step runs, the loop as the policy measured it: turns
submitted, the mean turn (`TurnShape`) and the live population N. When the next step of the same mix starts, the
policy replays that record through the turn model for every candidate split — the turn-seconds the step would
take, Σ turns_i × R(split, shape_i, N_i) — and starts the step on the split with the least, when it promises more
than a margin (prorsa.py `_plan_step`). The record keeps the population N of the run it saw; a faster split would
drain that population sooner, which the replay ignores: it prices the same turns at the same concurrency, the
order in which splits compare.

The model is not equally right about every split: on profile:general · mimo-v2.5-pro at staleness 2 it projects
colocation within 4 % and a 2:6 split 24 % too fast, and where a split with few prefill engines tips into the
congested branch (turn_model) its uncongested projection is far too fast. So each step also leaves, for the split
that ran most of it, the ratio of the turn-seconds really lived — N integrated over time, exact by Little's law
however noisy each window was — to those the model projected (`ratio`; `model_error` is the same over the whole
step, whatever ran). The replay scales each candidate's cost by its own ratio where that split has run a step of
this mix, else by the ratio of the nearest split of the same branch of the model that has (the model's bias moves
with the split: neighbours share most of it; colocation and splits are different networks) — and a split never
measured is tried only where the try measures what it was chosen for: the coming step's mix is known
(`next_known`), or the model explained the record within the margin. A wrong first move thus costs one step: that
step measures the split, and the next replay compares measured costs — or the step's own decisions leave it
before it has run most of the step, which is the step's verdict on it, and it is not tried again (`tried`).

Between synchronous steps the cluster idles while the trainer trains: nobody is live, the next step's mix is
(most likely) the one that followed this mix last time (`expected_next`), and a move costs nothing at all, not even
the seconds its movers spend switching while the first prompts arrive (which also lets those prompts spread over
every engine instead of landing on the few that serve at once). So the policy replays then, and again when the
step starts if its mix turns out to be another.

A step start is seen in the forecast's outlook (`outlook.py`; the forecaster passes on the tracker's counts): at
least `FRESH_SHARE` of the live trajectories are new, started since the last decision (the tracker counts starts:
`started_total`; trajectories that join later, a step's stragglers in arrival, are a minority of the live ones and
join the running step). So a step triggers once, in
both RL modes (a synchronous step follows an empty cluster; an asynchronous one is submitted the moment the last
batch ends), however its arrivals are spread.
The task mix is the set of tasks holding at least `TASK_SHARE` of the live trajectories: an alternating mix
(math steps, then general ones) keeps one record per task, a mix within steps one record for both.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field

from services.allocator.policies.turn_model import TurnShape

FRESH_SHARE = 0.5  # a step has started when at least this share of the live trajectories is new
TASK_SHARE = 0.1  # a task belongs to the mix when it holds at least this share of the live trajectories
SEGMENTS = 16  # a record is kept as this many segments of equal turns (the replay's cost is per segment)


@dataclass(frozen=True, slots=True)
class Segment:
    """A stretch of a step: `turns` turns of mean shape `shape` while `live` trajectories were live; `lived_s`
    trajectory-seconds passed in it (N × its length: by Little's law the turn-seconds it really took) and the model
    projected `projected_s` turn-seconds for them under the split that ran."""

    turns: float
    shape: TurnShape
    live: float
    lived_s: float = 0.0
    projected_s: float = 0.0


@dataclass
class StepMemory:
    """Records each step's loop and hands back the last record of the same task mix (module doc)."""

    records: dict[tuple[str, ...], list[Segment]] = field(default_factory=dict)
    _started_seen: int = 0  # the tracker's started_total at the last decision
    _mix: tuple[str, ...] | None = None  # the mix of the step being recorded (None: no step running)
    _last_mix: tuple[str, ...] | None = None  # the mix of the last step that started
    _follows: dict[tuple[str, ...], tuple[str, ...]] = field(default_factory=dict)  # mix → the mix after it
    _ticks: list[Segment] = field(default_factory=list)
    # (mix, split) → lived / projected over the last step of the mix that the split ran (`ratio`)
    calibration: dict[tuple[tuple[str, ...], Hashable], float] = field(default_factory=dict)
    _split_sums: dict[Hashable, list[float]] = field(
        default_factory=dict
    )  # split → [turns, lived, projected]
    # (mix, split): a split a replay sent a step of `mix` to before any step of the mix had measured it (`tried`)
    trials: set[tuple[tuple[str, ...], Hashable]] = field(default_factory=set)

    def step_started(self, started_total: int, live_by_task: Mapping[str, int]) -> tuple[str, ...] | None:
        """The task mix of a step that starts now (once per step), else None. Closes the record of the last one.
        `started_total`: the tracker's count of trajectories started; `live_by_task`: live trajectories per task
        (both from the forecast's outlook). Nobody live ends the running step (a synchronous step, before the
        trainer's turn)."""
        # From counters alone (no pass over trajectories: this runs at every decision, with up to 10k live): the
        # trajectories started since the last decision are the tracker's `started_total` minus the last one seen.
        # Those that start and end between two decisions count as new too: a step whose trajectories live less
        # than a decision interval is all new anyway.
        new = started_total - self._started_seen
        # (A tracker restarted without its checkpoint counts from 0 again: a negative `new` is no step start.)
        self._started_seen = started_total
        live = sum(live_by_task.values())
        if not live:
            self._close()
            return None
        if new < FRESH_SHARE * live:
            return None  # latecomers of the running step
        self._close()
        mix = tuple(sorted(task for task, n in live_by_task.items() if n >= TASK_SHARE * live))
        if self._last_mix is not None:
            self._follows[self._last_mix] = mix
        self._mix = self._last_mix = mix
        return mix

    @property
    def recording(self) -> bool:
        """A step is running and `record` keeps what it is given."""
        return self._mix is not None

    def expected_next(self) -> tuple[str, ...] | None:
        """The mix the next step will most likely have: the one that followed the last step's mix last time
        (an alternating mix), else the last step's own; None before any step."""
        if self._last_mix is None:
            return None
        return self._follows.get(self._last_mix, self._last_mix)

    def next_known(self) -> bool:
        """A step of the last step's mix has been followed by another step before (`expected_next` is seen)."""
        return self._last_mix is not None and self._last_mix in self._follows

    def record(
        self, turns: float, shape: TurnShape, live: float, lived_s: float, projected_s: float, split: Hashable
    ) -> None:
        """One decision's measurement of the running step: turns submitted since the last, the mean turn, N, the
        trajectory-seconds lived since the last and the turn-seconds the model projected for those turns under
        `split`, the split that ran."""
        if self._mix is not None and turns > 0 and live > 0:
            self._ticks.append(Segment(turns, shape, live, lived_s, projected_s))
            sums = self._split_sums.setdefault(split, [0.0, 0.0, 0.0])
            sums[0] += turns
            sums[1] += lived_s
            sums[2] += projected_s

    def running(self, split: Hashable) -> tuple[float, float] | None:
        """(turns, lived / projected) of the running step so far under `split`: how well the model explains the
        step while it runs; None before it has run a turn there."""
        sums = self._split_sums.get(split) if self._mix is not None else None
        if not sums or sums[0] <= 0:
            return None
        bias = _lived_over_projected(sums)
        return None if bias is None else (sums[0], bias)

    def ratio(self, mix: tuple[str, ...], split: Hashable) -> float | None:
        """Turn-seconds lived / projected over the last step of `mix` that `split` ran (most of): the model's bias
        on that split, or None if it never ran one."""
        return self.calibration.get((mix, split))

    def measured(self, mix: tuple[str, ...]) -> dict[Hashable, float]:
        """Every split that ran a step of `mix`, with its ratio (`ratio`)."""
        return {split: r for (m, split), r in self.calibration.items() if m == mix}

    def note_trial(self, mix: tuple[str, ...], split: Hashable) -> None:
        """A replay sends the coming step of `mix` to `split`, which no step of the mix has measured."""
        self.trials.add((mix, split))

    def tried(self, mix: tuple[str, ...], split: Hashable) -> bool:
        """Whether a step of `mix` was sent to `split` and did not measure it: the step's own decisions left it
        before it ran most of the step (`_close` measures only the split that did), so the step's verdict on it
        is that it lost — a try is not made twice."""
        return (mix, split) in self.trials and (mix, split) not in self.calibration

    def last(self, mix: tuple[str, ...]) -> list[Segment] | None:
        """The record of the last finished step of `mix`, or None."""
        return self.records.get(mix)

    def _close(self) -> None:
        if self._mix is not None and self._ticks:
            self.records[self._mix] = compress(self._ticks, SEGMENTS)
            total = sum(t.turns for t in self._ticks)
            for split, sums in self._split_sums.items():
                # Only the split that ran most of the step: a few windows around a move (a step's first
                # prompts, say) say nothing about its bias over a step.
                bias = _lived_over_projected(sums)
                if 2.0 * sums[0] >= total and bias is not None:
                    self.calibration[(self._mix, split)] = bias
        self._ticks = []
        self._split_sums = {}
        self._mix = None


def _lived_over_projected(sums: list[float]) -> float | None:
    """A split's [turns, lived, projected] sums as the model's bias on it, None where they say nothing."""
    _, lived, projected = sums
    return lived / projected if lived > 0 and 0 < projected < math.inf else None


def compress(ticks: list[Segment], segments: int) -> list[Segment]:
    """`ticks` merged, in order, into at most `segments` stretches of about equal turns (turn-weighted means)."""
    total = sum(t.turns for t in ticks)
    if total <= 0:
        return []
    per = total / segments
    out: list[Segment] = []
    acc: list[Segment] = []
    for t in ticks:
        acc.append(t)
        if sum(a.turns for a in acc) >= per * (1.0 - 1e-9):
            out.append(_merge(acc))
            acc = []
    if acc:
        out.append(_merge(acc))
    return out


def _merge(ticks: list[Segment]) -> Segment:
    w = sum(t.turns for t in ticks)

    def mean(get: Callable[[Segment], float]) -> float:
        return sum(t.turns * get(t) for t in ticks) / w

    shape = TurnShape(
        mean(lambda t: t.shape.new_tokens),
        mean(lambda t: t.shape.output_tokens),
        mean(lambda t: t.shape.context_tokens),
        mean(lambda t: t.shape.tool_s),
    )
    return Segment(
        w, shape, mean(lambda t: t.live), sum(t.lived_s for t in ticks), sum(t.projected_s for t in ticks)
    )


def model_error(record: list[Segment]) -> float:
    """The model's error over a whole recorded step, |log(turn-seconds lived / projected)| under the splits that
    ran (0 when nothing was projected): Little's law makes the lived side exact however noisy each window was."""
    lived = sum(s.lived_s for s in record)
    projected = sum(s.projected_s for s in record)
    if lived <= 0 or projected <= 0 or not math.isfinite(projected):
        return 0.0
    return abs(math.log(lived / projected))
