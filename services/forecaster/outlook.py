"""The demand outlook a forecast carries (`proto.TaskOutlook`): per task, what the allocator needs of the live
trajectories and of the turns ahead, so that it reads demand from the forecast alone.

Per task, in order of first appearance in the picture (tasks with a live trajectory only):
  queued / prefill / decode / tool_call   live trajectories now, by phase: counted from the picture (a fact, the
                                          same for every predictor);
  turns, finished                         turns submitted and trajectories finished over the outlook's horizon;
  new_tokens, output_tokens,              per turn ahead: a mean and q10 / q50 / q90, with the observations each
  context_tokens, tool_s                  rests on (0: a prior, or nothing seen — the reader falls back).
What stands for "ahead" is the predictor's: `lifecycle` its model (`lifecycle_outlook.py`); every series predictor
(naive, ewma, ets, arima) has none of its own and gets `window_outlook` here, the naive rule — the turns ahead look
like the turns of the last window (the events since the previous forecast, `TurnWindow`), and as many come per
second. Counts are spread as Poisson counts (variance = mean).

Cheap by construction: one `bincount` over the picture for the phases, and per task a few means and one sort of
the window's values (at most `TurnWindow.cap` of each kind).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from proto import MAX_OUTLOOK_COUNT, MAX_OUTLOOK_S, MAX_OUTLOOK_TOKENS, Estimate, TaskOutlook
from services.forecaster.base import linear_quantiles, normal_triple
from services.forecaster.picture import Picture

PHASES = 4  # picture state codes 0..3: queued, prefill, decode, tool_call


@dataclass
class TaskWindow:
    """One task's turns seen since the last `TurnWindow.take`: counts exact, values the newest `cap` of each kind."""

    cap: int = 4096
    turns: int = 0  # turns submitted
    finished: int = 0  # trajectories finished (not aborted)
    new_tokens: deque[float] = field(init=False)
    context_tokens: deque[float] = field(init=False)  # whole prompt at submission
    output_tokens: deque[float] = field(init=False)  # of turns whose answer ended
    tool_s: deque[float] = field(init=False)  # gaps outside the model that ended in a next turn

    def __post_init__(self) -> None:
        self.new_tokens, self.context_tokens = deque(maxlen=self.cap), deque(maxlen=self.cap)
        self.output_tokens, self.tool_s = deque(maxlen=self.cap), deque(maxlen=self.cap)


@dataclass(frozen=True)
class Window:
    span_s: float  # seconds the window covers (0: the first window, no rate can be read from it)
    tasks: dict[str, TaskWindow]


class TurnWindow:
    """Per task, the turns the events showed since the last `take` (fed by `learner.EventLearner`)."""

    def __init__(self, cap: int = 4096) -> None:
        self.cap = cap
        self._tasks: dict[str, TaskWindow] = {}
        self._start_s: float | None = None

    def _task(self, task: str) -> TaskWindow:
        w = self._tasks.get(task)
        if w is None:
            w = self._tasks[task] = TaskWindow(self.cap)
        return w

    def turn(self, task: str, new_tokens: float, context_tokens: float) -> None:
        w = self._task(task)
        w.turns += 1
        w.new_tokens.append(float(new_tokens))
        w.context_tokens.append(float(context_tokens))

    def output(self, task: str, tokens: float) -> None:
        self._task(task).output_tokens.append(float(tokens))

    def tool(self, task: str, seconds: float) -> None:
        self._task(task).tool_s.append(float(seconds))

    def finished(self, task: str) -> None:
        self._task(task).finished += 1

    def take(self, now: float) -> Window:
        """The window since the last take (span 0 the first time), then start the next one at `now`."""
        span = max(0.0, now - self._start_s) if self._start_s is not None else 0.0
        out = Window(span if math.isfinite(span) else 0.0, self._tasks)
        self._tasks = {}
        self._start_s = now
        return out


def population(pic: Picture) -> np.ndarray:
    """(tasks, 4): live trajectories of each task (picture code) by phase (queued, prefill, decode, tool_call)."""
    k = len(pic.task_names)
    if not pic.n:
        return np.zeros((k, PHASES), dtype=np.int64)
    flat = pic.task.astype(np.int64) * PHASES + pic.state.astype(np.int64)
    return np.bincount(flat, minlength=k * PHASES).reshape(k, PHASES)


