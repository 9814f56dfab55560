"""Per-task lookup tables: what one trajectory contributes to demand over each horizon (model: lifecycle_model.py).

A trajectory's contribution over a horizon h depends on its state and its progress in it — time already spent
(tool_call, queued) or tokens already generated (decode). For each state, a grid of progress values and each
horizon, the tables hold the first two moments of three quantities:
  prefill   new prompt tokens arriving within h,
  seconds   seconds spent decoding within h (decode tokens = r * seconds, so a long decode is capped at r * h;
            concurrency = seconds / h),
  kv        context tokens held at h if decoding then (0 otherwise).
Each moment is a quadratic form in the trajectory's current context c (E[Q] = e0 + e1 c, E[Q^2] = f0 + f1 c +
f2 c^2), and split in two parts: `base` (what happens whatever the gap's outcome: the current decode) and `cont`
(what happens only if a next turn follows). A trajectory's coefficients are base + p * cont, p = P(a next turn
follows) from the turn-count hazard (and, in tool_call, the time already spent: a long gap rarely ends a
trajectory). Moments mix linearly, so this is exact for the two-outcome mixture.

tool_call and queued first arrivals use every empirical sample exactly (conditional survival given the time
spent); decode uses Monte Carlo with common random numbers across its grid (smooth in g); later turns come from
the continuation table.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from services.forecaster.distributions import TaskSamples
from services.forecaster.lifecycle_model import (
    ContTable,
    Inputs,
    PriorSamples,
    continuation_table,
    draw,
    make_inputs,
    turn_hazard,
)


@dataclass(frozen=True)
class KindTable:
    """`base[g, q, c, j]` and `cont[g, q, c, j]`: grid point, quantity, coefficient (e0 e1 f0 f1 f2), horizon."""

    grid: np.ndarray  # (G,) progress: seconds spent, or tokens generated
    base: np.ndarray  # (G, 3, 5, H)
    cont: np.ndarray  # (G, 3, 5, H)
    surv_turn: np.ndarray | None = None  # tool_call: P(D > s) of gaps ending in a turn, on the grid
    surv_finish: np.ndarray | None = None  # tool_call: P(D > s) of gaps ending the trajectory


# (mean, q10, q50, q90) of one quantity per turn
Figure = tuple[float, float, float, float]


@dataclass(frozen=True)
class TurnFigures:
    """One turn of a task, for the demand outlook (`lifecycle_outlook.py`): new prompt tokens, output tokens and
    tool (gap) seconds per turn, each (mean, q10, q50, q90) with the observations behind it (0: a prior), the
    turn-count hazard, and the outputs sorted with their suffix sums, for the expected rest of an output already
    `g` tokens long."""

    new_tokens: Figure
    output_tokens: Figure
    tool_s: Figure
    observed: tuple[int, int, int]  # samples of new tokens, outputs, gaps that ended in a turn
    hazard: np.ndarray  # P(end after turn k | reached k), the last entry for every later k
    decode_rate_tokens_per_s: float  # the learned per-sequence rate at the refit (else the prior's)
    out_sorted: np.ndarray  # (n,)
    out_suffix: np.ndarray  # (n + 1,): out_suffix[i] = sum of out_sorted[i:]

    def remaining_output(self, generated: np.ndarray) -> np.ndarray:
        """E[L - g | L > g] per value g (0 where no observed output is longer: the answer is about done)."""
        i = np.searchsorted(self.out_sorted, generated, "right")
        above = len(self.out_sorted) - i
        mean_above = np.where(above > 0, self.out_suffix[i] / np.maximum(above, 1), generated)
        return np.maximum(mean_above - generated, 0.0)


def _figure(x: np.ndarray) -> Figure:
    q10, q50, q90 = (float(v) for v in np.quantile(x, (0.1, 0.5, 0.9)))
    return float(x.mean()), q10, q50, q90


def task_figures(
    own: TaskSamples | None,
    pooled: TaskSamples | None,
    rate_tokens_per_s: float,
    live_turns: np.ndarray | None = None,
    prior: PriorSamples | None = None,
    min_own: int = 3,
) -> TurnFigures:
    """A task's `TurnFigures`: per kind its own samples where it has `min_own`, else the pooled task's (else the
    priors, `make_inputs`). Every task gets its own, not only those with enough samples for tables: the pooled
    figures of a mix priced a math turn (3,000 output tokens, 3 turns a trajectory) as a general one (250, 30)."""
    s = _own_or_pooled(own, pooled, min_own)
    inp = make_inputs(s, rate_tokens_per_s, prior)
    live = live_turns if live_turns is not None else np.zeros(0, dtype=np.int64)
    out = np.sort(inp.out)
    observed = (
        (s.size("new_tokens"), s.size("output_tokens"), int(s.gap_is_turn.sum()))
        if s is not None
        else (0, 0, 0)
    )
    return TurnFigures(
        new_tokens=_figure(inp.new),
        output_tokens=_figure(inp.out),
        tool_s=_figure(inp.gap_turn),
        observed=observed,
        hazard=turn_hazard(inp.turns, live, inp.finish_fraction),
        decode_rate_tokens_per_s=inp.rate,
        out_sorted=out,
        out_suffix=np.concatenate((np.cumsum(out[::-1])[::-1], [0.0])),
    )


_KINDS = ("queue_wait_s", "prefill_wait_s", "output_tokens", "new_tokens", "turns")


def _own_or_pooled(own: TaskSamples | None, pooled: TaskSamples | None, min_own: int) -> TaskSamples | None:
    if own is None or pooled is None:
        return own if own is not None else pooled
    pick = {k: getattr(own if own.size(k) >= min_own else pooled, k) for k in _KINDS}
    gaps = own if own.size("gap_s") >= min_own else pooled
    return TaskSamples(gap_s=gaps.gap_s, gap_is_turn=gaps.gap_is_turn, **pick)


@dataclass(frozen=True)
class TaskTable:
    horizons_s: np.ndarray  # (H,)
    decode_rate_tokens_per_s: float
    cont: ContTable
    kinds: dict[int, KindTable]  # state code (picture.QUEUED ...) -> table
    hazard: np.ndarray  # P(end after turn k | reached k), the last entry for every later k

    def next_turn_prob(self, turn: np.ndarray) -> np.ndarray:
        return 1.0 - self.hazard[np.minimum(turn, len(self.hazard) - 1)]


# Beyond the data, the progress grid goes on geometrically (x1.6 per point, to ~40x its last supported point):
# a trajectory far into a tool call or a decode is common early in a run, when only the short ones have ended.
_GRID_GROWTH = 1.6
_GRID_EXTRA = 8


def _progress_grid(samples: np.ndarray, points: int, min_tail: int) -> np.ndarray:
    """0, then sample quantiles, keeping only points with at least `min_tail` samples strictly above them, then
    `_GRID_EXTRA` geometric points beyond (where `_tail` extrapolates); beyond the last point a trajectory is
    treated as at that point."""
    if len(samples) <= min_tail:
        return np.array([0.0])
    top = 1.0 - min_tail / len(samples)
    grid = np.unique(np.concatenate(([0.0], np.quantile(samples, np.linspace(0.0, top, points - 1)))))
    above = len(samples) - np.searchsorted(np.sort(samples), grid, side="right")
    grid = grid[(above >= min_tail) | (grid == 0.0)]
    if grid[-1] > 0.0:
        grid = np.concatenate((grid, grid[-1] * _GRID_GROWTH ** np.arange(1, _GRID_EXTRA + 1)))
    return grid


def _tail(samples: np.ndarray, x: float, min_tail: int) -> np.ndarray:
    """Samples > x, or where fewer than `min_tail` lie above x, the `min_tail` largest scaled by x / x0 (x0: the
    largest value with `min_tail` samples above it). The scaling takes the tail as scale-free beyond the data —
    given D > x, D / x is distributed as D / x0 given D > x0 — so the expected remaining time or output grows
    with the progress already made, as it does for heavy-tailed tool latencies and output lengths (on the SWE
    trace the mean residual tool latency is 3.5 s past 0.5 s and 18 s past 8 s). Tiny samples (<= min_tail)
    are used as they are."""
    above = samples[samples > x]
    if len(above) >= min_tail or len(samples) <= min_tail:
        return above if len(above) else np.sort(samples)[-1:]
    s = np.sort(samples)
    top, x0 = s[-min_tail:], s[-min_tail - 1]
    return top * (x / x0) if x > x0 > 0.0 else top


def _masked(values: tuple[np.ndarray, ...], ok: np.ndarray) -> tuple[np.ndarray, ...]:
    return tuple(np.where(ok, v, 0.0) for v in values)


def _first_arrival(
    waits: np.ndarray, inp: Inputs, cont: ContTable, hs: np.ndarray, known_tokens: bool, min_tail: int
) -> tuple[np.ndarray, np.ndarray]:
    """(grid, coefficients) of a trajectory waiting for its next turn, given the time already spent.

    known_tokens=False (tool_call): the turn brings N ~ new tokens; KV = I (c + N + G).
    known_tokens=True (queued): the turn is the context itself; prefill = c + later arrivals, KV = I (c + G).
    All horizons at once: arrays are (horizon, sample)."""
    grid = _progress_grid(waits, 24, min_tail) if len(waits) else np.array([0.0])
    coefs = np.zeros((len(grid), 3, 5, len(hs)))
    mu, nsq = inp.mu_new, inp.new_sq
    zero = np.zeros(len(hs))
    for k, x in enumerate(grid):
        tau = np.maximum(_tail(waits, x, min_tail) - x, 0.0) if len(waits) else np.zeros(1)
        rem = hs[:, None] - tau[None, :]
        ok = rem >= 0.0
        a1, a2, s1, s2, i1, gi, g2i = (v.mean(axis=1) for v in _masked(cont.at(rem), ok))
        p = ok.mean(axis=1)
        if known_tokens:
            coefs[k, 0] = (a1, p, a2, 2 * a1, p)
            coefs[k, 2] = (gi, i1, g2i, 2 * gi, i1)
        else:
            coefs[k, 0] = (p * mu + a1, zero, p * nsq + 2 * mu * a1 + a2, zero, zero)
            e0 = mu * i1 + gi
            coefs[k, 2] = (e0, i1, nsq * i1 + 2 * mu * gi + g2i, 2 * e0, i1)
        coefs[k, 1] = (s1, zero, s2, zero, zero)
    return grid, coefs


def _survival(samples: np.ndarray, grid: np.ndarray) -> np.ndarray:
    s = np.sort(samples)
    return 1.0 - np.searchsorted(s, grid, side="right") / len(s)


def _tool_call_table(inp: Inputs, cont: ContTable, hs: np.ndarray, min_tail: int) -> KindTable:
    grid, coefs = _first_arrival(inp.gap_turn, inp, cont, hs, False, min_tail)
    surv_turn = _survival(inp.gap_turn, grid)
    surv_finish = _survival(inp.gap_finish, grid) if len(inp.gap_finish) else surv_turn
    return KindTable(grid, np.zeros_like(coefs), coefs, surv_turn, surv_finish)


def _queued_table(inp: Inputs, cont: ContTable, hs: np.ndarray, min_tail: int) -> KindTable:
    grid, coefs = _first_arrival(inp.qwait, inp, cont, hs, True, min_tail)
    return KindTable(grid, coefs, np.zeros_like(coefs))


def _decode_table(
    inp: Inputs,
    cont: ContTable,
    hs: np.ndarray,
    rng: np.random.Generator,
    paths: int,
    min_tail: int,
    wait: bool,
) -> KindTable:
    """Decoding with g generated (wait=False), or waiting for prefill (wait=True, g = 0): Monte Carlo over
    (prefill wait, remaining output, gap, new tokens) with common random numbers across the grid of g.
    All horizons at once: arrays are (horizon, path)."""
    grid = np.array([0.0]) if wait else _progress_grid(inp.out, 24, min_tail)
    u_rem = rng.random(paths)
    w = draw(inp.pwait, rng.random(paths)) if wait else np.zeros(paths)
    gap = draw(inp.gap_turn, rng.random(paths))
    n_new = draw(inp.new, rng.random(paths))
    base = np.zeros((len(grid), 3, 5, len(hs)))
    cont_c = np.zeros_like(base)
    r = inp.rate
    h = hs[:, None]
    zero = np.zeros(len(hs))
    run = np.maximum(h - w, 0.0)  # time the decode could have run by h
    for k, g in enumerate(grid):
        rem = np.maximum(draw(np.sort(_tail(inp.out, g, min_tail)), u_rem) - g, 1.0)
        end = w + rem / r  # decode ends
        grow = rem + n_new  # context added before the next turn's decode
        sec = np.minimum(run, rem / r)
        still = ((h >= w) & (h < end)).astype(np.float64)
        ok = end + gap <= h
        a1, a2, s1, s2, i1, gi, g2i = _masked(cont.at(h - end - gap), ok)
        okf = ok.astype(np.float64)
        p_still = still.mean(axis=1)
        e0 = (still * r * run).mean(axis=1)
        base[k, 1] = (sec.mean(axis=1), zero, (sec**2).mean(axis=1), zero, zero)
        base[k, 2] = (e0, p_still, (still * (r * run) ** 2).mean(axis=1), 2 * e0, p_still)
        cont_c[k, 0] = (
            (okf * n_new + a1).mean(axis=1),
            zero,
            (okf * n_new**2 + 2 * n_new * a1 + a2).mean(axis=1),
            zero,
            zero,
        )
        cont_c[k, 1] = (s1.mean(axis=1), zero, (2 * sec * s1 + s2).mean(axis=1), zero, zero)
        p_i = i1.mean(axis=1)
        ce0 = (i1 * grow + gi).mean(axis=1)
        cont_c[k, 2] = (ce0, p_i, (i1 * grow**2 + 2 * grow * gi + g2i).mean(axis=1), 2 * ce0, p_i)
    return KindTable(grid, base, cont_c)


def build_task_table(
    samples: TaskSamples | None,
    rate_tokens_per_s: float,
    horizons_s: tuple[float, ...],
    rng: np.random.Generator,
    live_turns: np.ndarray | None = None,
    paths: int = 2048,
    min_tail: int = 20,
    start_turns: np.ndarray | None = None,
    prior: PriorSamples | None = None,
) -> TaskTable:
    """All tables of one task from its samples (None: priors only). Pure; seeded by `rng`.

    `live_turns`: current turn of this task's live trajectories (censored turn counts for the hazard);
    `start_turns`: the turns the continuation table's paths start at (default: the live trajectories' next);
    `prior`: other workloads' samples, weighed in beside this task's own (`lifecycle_model.PriorSamples`)."""
    from services.forecaster.picture import DECODE, PREFILL, QUEUED, TOOL_CALL

    hs = np.array(sorted(horizons_s), dtype=np.float64)
    inp = make_inputs(samples, rate_tokens_per_s, prior)
    live = live_turns if live_turns is not None else np.zeros(0, dtype=np.int64)
    hazard = turn_hazard(inp.turns, live, inp.finish_fraction)
    starts = start_turns if start_turns is not None else live + 1
    cont = continuation_table(
        inp, float(hs[-1]), rng, max(256, paths // 2), hazard=hazard, start_turns=starts
    )
    kinds = {
        TOOL_CALL: _tool_call_table(inp, cont, hs, min_tail),
        QUEUED: _queued_table(inp, cont, hs, min_tail),
        PREFILL: _decode_table(inp, cont, hs, rng, paths, min_tail, wait=True),
        DECODE: _decode_table(inp, cont, hs, rng, paths, min_tail, wait=False),
    }
    return TaskTable(hs, inp.rate, cont, kinds, hazard)
