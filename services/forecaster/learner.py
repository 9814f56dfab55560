"""EventLearner: the demand series and lifecycle distributions, learned from lifecycle and engine events. Pure.

Why the forecaster reads events as well as snapshots: a snapshot is a picture of the live trajectories once a
second, while on the SWE trace a tool call lasts ~0.3 s (p50) and a turn ~2–3 s, so most turn boundaries happen
between two snapshots. Token flows per window and the durations the lifecycle model needs (time outside the
model, prefill wait, output length per turn) are exact only from the events, each stamped with `now` (the
caller's clock: arrival time in the live service, virtual time in the simulator). Snapshots then supply the levels
(decode concurrency, KV) and the per-trajectory picture. The turns of each task since the last forecast (new
tokens, contexts, outputs, tool calls, finishes) also go to a `TurnWindow`: the series predictors' outlook
(`outlook.py`).

Idempotence without sequence windows: every figure is keyed by what it measures — a turn's new tokens by
(trajectory, turn), a request's output by its request id (progress counts only its growth), a gap by its
trajectory — so a duplicate or a late event adds nothing. Per-trajectory and per-request records are bounded
(LRU); a trajectory's record ends with TrajectoryFinished. Token counts beyond `MAX_TOKENS` (more than any
model's context) are bad input: counted in `rejected` and skipped.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Any

from proto import (
    PrefillDone,
    RequestFailed,
    RequestFinished,
    TokenProgress,
    ToolCallStarted,
    TrajectoryFinished,
    TrajectoryStarted,
    TurnSubmitted,
)
from services.forecaster.distributions import Distributions
from services.forecaster.outlook import TurnWindow
from services.forecaster.series import SeriesPoint, Windower

MAX_TOKENS = 2**24  # the picture's limit on a context (picture.LIMITS)


class _Traj:
    __slots__ = ("task", "started_s", "last_turn", "context_tokens", "gap_start_s", "turns", "submitted_s")

    def __init__(self, task: str, started_s: float | None) -> None:
        self.task = task
        self.started_s = started_s  # None: TrajectoryStarted not seen (no queue-wait sample)
        self.last_turn = -1  # newest submitted turn
        self.context_tokens = 0  # prompt + output of the newest turn
        self.gap_start_s: float | None = None  # when the trajectory left the model
        self.turns = 0
        self.submitted_s: float | None = None  # when the newest turn was submitted


class _Request:
    __slots__ = ("submitted_s", "output_tokens", "prefill_seen", "finished", "first_progress")

    def __init__(self, submitted_s: float | None) -> None:
        self.submitted_s = submitted_s
        self.output_tokens = 0
        self.prefill_seen = False
        self.finished = False
        self.first_progress: tuple[float, int] | None = None  # (now, tokens) at the first progress item


def _bounded_put(d: OrderedDict, key: str, value: Any, cap: int) -> None:
    d[key] = value
    if len(d) > cap:
        d.popitem(last=False)


class EventLearner:
    """Feeds a `Windower` (flows) and `Distributions` (lifecycle samples) from events; see the module header."""

    def __init__(
        self,
        windower: Windower,
        distributions: Distributions,
        max_tracked: int = 200_000,
        window: TurnWindow | None = None,
    ) -> None:
        self.windower = windower
        self.distributions = distributions
        # Per task, the turns since the last forecast: the naive outlook's "last window" (outlook.py)
        self.window = window if window is not None else TurnWindow()
        self.max_tracked = max_tracked
        self._trajs: OrderedDict[str, _Traj] = OrderedDict()
        self._requests: OrderedDict[str, _Request] = OrderedDict()
        self.events = 0
        self.rejected: Counter[str] = Counter()  # events skipped as bad input, by reason

    def observe(self, event: Any, now: float) -> list[SeriesPoint]:
        """Learn from one event at `now`; returns the series windows closed by the passage of time."""
        self.events += 1
        closed = self.windower.advance(now)
        if isinstance(event, TokenProgress):
            for item in event.items:
                if item.output_tokens > MAX_TOKENS:
                    self.rejected["absurd_output_tokens"] += 1
                    continue
                self._progress(item.request_id, item.output_tokens, now)
        elif isinstance(event, TurnSubmitted):
            if max(event.prompt_tokens, event.new_tokens) > MAX_TOKENS:
                self.rejected["absurd_prompt_tokens"] += 1
            else:
                self._turn(event, now)
        elif isinstance(event, RequestFinished):
            if max(event.prompt_tokens, event.output_tokens) > MAX_TOKENS:
                self.rejected["absurd_output_tokens"] += 1
            else:
                self._request_finished(event, now)
        elif isinstance(event, PrefillDone):
            self._prefill_done(event, now)
        elif isinstance(event, ToolCallStarted):
            t = self._trajs.get(event.traj_id)
            if t is not None and event.turn == t.last_turn and t.gap_start_s is None:
                t.gap_start_s = now
        elif isinstance(event, RequestFailed):
            r = self._requests.get(event.request_id)
            if r is not None:
                r.output_tokens = 0  # the retry (same request id) generates again
        elif isinstance(event, TrajectoryStarted):
            self.distributions.steps.started(event.traj_id, event.policy_version, now)
            if event.traj_id not in self._trajs:
                self.distributions.limits.started(now)
                _bounded_put(self._trajs, event.traj_id, _Traj(event.task, now), self.max_tracked)
        elif isinstance(event, TrajectoryFinished):
            self._finished(event, now)
        return closed

    def _traj(self, traj_id: str) -> _Traj:
        t = self._trajs.get(traj_id)
        if t is None:  # TrajectoryStarted not seen (joined late): learn what can be learned
            t = _Traj("", None)
            _bounded_put(self._trajs, traj_id, t, self.max_tracked)
        return t

    def _turn(self, ev: TurnSubmitted, now: float) -> None:
        t = self._traj(ev.traj_id)
        if ev.turn <= t.last_turn:
            return  # duplicate or late
        first = t.last_turn < 0
        if ev.new_tokens > 0:
            new = ev.new_tokens
        elif first:
            new = ev.prompt_tokens
        else:
            new = max(0, ev.prompt_tokens - t.context_tokens)
        d = self.distributions
        if first and t.started_s is not None:
            d.add(t.task, "queue_wait_s", now - t.started_s)
        if first and ev.turn == 0:
            d.steps.first_turn(ev.traj_id, new, t.task, now)
        if not first:
            d.add(t.task, "new_tokens", new, turn=t.last_turn)  # filed under the turn it follows
        if t.gap_start_s is not None:
            d.add(t.task, "gap_s", now - t.gap_start_s, True, turn=t.last_turn)
            self.window.tool(t.task, now - t.gap_start_s)
            t.gap_start_s = None
        self.window.turn(t.task, new, ev.prompt_tokens)
        cycle = None if first or t.submitted_s is None else now - t.submitted_s
        d.limits.turn(new, first, cycle)
        t.submitted_s = now
        t.last_turn = ev.turn
        t.turns += 1
        t.context_tokens = ev.prompt_tokens
        _bounded_put(self._requests, ev.request_id, _Request(now), self.max_tracked)
        self.windower.add_flow(now, prefill_tokens=new)

    def _request(self, request_id: str) -> _Request:
        r = self._requests.get(request_id)
        if r is None:
            r = _Request(None)
            _bounded_put(self._requests, request_id, r, self.max_tracked)
        return r

    def _progress(self, request_id: str, output_tokens: int, now: float) -> None:
        r = self._request(request_id)
        if r.first_progress is None:
            r.first_progress = (now, output_tokens)
        if output_tokens > r.output_tokens:
            self.windower.add_flow(now, decode_tokens=output_tokens - r.output_tokens)
            r.output_tokens = output_tokens

    def _prefill_done(self, ev: PrefillDone, now: float) -> None:
        r = self._request(ev.request_id)
        if not r.prefill_seen and r.submitted_s is not None:
            t = self._trajs.get(ev.traj_id)
            self.distributions.add(t.task if t else "", "prefill_wait_s", now - r.submitted_s, turn=ev.turn)
        r.prefill_seen = True

    def _request_finished(self, ev: RequestFinished, now: float) -> None:
        r = self._request(ev.request_id)
        if r.finished:
            return
        self._progress(ev.request_id, ev.output_tokens, now)
        r.finished = True
        t = self._traj(ev.traj_id)
        self.distributions.add(t.task, "output_tokens", ev.output_tokens, turn=ev.turn)
        self.window.output(t.task, ev.output_tokens)
        self.distributions.limits.output(ev.output_tokens)
        t.context_tokens = max(t.context_tokens, ev.prompt_tokens) + ev.output_tokens
        if ev.turn == t.last_turn and t.gap_start_s is None:
            t.gap_start_s = now
        self._learn_rate(r, ev, now)

    def _learn_rate(self, r: _Request, ev: RequestFinished, now: float) -> None:
        """Per-sequence decode rate: from the engine's timings, else from the span of progress reports."""
        decode_s = ev.e2e_s - ev.ttft_s
        if ev.output_tokens > 1 and decode_s > 0.0:
            self.distributions.add_decode_rate((ev.output_tokens - 1) / decode_s)
        elif r.first_progress is not None:
            t0, g0 = r.first_progress
            if now - t0 > 0.2 and ev.output_tokens > g0:
                self.distributions.add_decode_rate((ev.output_tokens - g0) / (now - t0))

    def _finished(self, ev: TrajectoryFinished, now: float) -> None:
        self.distributions.steps.finished(ev.traj_id, now)
        t = self._trajs.pop(ev.traj_id, None)
        if t is None:
            return  # a duplicate (or a trajectory never seen): nothing to add
        if ev.status == "finished":
            self.window.finished(t.task)
        if t.gap_start_s is not None:
            self.distributions.add(t.task, "gap_s", now - t.gap_start_s, False, turn=t.last_turn)
        self.distributions.add(t.task, "turns", ev.turns or t.turns)
