"""`prorsa`: choose the split under which the live trajectories finish soonest.

Objective, in the unit Prorsa is judged on: a trajectory's completion time is the sum of its turns' times, so for
every candidate split the policy projects the mean time of one turn, R, from a closed queueing model of the agentic
loop (`turn_model.py`: tool call, prefill wait and compute with the placement's cache misses, KV handoff, output
tokens × TPOT at the batch each engine would hold, the DP-attention stall of mixed steps). With N live
trajectories the cluster completes X = N / R turns a second; over the horizon H a split is worth the turns it
completes, the first `switch_s` of a move spent in the transitional split (movers serve nothing while they drain
and reconfigure; an engine that becomes decode-only also leaves its prefix cache to be recomputed, charged as
prefill time). The score is the projected seconds per turn, N·H / turns(H): lower is better, and its ratio between
two splits is the ratio of the trajectory times they give.

Candidates: every plain split P:D with P, D ≥ 1 (P ≥ 0 / D ≥ 0 where a role has no demand) and full colocation —
so the obvious choices are always on the table (searched coarse-to-fine past 48 engines, `_search`).

Inputs, all from the view (so the live allocator and the simulator run this same code):
* the mean turn (`TurnShape`): new tokens per turn (`recent_mean_new_tokens`, else the ISL net of the recomputed
  output under a split) and output tokens from the request window; context at prefill and tool time from the
  forecast's outlook of the turns ahead (`outlook.py`), else the window's ISL + cached and a default tool call;
* N: live trajectories in the outlook (else engines' requests + queued turns + those in a tool call by Little);
* the prompts and tokens waiting for prefill now: a queue past the affinity threshold puts the model on its
  congested branch (turn_model: misses recompute whole contexts and feed the queue that caused them);
* risk: the forecast's q10 / q50 / q90 of new prompt tokens over its longest horizon scale N (demand rising or
  falling: more or fewer trajectories active), and the score is their weighted mean with weights 0.304 / 0.392 /
  0.304, the three-point rule that reproduces a normal forecast's variance (q10, q90 = median ∓ 1.28 σ);
* H: how long the split will serve — the live population changes by half in N / (2 φ), φ the trajectories
  finishing per second (the outlook's), between two decision intervals and `max_horizon_s`.
Demand reaches the policy one way, the forecast (issue 32): the tracker's snapshot is the forecaster's input. Before
a forecast with an outlook arrives, N, the tool call and H fall back as said, and no step start is recognised.

Decision: move to the best candidate when it beats the current split by more than `margin` plus the model's
measured error on the split that runs (|log observed / projected turn time|, observed by Little's law, net of what
a window's turn count misses by through sampling alone; a move's own cost is already in the score), when it wins
in every forecast scenario and on the turn of the horizon's midpoint (contexts grown by the drift the decisions
measure, `_ahead`), and only once the turn sample stands for the loop (about one finished turn per live
trajectory, the first prompts at most a third of the turns seen). A move, once chosen, is carried through the
hybrids the coordinator passes on the way. A role with demand and no engine is repaired at once. Start-up is
colocated (`initial_plan`).

Between RL steps (`step_memory.py`): while the cluster idles before a synchronous step, the split for the next step
comes from a replay of the last step of its task mix through the model, each split priced with the model's bias
measured on it; a split never measured is tried only then, and only where the coming step's mix is known (it
followed the last one before) or the model explained the record within `margin`. While the cluster idles a move
need only beat the model's measured error on the record (when under `margin`): no drain or cache is lost, and the
step it runs measures the split, so a wrong try costs one step and is undone. At a step's live start (an
asynchronous step, or a mix other than the one expected) only measured splits are moved to. A step whose record
the model explained holds its split while the step runs as the model says: the decisions above wait for the next
step, unless the step so far is off the model by more than `margin`.

Bad input (NaN or negative figures, an empty view) is refused with a PolicyError that the caller logs and counts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from proto import DemandForecast
from services.allocator.capacity import (
    DEFAULT_CONTEXT_TOKENS,
    DEFAULT_ISL_TOKENS,
    DEFAULT_OSL_TOKENS,
    CapacityModel,
)
from services.allocator.policies.common import (
    Split,
    current_split,
    engines_by_role,
    floor_fix,
    forecast_of,
    initial_roles,
    make_capacity,
    moves_for_split,
    parse_options,
    role_demand,
)
from services.allocator.policies.outlook import Outlook, outlook_of
from services.allocator.policies.step_memory import StepMemory, model_error
from services.allocator.policies.turn_model import (
    TurnShape,
    TurnTime,
    projected_turns,
    turn_patience,
    turn_time,
)
from services.allocator.policy import AllocatorPolicy, ClusterView, Plan, PolicyError
from services.allocator.switch_coordinator import DRAIN_TIMEOUT_S
from services.runtime.affinity import MAX_WAITING

QUANTILES = ("q10", "q50", "q90")
# Three-point rule for a normal forecast: q10 and q90 lie at ∓1.2816 σ; weights w, 1 − 2w, w reproduce the
# variance when 2 w · 1.2816² = 1.
_SIDE_WEIGHT = 1.0 / (2.0 * 1.2816**2)
SCENARIO_WEIGHTS = (_SIDE_WEIGHT, 1.0 - 2.0 * _SIDE_WEIGHT, _SIDE_WEIGHT)
DEFAULT_TOOL_S = 1.0  # a tool call when nothing is measured yet (a web fetch or a sandbox run)


@dataclass
class ProrsaPolicy(AllocatorPolicy):
    name: str = "prorsa"
    uses_forecast: ClassVar[bool] = True
    interval_s: float = 5.0
    capacity: CapacityModel = field(default_factory=lambda: make_capacity(None))
    margin: float = 0.03  # relative gain a move must promise beyond its own cost (model error tolerance)
    # A switching engine keeps decodes expected to end within this and migrates the rest by re-prefill elsewhere
    # (the bound the coordinator sends, switch_coordinator.DRAIN_TIMEOUT_S).
    drain_timeout_s: float = DRAIN_TIMEOUT_S
    max_horizon_s: float = 300.0  # longest a split is trusted to serve (the forecast says little beyond)
    # The least patience of placement's affinity rule, in prompts queued at a turn's engine (services.runtime.affinity:
    # the client's directory and the simulator's router apply the same rule).
    max_waiting: int = MAX_WAITING
    initial: str = "mixed"  # start-up roles: "mixed" (colocated), "model" or "split" (initial_plan)
    prefill_fraction: float = 0.25  # share of prefill engines when initial = "split"
    # split → score at the last decision, and the reason (logs, tests, `prorsa top`)
    last_scores: dict[str, float] = field(default_factory=dict)
    last_shape: TurnShape | None = None
    # The mean turn is estimated over many decisions (`_smooth`): one 5 s window holds a few dozen turns of
    # heavy-tailed sizes, whose mean moves by tens of percent from window to window; a phase of the workload
    # lasts minutes. Half of the estimate's weight is older than `shape_half_life_s`.
    shape_half_life_s: float = 30.0
    # Per field of the turn (new, output, context, tool): (weight, weighted sum), folded by `_smooth`.
    _shape_sums: tuple[tuple[float, float], ...] = field(default=((0.0, 0.0),) * 4, repr=False)
    _finish_seen_s: float = field(default=-math.inf, repr=False)  # when the finish rate was last folded in
    _finish_rate: float = field(default=0.0, repr=False)
    _turns_finished: float = field(default=0.0, repr=False)  # turns whose answer the estimate has seen
    _turns_seen: float = field(default=0.0, repr=False)  # turns submitted since the live population formed
    # The model's measured error (`_model_error`): prior, and the weight of each decision's measurement.
    prior_model_error: float = 0.5
    error_weight: float = 0.2
    _error: float = field(default=-1.0, repr=False)
    _error_n: int = field(default=0, repr=False)  # measurements folded into `_error`
    _memo: dict[tuple[Split, TurnShape, float], TurnTime] = field(default_factory=dict, repr=False)
    _queued: float = field(default=0.0, repr=False)  # prompts waiting for prefill now (turn_time's start)
    _queued_tokens: float = field(default=0.0, repr=False)
    _running_mixed: bool = field(default=False, repr=False)  # the cluster runs mixed engines now (`_turn`)
    _queue_patience: float = field(default=0.0, repr=False)  # placement's patience for today's turn (`_turn`)
    # The last step of each task mix, replayed through the model when the next one starts (step_memory.py).
    memory: StepMemory = field(default_factory=StepMemory, repr=False)
    # 1: choose each step's split from the last step of its mix; 0: mid-step decisions only
    step_start: int = 1
    # 1: between steps a replayed split needs to beat the model's measured error on the record (≤ margin); 0: margin
    idle_error_margin: int = 1
    _step_held: bool = field(default=False, repr=False)  # this step's split was chosen from a replay: hold it
    # The split for the step after this idle spell is set.
    _idle_planned: bool = field(default=False, repr=False)
    # The replay compared the splits for the coming step during this idle spell: its verdict (move or stay) stands
    # until the step starts.
    _idle_verdict: bool = field(default=False, repr=False)
    # Until then the last move within a step is still settling (`_settling`): its drain and the recomputes of the
    # caches it dropped are in the queue, a cost the move was priced with, not the state of the split it reached.
    _settle_until: float = field(default=-math.inf, repr=False)
    settle: int = 1  # 1: a move within a step settles before the queue it made is read (`_settling`); 0: not
    # 1: leave a colocated start before the turn sample stands where a default turn agrees (`_escape`); 0: not
    escape: int = 1
    _moving_to: Split | None = field(default=None, repr=False)  # the split a move under way goes to (`plan`)
    # 1: a move must also win on the turn the horizon's midpoint will hold, contexts grown as they are growing
    # (`_ahead`); 0: on today's turn only
    drift: int = 1
    # The drift's weighted least-squares fit of the windows' mean context on time (`_track_drift`): (first time,
    # last time, Σw, Σw·t, Σw·c, Σw·t², Σw·t·c), t from the first time; None until a window of this population.
    _drift_fit: tuple[float, ...] | None = field(default=None, repr=False)
    # Tokens per second the mean context grows by (NaN: not measured yet).
    _context_drift: float = field(default=math.nan, repr=False)

    def initial_plan(self, engine_ids: Sequence[str]) -> Plan:
        """Colocated by default: before a turn has been seen nothing says which role needs more, and colocation
        is the one split that starves neither; the first decision with a measured turn moves from there.
        `initial=model` takes the model's best candidate for a default turn (capacity.DEFAULT_*) at 16 live
        trajectories per engine (measured worse: a default turn is no turn of the workload at hand, and a wrong
        split starves a role until the first decision); `initial=split` puts `prefill_fraction` of the engines
        in prefill (an operator's choice)."""
        if self.initial == "split":
            return Plan(
                roles=initial_roles(engine_ids, self.prefill_fraction), reason=f"{self.name}: initial roles"
            )
        if self.initial == "mixed" or len(engine_ids) == 1:
            return Plan(
                roles=dict.fromkeys(engine_ids, "mixed"), reason=f"{self.name}: initial roles (colocated)"
            )
        shape = TurnShape(DEFAULT_ISL_TOKENS, DEFAULT_OSL_TOKENS, DEFAULT_CONTEXT_TOKENS, DEFAULT_TOOL_S)
        n = len(engine_ids)
        best = min(self.candidates(n, True, True), key=lambda c: self._turn(c, shape, 16.0 * n).turn_s)
        roles = ["prefill"] * best.prefill + ["decode"] * best.decode + ["mixed"] * best.mixed
        return Plan(
            roles=dict(zip(sorted(engine_ids), roles, strict=True)), reason=f"{self.name}: initial {best}"
        )

    # -- the decision -------------------------------------------------------------------------------------------

    def plan(self, view: ClusterView) -> Plan | None:
        _check_view(view)
        self._memo.clear()  # the capacity model's corrections change below
        engine_queued = sum(e.waiting for e in view.engines if e.role in ("prefill", "mixed"))
        self._queued = float(max(view.prefill_queue_len, engine_queued))
        self._queued_tokens = float(view.prefill_queue_tokens)
        settling = self._settling(view)
        if settling:
            # The queue a move makes (the movers' drained prompts, the trajectories whose cache it dropped) is the
            # move's price, already paid: read again as the state the move reached (a stock to work off, or, with
            # the model's earlier unbounded placement term, its congested branch) it undid every move from 6:2 to
            # 5:3 at 512 trajectories on deepseek-v3.2 within 15-25 s, before the recomputes were through (and paid
            # the cache loss again on the way back).
            self._queued = self._queued_tokens = 0.0
        self.capacity.observe(view)
        prefill_demand, decode_demand = role_demand(view)
        current = current_split(view)
        self._running_mixed = current.mixed > 0
        # Demand one way: the forecast's outlook (outlook.py). None before a forecast with one has arrived: then N is
        # what the engines hold, the tool call a default, H the longest, and no step start is recognised (below).
        outlook = outlook_of(view)
        if outlook is not None and not outlook.live:
            self._turns_seen = self._turns_finished = 0.0  # between steps: the next population starts afresh
            self._moving_to = None
            # A new population's contexts start at its first prompts: the last one's grown contexts say nothing of
            # them (its answers, new tokens and tool calls, of the same tasks, still do), and left in the running
            # estimate they read as contexts shrinking through the next step's first minute (`_ahead`).
            sums = list(self._shape_sums)
            sums[2] = (0.0, 0.0)
            self._shape_sums = tuple(sums)
            self._drift_fit, self._context_drift = None, math.nan
        self._turns_seen += view.recent_requests
        if view.recent_finished > 0:  # the answers that ended, as the engines counted them
            self._turns_finished += view.recent_finished
        elif view.recent_mean_osl_tokens > 0 and view.recent_window_s > 0:
            # a view without the count: output tokens generated / mean answer
            self._turns_finished += (
                view.decode_tokens_per_s * view.recent_window_s / view.recent_mean_osl_tokens
            )
        window_shape = self.shape(view, current, outlook)
        measured = self.measured(view, outlook)
        shape = self._smooth(window_shape, view, measured)
        self.last_shape = shape
        # The queue now is past a split's patience or not at today's turn, whichever turn a split is priced on
        # (`_ahead` prices the horizon's midpoint: longer contexts, more patience, the same queue today).
        self._queue_patience = turn_patience(shape, self.max_waiting)
        n_live = self.live_trajectories(view, outlook, shape)
        if (
            n_live > 0 and measured[2] and view.recent_requests > 0
        ):  # a window that saw the population's turns
            self._track_drift(view.now, window_shape.context_tokens, float(view.recent_requests))
        if self.step_start and outlook is not None:
            mix = self.memory.step_started(outlook.started_total, outlook.live_by_task)
            # The window's own shape, not the smoothed one: at a step's start the running estimate still holds
            # the last step's tail; the record's segments average windows by their turns instead.
            turns = float(view.recent_requests)
            if self.memory.recording and turns > 0 and n_live > 0:  # else the memory keeps nothing: no solve
                projected = (
                    turns * turn_time(current, window_shape, n_live, self.capacity, self.max_waiting).turn_s
                )
                self.memory.record(
                    turns, window_shape, n_live, n_live * view.recent_window_s, projected, current
                )
            if mix is not None:
                plan, self._step_held = self._plan_step(view, current, mix)
                if plan is not None:
                    return plan
            elif n_live <= 0 and not self._idle_planned:
                # Between steps (nobody live): set up the next step's split while moving is free (step_memory).
                self._idle_planned = True
                coming = self.memory.expected_next()
                if coming is not None:
                    self._idle_verdict = True
                    plan, _ = self._plan_step(view, current, coming, idle=True)
                    if plan is not None:
                        return plan
            if n_live > 0:
                self._idle_planned = self._idle_verdict = False
            elif self._idle_verdict:
                # The replay of the last step of the coming mix chose this idle spell's split from measured turns;
                # the forecast's arrivals priced at the last window's shape (below) would undo it before the step
                # has said anything (live, 0.6 s after the replay moved to 1:3, a move back to 2:2 at N = 0).
                return floor_fix(view, self.name)
        horizon = self.horizon_s(view, outlook, n_live)
        scenarios = self.scenarios(view, forecast_of(view), n_live, shape, current)
        if not any(n > 0 for n in scenarios):
            return floor_fix(view, self.name)  # nothing to plan for; only repair an empty role with demand
        switch = self._switch_costs(view)
        cands = self.candidates(len(view.engines), prefill_demand, decode_demand)

        per_scenario: dict[Split, list[float]] = {}  # kept for the robustness check below

        def evaluate(c: Split) -> float:
            per_scenario[c] = self.scenario_scores(c, current, shape, scenarios, horizon, switch)
            return _weighted(per_scenario[c])

        scored = _search(current, cands, evaluate)
        current_j = scored.get(current)
        if current_j is None:
            current_j = evaluate(current)
        best = min(scored, key=lambda c: (scored[c], _distance(c, current)))
        self.last_scores = {str(c): j for c, j in scored.items()}
        reason = (
            f"{self.name}: {current} -> {best}, projected {current_j:.2f} -> {scored[best]:.2f} s per turn "
            f"(N={n_live:.0f}, H={horizon:.0f} s)"
        )
        if not current.covers(prefill_demand, decode_demand):
            return Plan(
                roles=moves_for_split(view, best), reason=reason + " (a role with demand had no engine)"
            )
        error = self._model_error(view, current, shape, n_live)
        if self._step_held:
            # The hold rests on the model explaining this step as it explained the last one of its mix. Once a
            # turn per live trajectory has run here and the step so far is off the model by more than `margin`
            # (the congestion of an asynchronous step's overlap, a split the replay priced from an empty queue),
            # the decisions within the step take over: they see the queue the cluster really holds.
            so_far = self.memory.running(current)
            if so_far is None or so_far[0] < n_live or abs(math.log(so_far[1])) <= self.margin:
                return None
            self._step_held = False
        sample_stands = self._sample_stands(n_live)
        target = self._moving_to
        if target is not None and target.total == len(view.engines) and current != target:
            # A move, once chosen, is carried through: the coordinator switches a quarter of the fleet at a time, and
            # the hybrids on the way are neither the split it left nor the one it goes to — the model prices them
            # as colocation over their mixed engines, the dedicated ones idle. Re-decided from each hybrid, moves
            # flapped: 9:7 -> colocation on 16 engines of qwen3-235b at 1,024 trajectories turned back at 9:3:4
            # (9:7 scored 13.5 s a turn there, colocation 13.8) and was chosen again from 9:7, eight times in 45 s;
            # an escape from a colocated start held 2 prefill engines beside 6 mixed for 35 s on deepseek-v3.2.
            return Plan(
                roles=moves_for_split(view, target),
                reason=f"{self.name}: {current} -> {target} (a move under way)",
            )
        self._moving_to = None
        # The score a move must beat. Before the sample stands the error measured so far is no model's: Little's
        # law over windows whose turns are the population's first prompts, sent at once and answered over the
        # next turn time, reads the burst (0.35-0.5 at 128 trajectories on deepseek-v3.2, where the model put
        # colocation's turn at 14.6 s and it ran 13.9-15.2). There the escape's two guesses stand in for it.
        bar = current_j * (1.0 - self.margin - (error if sample_stands else 0.0))
        if best == current or not (scored[best] < bar):
            return None
        if not sample_stands:
            # Until about one turn per live trajectory has finished and the first prompts are at most a third of the
            # turns seen since the population formed, the mean turn is whichever turns came first (a step's first
            # prompts, the shortest answers), not the loop the model is of: a move on it would be a guess — unless
            # it is the escape from a colocated start that a default turn agrees with (`_escape`).
            escape = (
                self._escape(current, current_j, scored, scenarios, horizon, switch) if self.escape else None
            )
            if escape is None:
                return None
            best = escape
            reason = (
                f"{self.name}: {current} -> {best}, projected {current_j:.2f} -> {scored[best]:.2f} s per turn "
                f"(N={n_live:.0f}, H={horizon:.0f} s; before the turn sample stands: a default turn agrees)"
            )

        # Robust: the move must also win in each scenario the forecast allows, not only on average, and on the turn
        # of the horizon's midpoint (`_ahead`). Once the sample stands, a best split that fails those gives way to
        # the best of the others that clear the bar and pass them: near saturation the model's best today is the
        # most prefill-heavy split, which loses as contexts grow, while a step towards it wins on both (16 engines
        # of deepseek-v3.2 at 1,024: 12:4 or 11:5 best from 50 to 175 s and each behind 9:7 at the midpoint; 10:6
        # clears both at 160 s — 326.4 → 316.0 s, against 305.1 for 10:6 held).
        def holds(c: Split) -> bool:
            if any(b > x for b, x in zip(per_scenario[c], per_scenario[current], strict=True)):
                return False
            return not self.drift or self._ahead(c, current, shape, scenarios, horizon, switch, n_live)

        if not holds(best):
            if not sample_stands:
                return None
            others = sorted(
                (c for c in scored if c not in (best, current) and scored[c] < bar), key=scored.__getitem__
            )
            best = next((c for c in others if holds(c)), None)
            if best is None:
                return None
            reason = (
                f"{self.name}: {current} -> {best}, projected {current_j:.2f} -> {scored[best]:.2f} s per turn "
                f"(N={n_live:.0f}, H={horizon:.0f} s; the best split loses by the horizon's midpoint)"
            )
        switch_s, _ = switch.of(current, best)
        self._settle_until = view.now + switch_s + switch.recompute_s(current, best, self.capacity, shape)
        self._moving_to = best
        return Plan(roles=moves_for_split(view, best), reason=reason)

    def _escape(
        self,
        current: Split,
        current_j: float,
        scored: dict[Split, float],
        scenarios: Sequence[float],
        horizon_s: float,
        switch: _SwitchCosts,
    ) -> Split | None:
        """The split to leave a colocated start for before the turn sample stands, or None. The first turns are a
        biased sample (first prompts, short contexts), so the move must also win on a turn the policy knows
        nothing about — the default turn (capacity.DEFAULT_*, a tool call of DEFAULT_TOOL_S) — by the same
        `margin`: two guesses that bracket the loop agree that colocation loses. (Not by the measured error too:
        before the sample stands that is the burst's, `plan`; it held 128 trajectories on deepseek-v3.2
        colocated for 25 s while both guesses put 3:5 22-48 % ahead, and colocation ran 1.8× slower.) Of the splits
        that win on both, the one whose worse ratio to each guess's best is least. Only from colocation: it is the
        start-up roles, held for want of a sample, and at a step's start contexts are short, so the caches a move
        drops and the prompts it drains cost little; every move after it waits for the sample. At 512 trajectories
        on 8 engines of deepseek-v3.2 a colocated start ran ~3× slower than any split for the 80–115 s the
        sample took to stand (colocation's mixed steps stall every DP rank's decode, whatever the turn)."""
        if not current.mixed:
            return None
        prior = TurnShape(DEFAULT_ISL_TOKENS, DEFAULT_OSL_TOKENS, DEFAULT_CONTEXT_TOKENS, DEFAULT_TOOL_S)
        bar = 1.0 - self.margin
        on_prior = {
            c: self.score(c, current, prior, scenarios, horizon_s, switch) for c in scored if not c.mixed
        }
        prior_now = self.score(current, current, prior, scenarios, horizon_s, switch)
        wins = [c for c in on_prior if scored[c] < current_j * bar and on_prior[c] < prior_now * bar]
        if not wins:
            return None
        best_sample, best_prior = min(scored.values()), min(on_prior.values())
        return min(
            wins,
            key=lambda c: (max(scored[c] / best_sample, on_prior[c] / best_prior), _distance(c, current)),
        )

    def _track_drift(self, now: float, context: float, turns: float) -> None:
        """Refit `_context_drift` (tokens per second the mean context grows by): the slope of a least-squares line
        through the windows' mean contexts over time, each window weighted by its turns and forgotten with the
        shape's half-life (`shape_half_life_s`). A fit, not the slope of the running estimate: that estimate lags
        a growing context by about a half-life, and its slope takes minutes to reach the growth — on qwen3-235b at
        512 it read 88 tokens/s 20 s into a step whose contexts grew 148 tokens/s for the next three minutes.
        Restarted with each live population; NaN until two windows."""
        fit = self._drift_fit
        if fit is None:
            fit = (now, now, 0.0, 0.0, 0.0, 0.0, 0.0)
        t0, last, sw, st, sc, stt, stc = fit
        if now < last:
            return
        keep = 0.5 ** ((now - last) / self.shape_half_life_s)
        t = now - t0
        sw, st, sc = keep * sw + turns, keep * st + turns * t, keep * sc + turns * context
        stt, stc = keep * stt + turns * t * t, keep * stc + turns * t * context
        self._drift_fit = (t0, now, sw, st, sc, stt, stc)
        spread = sw * stt - st * st
        if spread > 1e-9 * max(sw * stt, 1.0):
            self._context_drift = (sw * stc - st * sc) / spread

    def _ahead(
        self,
        target: Split,
        current: Split,
        shape: TurnShape,
        scenarios: Sequence[float],
        horizon_s: float,
        switch: _SwitchCosts,
        n_live: float,
    ) -> bool:
        """Whether `target` still beats `current` on the turn of the horizon's midpoint: the mean context grown
        by the drift the decisions measure (`_track_drift`) over half the horizon, the population shrunk by the
        trajectories finishing meanwhile. A split serves for the horizon, and the score prices it on today's turn;
        while contexts grow, the split that is best today is not the one that is best for most of the time it
        serves. At 512 trajectories on deepseek-v3.2 a synchronous step's mean context grows from 4k to 100k
        tokens, ~150 tokens/s in its opening minutes: at 75 s (13k) 6:2 scored 13 % ahead of 5:3, and at 200 s
        (31k) 5:3 scored 13 % ahead — the policy moved there and back, dropping a prefill engine's caches on the
        way back. Only growth counts: a falling mean (a new population's first windows, turnover) leaves the
        check to today's turn, which already holds the shorter contexts."""
        growth = self._context_drift * horizon_s / 2.0
        if not growth > 0.0 or n_live <= 0:  # NaN: not measured
            return True
        ahead = TurnShape(shape.new_tokens, shape.output_tokens, shape.context_tokens + growth, shape.tool_s)
        # H is the time the population takes to halve: at its midpoint at least half is left.
        left = max(0.5, 1.0 - self._finish_rate * horizon_s / 2.0 / n_live)
        later = [n * left for n in scenarios]
        return self.score(target, current, ahead, later, horizon_s, switch) < self.score(
            current, current, ahead, later, horizon_s, switch
        )

    def _sample_stands(self, n_live: float) -> bool:
        """Whether the turns seen since the live population formed are a sample of its loop: about one turn per
        live trajectory has finished, and its first prompts are at most a third of the turns seen. Before that the
        mean turn is whichever turns came first (a step's first prompts, the shortest answers)."""
        return self._turns_finished >= n_live and self._turns_seen >= 3 * n_live

    def _settling(self, view: ClusterView) -> bool:
        """Whether the last move within a step is still under way: an engine switches, or the prefill engines are
        still recomputing what it dropped (`recompute_s`) — plus one decision interval, for the queue to show it."""
        if not self.settle:
            return False
        return any(e.switching for e in view.engines) or view.now < self._settle_until + self.interval_s

    def _plan_step(
        self, view: ClusterView, current: Split, mix: tuple[str, ...], idle: bool = False
    ) -> tuple[Plan | None, bool]:
        """At a step's start: the split under which the last step of this task mix would have taken the fewest
        turn-seconds (step_memory.py: the replay, each split's cost scaled by the model's bias measured on it), when
        it beats the running split by more than `margin`. A move at a live step start needs a record the model
        explained within `margin`; a split that has not run a step of this mix is tried only while the cluster
        idles between steps, on such a record or where the coming step's mix is known. No switch cost is charged: the step's trajectories are new, so no
        engine holds a prefix worth keeping, and the first prompts a mover holds drain in a fraction of the step.

        Also says whether to hold the split through the step: when the model explained the last step within
        `margin`, a move inside the step would pay the drain and the cache rebuild the start avoided, on a phase
        (the first prompts' burst, the tail) the replay already weighed. A mix seen for the first time, or one the
        model missed (a congested split, say), is left to the decisions within the step."""
        record = self.memory.last(mix)
        if not record:
            return None, False
        measured = self.memory.measured(mix)

        def bias(c: Split) -> float:
            # Its own where it ran a step of this mix, else the nearest measured one's of the same branch of the
            # model (the running one first), else none (1.0). Neighbouring splits share most of the bias: the same
            # queueing network with a station moved. Colocation is another network (turn_model's `_colocated`):
            # a split's bias says nothing about it, nor its bias about a split's — at 512 trajectories per step on
            # deepseek-v3.2 the splits ran 2x slower than modelled (congested prefill) while colocation did not,
            # and colocation priced with their bias lost every replay to them.
            kin = [m for m in measured if isinstance(m, Split) and (m.mixed > 0) == (c.mixed > 0)]
            if not kin:
                return 1.0
            near = min(kin, key=lambda m: (_distance(m, c), m != current))
            return measured[near]

        def cost(c: Split) -> float:
            raw = sum(
                seg.turns * turn_time(c, seg.shape, seg.live, self.capacity, self.max_waiting).turn_s
                for seg in record
            )
            return raw * bias(c)

        error = model_error(record)
        hold = error <= self.margin
        # A split that never ran a step of this mix is priced by the model alone (and a neighbour's bias): it is
        # tried only while the cluster idles between steps, where a wrong guess costs one step and nothing more,
        # and only where the try will measure what it was chosen for — the coming step is of this mix because
        # one followed the last step of it before (an experiment: the step measures the split's own bias, and the
        # next replay compares measured costs), or the model explained this record within `margin` (then its
        # ranking is trusted even on the guess that the next step repeats this mix; a guess on a record it did
        # not explain put math's best split under a general step on the alternating mix). Moved while a step's
        # first prompts arrive, the movers' switch sends those prompts to the engines that serve meanwhile, and a
        # trajectory's later turns follow its cache there (measured: profile:general · mimo-v2.5-pro at staleness 2, a move back to
        # colocation at a step's start left that step 17 % slower than the same step colocated throughout).
        # At a live step start the candidates are the splits measured on this mix, and only on a record the model
        # explained (a congested step's record, on general · deepseek-v3.2 at staleness 2, sent the split from one
        # measured split to another and cost 2.5 %): a few solves of the model, not the full search's.
        if idle:
            scored = _search(current, self.candidates(len(view.engines), True, True), cost)
        elif hold:
            n = len(view.engines)
            scored = {c: cost(c) for c in {current, *measured} if isinstance(c, Split) and c.total == n}
        else:
            return None, hold
        if current not in scored:  # a move the switch coordinator has applied in part: a hybrid split
            scored[current] = cost(current)
        current_j = scored[current]
        best = min(scored, key=lambda c: (scored[c], _distance(c, current)))
        self.last_scores = {str(c): j for c, j in scored.items()}
        # While idle, an unmeasured split whose projected gain is past the model's error on this record by `margin`
        # is a bet the model resolves even on the guess that the next step repeats this mix (most RL runs repeat
        # one mix): on general · mimo-v2.5-pro at 512, 4:4 replayed 19.3 % faster than the colocation that ran,
        # on a record the model missed by 5.5 %, and ran 1.23x faster held from the start; refused for want of a
        # second step of the mix, the next step ran colocated.
        resolved = idle and 1.0 - scored[best] / current_j > error + self.margin
        # A try is made once: a step sent to an unmeasured split that its own decisions left before it ran most of
        # the step has given its verdict, and the record it leaves does not measure the split (StepMemory.tried).
        # Retried, it was every step's: qwen3-235b at 512, four steps, replayed 3:5 10-11 % ahead of 4:4 after each
        # (an error of 16 % on the record), each step left it for 4:4 within 90 s (473.8 s against 4:4's 459.3).
        retry = best != current and self.memory.tried(mix, best)
        if best not in measured and (
            retry or (not hold and not (idle and self.memory.next_known()) and not resolved)
        ):
            # An unmeasured split may not be tried here; the best split this mix has measured still may — else a
            # step's tail that left a worse split behind starts the next step on it (qwen3-235b at 512: a move to
            # colocation with two trajectories live, and the next step colocated for 250 s while the replay
            # ranked the measured 5:3 far ahead of it).
            tried = {c: j for c, j in scored.items() if c in measured}
            if not tried:
                return None, hold
            best = min(tried, key=lambda c: (tried[c], _distance(c, current)))
        # While idle, the projected gain must beat the model's own error on this record, not the fixed margin: the
        # margin stands for the switch costs and model error a move inside a step risks; between steps nothing is
        # drained, and the step the try runs measures the split (its bias, used by the next replay), so a gain the
        # model resolves (error 1.5 %, gain 2.6 % on general · mimo-v2.5-pro at 4 engines) is worth a step's try.
        need = min(self.margin, error) if idle and self.idle_error_margin else self.margin
        if best == current or not (scored[best] < current_j * (1.0 - need)):
            return None, hold
        gain = 1.0 - scored[best] / current_j
        if best not in measured:
            self.memory.note_trial(mix, best)
        reason = (
            f"{self.name}: {'before the next step' if idle else 'step start'} ({'+'.join(mix)}): {current} -> "
            f"{best}, last step replayed {gain:.1%} faster "
            f"({'measured' if best in measured else 'unmeasured'} split; model error {error:.1%})"
        )
        return Plan(roles=moves_for_split(view, best), reason=reason), hold

    def score(
        self,
        target: Split,
        current: Split,
        shape: TurnShape,
        scenarios: Sequence[float],
        horizon_s: float,
        switch: _SwitchCosts,
    ) -> float:
        """Projected seconds per turn of `target` reached from `current` (module doc), over the scenarios."""
        return _weighted(self.scenario_scores(target, current, shape, scenarios, horizon_s, switch))

    def scenario_scores(
        self,
        target: Split,
        current: Split,
        shape: TurnShape,
        scenarios: Sequence[float],
        horizon_s: float,
        switch: _SwitchCosts,
    ) -> list[float]:
        """Projected seconds per turn of `target` in each scenario (0 where nobody is live)."""
        out: list[float] = []
        switch_s, transit = switch.of(current, target)
        recompute_s = switch.recompute_s(current, target, self.capacity, shape) if switch_s > 0 else 0.0
        backlog_s = self._backlog_s(target)
        for n in scenarios:
            if n <= 0:
                out.append(0.0)
                continue
            steady = self._turn(target, shape, n)
            if not math.isfinite(steady.turn_s):
                out.append(math.inf)
                continue
            # A congested split keeps its queue (turn_model): it is in the turn time, not worked off once.
            stock_s = recompute_s + (0.0 if steady.congested else backlog_s)
            if switch_s > 0:
                moving = self._turn(transit, shape, n) if transit.total else _STOPPED
                turns = projected_turns(steady, moving, switch_s, horizon_s)
            else:
                turns = steady.turns_per_s * horizon_s
            # While the target's prefill engines recompute dropped caches and work off the queue it starts with,
            # they serve no new turn.
            turns -= steady.turns_per_s * min(stock_s, horizon_s)
            out.append(n * horizon_s / turns if turns > 0 else math.inf)
        return out

    def _model_error(self, view: ClusterView, current: Split, shape: TurnShape, n_live: float) -> float:
        """The model's measured relative error on the split that runs: |log(observed / projected turn time)|,
        observed by Little's law (live trajectories / turns per second), averaged over decisions. It starts
        at `prior_model_error` (an untested model) and is added to the margin: a move must promise more than
        the model is known to miss by."""
        if self._error < 0:
            self._error = self.prior_model_error
        if self._settling(view):
            return self._error  # a split mid-move is no sample of the split it will be (`_settling`)
        rate = view.recent_requests / view.recent_window_s if view.recent_window_s > 0 else 0.0
        # A window in which no turn ended (a step's first prompts, all submitted at once) is no sample of the
        # loop: Little's law needs turns leaving as well as arriving.
        answered = view.recent_mean_osl_tokens > 0
        projected = self._turn(current, shape, n_live).turn_s if n_live > 0 and answered else math.inf
        if rate > 0 and n_live > 0 and math.isfinite(projected) and projected > 0:
            # Net of sampling: a perfect model still misses a window of c turns by ~√(2/π)/√c on average (the
            # mean |log| of a Poisson count over its mean) — 0.25 at the 10 turns a window of 16 trajectories
            # sees, which alone held the first move of a demo-sized step for most of it.
            noise = math.sqrt(2.0 / math.pi / view.recent_requests)
            miss = max(0.0, abs(math.log((n_live / rate) / projected)) - noise)
            # The prior counts as one measurement, not as the 1 / error_weight an EWMA started on it would make
            # it: each measurement weighs 1 / (measurements + 1) until that falls to `error_weight` (the running
            # mean of the prior and the measurements so far, then the EWMA). A weight of 0 measures nothing.
            self._error_n += 1
            weight = max(self.error_weight, 1.0 / (self._error_n + 1)) if self.error_weight > 0 else 0.0
            self._error += weight * (min(miss, 2.0) - self._error)
        return self._error

    def _turn(self, split: Split, shape: TurnShape, n: float) -> TurnTime:
        """turn_time, memoised within a decision (candidates and transitions share splits and scenarios)."""
        key = (split, shape, n)
        hit = self._memo.get(key)
        if hit is None:
            # Colocation inherits the queue's share of misses as its state: its caches, squeezed by its own decodes,
            # are what made that queue (turn_model's `_colocated`). A split starts from the queue a split made — on
            # its congested branch where that queue is past its engines' patience and its misses keep it there
            # (turn_model's `_disaggregated`), else it is a stock its prefill engines work off once (`_backlog_s`).
            # Not from colocation's: that queue is of whole contexts colocation's squeezed caches lost, which a
            # split's caches hold — read as a split's state it kept colocation best for 1,500 s on qwen3-235b at
            # 512 while 4:4 ran 2.7× faster (docs/benchmarks.md, item 4).
            from_split = split.mixed or not self._running_mixed
            queued, tokens = (self._queued, self._queued_tokens) if from_split else (0.0, 0.0)
            hit = self._memo[key] = turn_time(
                split, shape, n, self.capacity, self.max_waiting, queued, tokens, self._queue_patience
            )
        return hit

    def _backlog_s(self, target: Split) -> float:
        """Seconds a split's prefill engines spend on the prompts queued now: a stock to work off once, at their
        full rate (a split reached by a move pays it on top of the caches the move drops; a congested split keeps
        it instead, `scenario_scores`). Colocation carries the queue in its turn time instead (`_turn`)."""
        if target.mixed or self._queued_tokens <= 0:
            return 0.0
        return self._queued_tokens / (
            self.capacity.prefill_tokens_per_s(DEFAULT_ISL_TOKENS) * max(target.prefill, 1)
        )

    # -- what the view says -------------------------------------------------------------------------------------

    def shape(self, view: ClusterView, current: Split, outlook: Outlook | None) -> TurnShape:
        """The mean turn of the work at hand (module doc). New and output tokens are the window's: the engines'
        own count of the turns they served since the last decision (PrefillDone, RequestFinished), on which the
        model's error and the step's record are measured (Little's law over the same window, `_model_error`,
        `StepMemory.record`) — and the new tokens as placed. The outlook's per-turn figures are the run's recent
        distribution (the forecaster refits it every 30 s): staler for the same quantity. Context at prefill and
        the tool call are the outlook's, of the turns ahead: the window has no count of either (the tool call was a
        Little's-law estimate, 0 at a step's start before any trajectory is in a tool; the context grows turn by
        turn, and the forecaster knows each live trajectory's). Without an outlook: the window's ISL + cached and
        a default tool call."""
        osl = self._answer_tokens(view, outlook)
        isl = view.recent_mean_isl_tokens if view.recent_mean_isl_tokens > 0 else DEFAULT_ISL_TOKENS
        context = isl + max(0.0, view.recent_mean_cached_tokens)
        if view.recent_mean_new_tokens > 0:
            new = view.recent_mean_new_tokens
        elif current.mixed:
            new = isl  # a mixed engine caches prompt and answer: it computes only the new tokens
        else:
            new = max(1.0, isl - osl)  # a prefill engine recomputes the last answer (turn_model doc)
        tool = DEFAULT_TOOL_S
        if outlook is not None:
            context = outlook.context_tokens if outlook.context_tokens is not None else context
            tool = outlook.tool_s if outlook.tool_s is not None else tool
        return TurnShape(new, osl, max(context, new), tool)

    def _answer_tokens(self, view: ClusterView, outlook: Outlook | None) -> float:
        """The window's mean answer. Once the turn sample stands, the mean of the answers that ended in it (the
        engines' count). Before, those are censored — only the shortest have ended: 35 tokens at 5 s into a step of
        128 trajectories on deepseek-v3.2, 150 at 20 s, against the loop's ~185 — and the answer is the output
        tokens generated over the answers that ended: the loop's own balance in a steady state, and in the first
        turn the estimate of a mean from lengths cut off (every answer's tokens so far over the answers that
        ended): 229 tokens at 10 s, 193 at 20 s on the same step. Not after: it counts the tokens of answers the
        window did not see end, so it moves with the batch in flight (a ramp, a drain), which the ended answers'
        mean does not. The population is the outlook's live trajectories, else what the engines hold."""
        ended = view.recent_mean_osl_tokens if view.recent_mean_osl_tokens > 0 else DEFAULT_OSL_TOKENS
        generated = view.decode_tokens_per_s * view.recent_window_s
        if view.recent_finished <= 0 or generated <= 0:
            return ended
        population = float(outlook.live) if outlook is not None else _held(view)
        return ended if self._sample_stands(population) else generated / view.recent_finished

    @staticmethod
    def measured(view: ClusterView, outlook: Outlook | None) -> tuple[bool, bool, bool, bool]:
        """Which fields of `shape` were measured (new, output, context, tool); the others are defaults."""
        prompts = view.recent_mean_isl_tokens > 0
        return (
            prompts or view.recent_mean_new_tokens > 0,
            view.recent_mean_osl_tokens > 0,
            prompts or (outlook is not None and outlook.context_tokens is not None),
            outlook is not None and outlook.tool_s is not None,
        )

    def _smooth(
        self, now_shape: TurnShape, view: ClusterView, measured: tuple[bool, bool, bool, bool]
    ) -> TurnShape:
        """The window's shape folded into the running estimate, weighted by the turns it saw (class doc). A field
        the window did not measure adds nothing: a step's first window submits its prompts before any answer
        ends, and folding the default answer length in with the weight of every prompt made the first live
        decisions price turns of 400 output tokens on a workload of 80-170. The answer is a mean over the answers
        that ended, and weighs by them (the engines' count, where the view has it): weighed by the prompts sent, a
        step's first window — every first prompt sent, the few shortest answers ended — held the estimate at half
        the loop's answer for 40 s (deepseek-v3.2, 128 trajectories)."""
        decay = 0.5 ** (max(view.recent_window_s, 0.0) / self.shape_half_life_s)
        turns = float(view.recent_requests)
        answers = float(view.recent_finished) if view.recent_finished > 0 else turns
        weights = (turns, answers, turns, turns)
        values = (now_shape.new_tokens, now_shape.output_tokens, now_shape.context_tokens, now_shape.tool_s)
        sums = tuple(
            (a * decay + (w if m else 0.0), b * decay + (w * v if m else 0.0))
            for (a, b), v, m, w in zip(self._shape_sums, values, measured, weights, strict=True)
        )
        self._shape_sums = sums
        new, out, ctx, tool = (b / a if a > 0 else v for (a, b), v in zip(sums, values, strict=True))
        return TurnShape(new, out, max(ctx, new), tool)

    def live_trajectories(self, view: ClusterView, outlook: Outlook | None, shape: TurnShape) -> float:
        """N: live trajectories (the outlook), else what the engines hold plus those in a tool call (Little)."""
        if outlook is not None:
            return float(outlook.live)
        rate = view.recent_requests / view.recent_window_s if view.recent_window_s > 0 else 0.0
        return _held(view) + rate * shape.tool_s

    def horizon_s(self, view: ClusterView, outlook: Outlook | None, n_live: float) -> float:
        """H: the time the live population takes to change by half, within [2 intervals, max_horizon_s]. The
        outlook's finish rate is folded in once per decision, half weight each (as the tracker's measured rate
        was: a forecaster's figure from one window, naive's, is as noisy); without an outlook the last one holds."""
        lo = 2.0 * self.interval_s
        if outlook is not None and view.now > self._finish_seen_s:
            self._finish_rate = 0.5 * self._finish_rate + 0.5 * outlook.finishing_per_s
            self._finish_seen_s = view.now
        if self._finish_rate <= 0:
            return self.max_horizon_s
        return min(self.max_horizon_s, max(lo, n_live / (2.0 * self._finish_rate)))

    def scenarios(
        self,
        view: ClusterView,
        forecast: DemandForecast | None,
        n_live: float,
        shape: TurnShape,
        current: Split,
    ) -> tuple[float, float, float]:
        """N under the forecast's q10 / q50 / q90 of new prompt tokens over its longest horizon: the median
        scenario is the live population, the others scale it by the forecast's own spread (q10 / q50, q90 / q50)
        — so the forecast sets the risk, and the model never feeds its own projection back into N. With nobody
        live yet (the next step is about to start) the forecast's arrivals give N by Little's law."""
        if forecast is None:
            return (n_live, n_live, n_live)
        h = max(forecast.horizons, key=lambda f: f.horizon_s)
        if not (h.horizon_s > 0 and math.isfinite(h.horizon_s)):
            return (n_live, n_live, n_live)
        q = [float(getattr(h.prefill_tokens, name)) for name in QUANTILES]
        for name, v in zip(QUANTILES, q, strict=True):
            if not (math.isfinite(v) and v >= 0):
                raise PolicyError(f"{self.name}: forecast {name} of prefill tokens is {v}")
        lo, mid, hi = sorted(q)
        if n_live > 0:
            if mid <= 0:
                return (n_live, n_live, n_live)
            return (n_live * lo / mid, n_live, n_live * hi / mid)
        r = self._turn(current, shape, float(len(view.engines))).turn_s
        cycle = r if math.isfinite(r) else shape.tool_s
        per_s = [v / h.horizon_s / max(shape.new_tokens, 1.0) for v in (lo, mid, hi)]  # turns per second
        return (per_s[0] * cycle, per_s[1] * cycle, per_s[2] * cycle)

    def _switch_costs(self, view: ClusterView) -> _SwitchCosts:
        drain: dict[str, list[float]] = {}
        cache: dict[str, list[float]] = {}
        restarts: dict[str, list[frozenset[str]]] = {}
        rate = self.capacity.prefill_tokens_per_s(DEFAULT_ISL_TOKENS)
        for role, members in engines_by_role(view).items():
            acc_d, acc_c, acc_r = [0.0], [0.0], [frozenset[str]()]
            for e in members:
                d = self.capacity.drain_s(role, e.in_flight_tokens, e.decode_batch, e.kv_used_tokens, rate)
                acc_d.append(max(acc_d[-1], min(d, self.drain_timeout_s)))
                # A prefill or mixed engine's prefix cache, or the KV of decodes a decode engine migrates.
                held = max(e.kv_used_tokens, e.prefix_cache_tokens) if role != "decode" else e.kv_used_tokens
                acc_c.append(acc_c[-1] + held)
                acc_r.append(acc_r[-1] | frozenset(e.restart_roles))
            drain[role], cache[role], restarts[role] = acc_d, acc_c, acc_r
        profile = self.capacity.profile
        return _SwitchCosts(drain, cache, profile.role_switch_s, restarts, profile.engine_start_s)

    def candidates(self, n: int, prefill_demand: bool, decode_demand: bool) -> list[Split]:
        """Every plain split that keeps an engine for each role with demand, and full colocation."""
        if n == 1:
            return [Split(0, 0, 1)]
        p_min = 1 if prefill_demand else 0
        d_min = 1 if decode_demand else 0
        out = [Split(p, n - p) for p in range(p_min, n - d_min + 1)]
        out.append(Split(0, 0, n))
        return [c for c in out if c.covers(prefill_demand, decode_demand)]


_STOPPED = TurnTime(math.inf, 0.0, math.inf, math.inf, 0.0, 0.0)


@dataclass(frozen=True)
class _SwitchCosts:
    """What moving the k cheapest engines out of each role costs (prefix maxima / sums / unions, index k).

    A switch is in place unless a mover's layout differs for a role the move fills (`EngineView.restart_roles`;
    services/engine_agent/switch_rule.py): in place, movers pull nothing for `switch_s` while the work they hold
    runs on, and drain nothing; a restart drains them (capped at the drain timeout) and starts them again
    (`restart_s`)."""

    drain_s: dict[str, list[float]]  # longest drain among the k movers (capped at the drain timeout)
    cache_tokens: dict[str, list[float]]  # prefix cache the k movers hold
    switch_s: float  # an in-place switch: the profile's role_switch_s
    # The roles any of the k movers restarts for (their layout differs).
    restarts: dict[str, list[frozenset[str]]] = field(default_factory=dict)
    restart_s: float = 0.0  # an engine start: the profile's engine_start_s

    def movers(self, current: Split, target: Split) -> dict[str, int]:
        return {r: max(0, current.of(r) - target.of(r)) for r in ("prefill", "decode", "mixed")}

    def of(self, current: Split, target: Split) -> tuple[float, Split]:
        """(seconds until the target serves, the split that serves meanwhile)."""
        out = self.movers(current, target)
        if not any(out.values()):
            return 0.0, target
        stay = Split(*(min(current.of(r), target.of(r)) for r in ("prefill", "decode", "mixed")))
        filled = {r for r in ("prefill", "decode", "mixed") if target.of(r) > current.of(r)}
        restart = any(
            self.restarts[r][min(k, len(self.restarts[r]) - 1)] & filled
            for r, k in out.items()
            if k and r in self.restarts
        )
        if not restart:
            return self.switch_s, stay
        drain = max(self.drain_s[r][min(k, len(self.drain_s[r]) - 1)] for r, k in out.items())
        return self.restart_s + drain, stay

    def recompute_s(self, current: Split, target: Split, cap: CapacityModel, shape: TurnShape) -> float:
        """Seconds the target's prefill engines spend recomputing what a move loses: decodes migrated off decode
        movers, and the prefix caches of movers that become decode-only (a move between prefill and mixed keeps
        its cache: one KV layout serves both)."""
        gained_decode = max(0, target.decode - current.decode)
        if not gained_decode or not (target.prefill + target.mixed):
            return 0.0
        out = self.movers(current, target)
        lost = sum(
            self.cache_tokens[r][min(k, len(self.cache_tokens[r]) - 1)]
            for r, k in out.items()
            if r != "decode"
        )
        rate = cap.prefill_tokens_per_s(max(1.0, shape.context_tokens), 0.0)
        return lost / (rate * (target.prefill + target.mixed))


def _check_view(view: ClusterView) -> None:
    """Refuse a view with figures no engine or window can have (NaN, negative): PolicyError, logged by the caller."""
    if not view.engines:
        raise PolicyError("view has no engines")
    figures = {
        "prefill_queue_tokens": view.prefill_queue_tokens,
        "prefill_tokens_per_s": view.prefill_tokens_per_s,
        "decode_tokens_per_s": view.decode_tokens_per_s,
        "recent_window_s": view.recent_window_s,
        "recent_mean_isl_tokens": view.recent_mean_isl_tokens,
        "recent_mean_cached_tokens": view.recent_mean_cached_tokens,
        "recent_mean_osl_tokens": view.recent_mean_osl_tokens,
        "recent_mean_new_tokens": view.recent_mean_new_tokens,
        "recent_away_prefills": view.recent_away_prefills,
        "recent_mean_away_new_tokens": view.recent_mean_away_new_tokens,
        "recent_finished": view.recent_finished,
    }
    for name, v in figures.items():
        if not (math.isfinite(v) and v >= 0):
            raise PolicyError(f"view field {name} is {v}")
    for e in view.engines:
        for name in ("running", "waiting", "decode_batch", "kv_used_tokens", "in_flight_tokens"):
            v = getattr(e, name)
            if not (math.isfinite(v) and v >= 0):
                raise PolicyError(f"engine {e.engine_id}: {name} is {v}")


def _held(view: ClusterView) -> float:
    """Trajectories the engines hold now: running or waiting on an engine, or waiting for a decode slot."""
    return float(sum(e.running + e.waiting for e in view.engines) + view.decode_queue_len)


def _search(
    current: Split, candidates: list[Split], evaluate: Callable[[Split], float]
) -> dict[Split, float]:
    """Scores of the candidates worth scoring: all of them up to 48 plain splits; beyond, a coarse-to-fine
    search over P (every ⌈n/16⌉-th split, then a quarter of that step around the best, down to step 1) — the
    score is near-unimodal in P (prefill time falls and decode time rises as P grows). Colocation and the
    current split are always scored."""
    plain = [c for c in candidates if not c.mixed]  # ascending P
    if len(plain) <= 48:
        return {c: evaluate(c) for c in candidates}
    scored = {c: evaluate(c) for c in candidates if c.mixed or c == current}
    lo, hi, step = 0, len(plain) - 1, math.ceil(len(plain) / 16)
    while True:
        probe = [*range(lo, hi + 1, step), hi]
        for i in probe:
            if plain[i] not in scored:
                scored[plain[i]] = evaluate(plain[i])
        best = min(probe, key=lambda i: scored[plain[i]])
        if step == 1:
            return scored
        lo, hi = max(0, best - step), min(len(plain) - 1, best + step)
        step = max(1, step // 4)


def _weighted(per_scenario: Sequence[float]) -> float:
    """The scenarios' scores weighted by SCENARIO_WEIGHTS (the three-point rule, module doc)."""
    return sum(w * j for w, j in zip(SCENARIO_WEIGHTS, per_scenario, strict=True))


def _distance(a: Split, b: Split) -> int:
    return abs(a.prefill - b.prefill) + abs(a.decode - b.decode) + abs(a.mixed - b.mixed)


_OPTIONS: dict[str, float | int | str] = {
    "interval_s": 5.0,
    "margin": 0.03,
    "drain_timeout_s": 5.0,
    "max_horizon_s": 300.0,
    "max_waiting": MAX_WAITING,
    "initial": "mixed",
    "prefill_fraction": 0.25,
    "step_start": 1,
    "idle_error_margin": 1,
    "settle": 1,
    "escape": 1,
    "drift": 1,
}


@dataclass
class OracleSpec(AllocatorPolicy):
    """`oracle`: the hindsight search over the simulator (prorsa.sim.hindsight). It forks the simulated cluster,
    so it cannot run live: `plan` refuses."""

    name: str = "oracle"
    interval_s: float = 10.0
    lookahead_s: float = 60.0

    def initial_plan(self, engine_ids: Sequence[str]) -> Plan:
        # Never used to run: the simulator's hindsight search chooses its own start (prorsa.sim.hindsight).
        return Plan(roles=dict.fromkeys(engine_ids, "mixed"), reason="oracle: simulator only")

    def plan(self, view: ClusterView) -> Plan | None:
        raise PolicyError("oracle is a hindsight search that forks the simulator: simulator only")


def make_oracle(args: Sequence[str], n_engines: int, profile: object | None = None) -> OracleSpec:
    """`oracle[:interval_s=..][:lookahead_s=..]` (simulator only). Raises PolicyError on bad arguments."""
    opts = parse_options("oracle", args, {"interval_s": 10.0, "lookahead_s": 60.0})
    return OracleSpec(**opts)  # type: ignore[arg-type]


def make_prorsa(args: Sequence[str], n_engines: int, profile: object | None = None) -> ProrsaPolicy:
    """`prorsa[:key=value...]`, keys: interval_s, margin, drain_timeout_s, max_horizon_s, max_waiting, initial
    (model|mixed|split), prefill_fraction, step_start (1|0), idle_error_margin (1|0: between steps a move needs to
    beat the model's error on the record / the margin), settle (1|0: a move within a step settles before the queue
    it made is read), escape (1|0: leave a colocated start before the turn sample stands where a default turn
    agrees), drift (1|0: a move must also win on the turn of the horizon's midpoint, contexts grown as measured). Raises PolicyError on bad arguments or profile."""
    opts = parse_options("prorsa", args, _OPTIONS)
    if opts["initial"] not in ("model", "mixed", "split"):
        raise PolicyError(f"prorsa: initial must be model, mixed or split, got {opts['initial']!r}")
    return ProrsaPolicy(capacity=make_capacity(profile), **opts)  # type: ignore[arg-type]