def sample_estimate(values: Iterable[float] | np.ndarray, limit: float) -> Estimate:
    """Mean and quantiles of observed values (each a turn), `observed` their number; nothing seen: zeros. Values
    that are not finite, negative or beyond `limit` (absurd: `proto.MAX_OUTLOOK_*`) are left out."""
    x = np.asarray(values if isinstance(values, np.ndarray) else list(values), dtype=np.float64)
    x = x[np.isfinite(x) & (x >= 0.0) & (x <= limit)]
    if not len(x):
        return Estimate(mean=0.0, q10=0.0, q50=0.0, q90=0.0)
    q10, q50, q90 = linear_quantiles(x, (0.1, 0.5, 0.9))
    return Estimate(mean=float(x.mean()), q10=q10, q50=q50, q90=q90, observed=len(x))


def count_estimate(mean: float, observed: int) -> Estimate:
    """A count over the horizon as a Poisson count (variance = mean) around `mean`."""
    m = min(float(mean), MAX_OUTLOOK_COUNT / 2) if math.isfinite(mean) and mean > 0.0 else 0.0
    q10, q50, q90 = normal_triple(m, m)
    return Estimate(mean=m, q10=q10, q50=q50, q90=q90, observed=max(0, int(observed)))


def weighted_estimate(x: np.ndarray, w: np.ndarray, limit: float, max_sorted: int = 1024) -> Estimate:
    """Mean and quantiles of values `x` weighted by `w` (e.g. each live trajectory's next prefill context by the
    probability that it comes), values beyond `limit` held at it; `observed` counts the values with weight. The
    mean is over every value; the quantiles over every k-th when there are more than `max_sorted` (a sort of
    10,000 values per task per forecast cost as much as the rest of the outlook)."""
    x = np.minimum(x, limit)
    keep = (w > 0.0) & np.isfinite(x) & (x >= 0.0)
    x, w = x[keep], w[keep]
    if not len(x):
        return Estimate(mean=0.0, q10=0.0, q50=0.0, q90=0.0)
    mean = float(np.dot(x, w) / w.sum())
    step = -(-len(x) // max_sorted)
    xs, ws = (x[::step], w[::step]) if step > 1 else (x, w)
    order = np.argsort(xs, kind="stable")
    xs, cw = xs[order], np.cumsum(ws[order])
    total = float(cw[-1])
    q = [float(xs[min(int(np.searchsorted(cw, p * total, "left")), len(xs) - 1)]) for p in (0.1, 0.5, 0.9)]
    return Estimate(mean=mean, q10=q[0], q50=q[1], q90=q[2], observed=len(x))


def outlook_row(task: str, phases: np.ndarray, **figures: Estimate) -> TaskOutlook:
    q, p, d, t = (int(v) for v in phases)
    return TaskOutlook(task=task, queued=q, prefill=p, decode=d, tool_call=t, **figures)


def window_outlook(pic: Picture, window: Window, horizon_s: float) -> list[TaskOutlook]:
    """The naive outlook (module header): per live task, the last window's turns stand for the turns ahead, and
    turns and finishes come at the window's rate (none read from a window of no length)."""
    pop = population(pic)
    scale = horizon_s / window.span_s if window.span_s > 0.0 else 0.0
    out = []
    for code, task in enumerate(pic.task_names):
        live = int(pop[code].sum())
        if not live:
            continue
        w = window.tasks.get(task) or TaskWindow(cap=1)
        out.append(
            outlook_row(
                task,
                pop[code],
                turns=count_estimate(w.turns * scale, live if scale else 0),
                finished=count_estimate(w.finished * scale, live if scale else 0),
                new_tokens=sample_estimate(w.new_tokens, MAX_OUTLOOK_TOKENS),
                output_tokens=sample_estimate(w.output_tokens, MAX_OUTLOOK_TOKENS),
                context_tokens=sample_estimate(w.context_tokens, MAX_OUTLOOK_TOKENS),
                tool_s=sample_estimate(w.tool_s, MAX_OUTLOOK_S),
            )
        )
    return out
