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


@dataclass(frozen=True)
class TaskTable:
    horizons_s: np.ndarray  # (H,)
    decode_rate_tokens_per_s: float
    cont: ContTable
    kinds: dict[int, KindTable]  # state code (picture.QUEUED ...) -> table
    hazard: np.ndarray  # P(end after turn k | reached k), the last entry for every later k

    def next_turn_prob(self, turn: np.ndarray) -> np.ndarray:
        return 1.0 - self.hazard[np.minimum(turn, len(self.hazard) - 1)]


def _progress_grid(samples: np.ndarray, points: int, min_tail: int) -> np.ndarray:
    """0, then sample quantiles, keeping only points with at least `min_tail` samples strictly above them (beyond
    the last point a trajectory is treated as at that point: the data say nothing finer there)."""
    if len(samples) <= min_tail:
        return np.array([0.0])
    top = 1.0 - min_tail / len(samples)
    grid = np.unique(np.concatenate(([0.0], np.quantile(samples, np.linspace(0.0, top, points - 1)))))
    above = len(samples) - np.searchsorted(np.sort(samples), grid, side="right")
    return grid[(above >= min_tail) | (grid == 0.0)]


def _tail(samples: np.ndarray, x: float, min_tail: int) -> np.ndarray:
    """Samples > x; at least the `min_tail` largest (extrapolation beyond the data)."""
    above = samples[samples > x]
    if len(above) >= min_tail or len(samples) <= min_tail:
        return above if len(above) else np.sort(samples)[-1:]
    return np.sort(samples)[-min_tail:]


def _masked(values: tuple[np.ndarray, ...], ok: np.ndarray) -> tuple[np.ndarray, ...]:
    return tuple(np.where(ok, v, 0.0) for v in values)


def _first_arrival(
    waits: np.ndarray, inp: Inputs, cont: ContTable, hs: np.ndarray, known_tokens: bool, min_tail: int
) -> tuple[np.ndarray, np.ndarray]:
    """(grid, coefficients) of a trajectory waiting for its next turn, given the time already spent.

    known_tokens=False (tool_call): the turn brings N ~ new tokens; KV = I (c + N + G).
    known_tokens=True (queued): the turn is the context itself; prefill = c + later arrivals, KV = I (c + G)."""
    grid = _progress_grid(waits, 24, min_tail) if len(waits) else np.array([0.0])
    coefs = np.zeros((len(grid), 3, 5, len(hs)))
    mu, nsq = inp.mu_new, inp.new_sq
    for k, x in enumerate(grid):
        tau = np.maximum(_tail(waits, x, min_tail) - x, 0.0) if len(waits) else np.zeros(1)
        m = len(tau)
        for j, h in enumerate(hs):
            ok = tau <= h
            a1, a2, s1, s2, i1, gi, g2i = (v.sum() / m for v in _masked(cont.at(h - tau), ok))
            p = ok.sum() / m
            if known_tokens:
                coefs[k, 0, :, j] = (a1, p, a2, 2 * a1, p)
                coefs[k, 2, :, j] = (gi, i1, g2i, 2 * gi, i1)
            else:
                coefs[k, 0, :, j] = (p * mu + a1, 0.0, p * nsq + 2 * mu * a1 + a2, 0.0, 0.0)
                e0 = mu * i1 + gi
                coefs[k, 2, :, j] = (e0, i1, nsq * i1 + 2 * mu * gi + g2i, 2 * e0, i1)
            coefs[k, 1, :, j] = (s1, 0.0, s2, 0.0, 0.0)
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
    (prefill wait, remaining output, gap, new tokens) with common random numbers across the grid of g."""
    grid = np.array([0.0]) if wait else _progress_grid(inp.out, 24, min_tail)
    u_rem = rng.random(paths)
    w = draw(inp.pwait, rng.random(paths)) if wait else np.zeros(paths)
    gap = draw(inp.gap_turn, rng.random(paths))
    n_new = draw(inp.new, rng.random(paths))
    base = np.zeros((len(grid), 3, 5, len(hs)))
    cont_c = np.zeros_like(base)
    r = inp.rate
    for k, g in enumerate(grid):
        rem = np.maximum(draw(np.sort(_tail(inp.out, g, min_tail)), u_rem) - g, 1.0)
        end = w + rem / r  # decode ends
        grow = rem + n_new  # context added before the next turn's decode
        for j, h in enumerate(hs):
            sec = np.clip(h - w, 0.0, rem / r)
            still = (h >= w) & (h < end)
            ok = end + gap <= h
            a1, a2, s1, s2, i1, gi, g2i = _masked(cont.at(h - end - gap), ok)
            e0 = np.mean(still * r * (h - w))
            base[k, 1, :, j] = (np.mean(sec), 0.0, np.mean(sec**2), 0.0, 0.0)
            base[k, 2, :, j] = (
                e0,
                np.mean(still),
                np.mean(still * (r * (h - w)) ** 2),
                2 * e0,
                np.mean(still),
            )
            okf = ok.astype(np.float64)
            cont_c[k, 0, :, j] = (
                np.mean(okf * n_new + a1),
                0.0,
                np.mean(okf * n_new**2 + 2 * n_new * a1 + a2),
                0.0,
                0.0,
            )
            cont_c[k, 1, :, j] = (np.mean(s1), 0.0, np.mean(2 * sec * s1 + s2), 0.0, 0.0)
            ce0 = np.mean(i1 * grow + gi)
            cont_c[k, 2, :, j] = (
                ce0,
                np.mean(i1),
                np.mean(i1 * grow**2 + 2 * grow * gi + g2i),
                2 * ce0,
                np.mean(i1),
            )
    return KindTable(grid, base, cont_c)


def build_task_table(
    samples: TaskSamples | None,
    rate_tokens_per_s: float,
    horizons_s: tuple[float, ...],
    rng: np.random.Generator,
    live_turns: np.ndarray | None = None,
    paths: int = 2048,
    min_tail: int = 20,
) -> TaskTable:
    """All tables of one task from its samples (None: priors only). Pure; seeded by `rng`.

    `live_turns`: current turn of this task's live trajectories (censored turn counts for the hazard)."""
    from services.forecaster.picture import DECODE, PREFILL, QUEUED, TOOL_CALL

    hs = np.array(sorted(horizons_s), dtype=np.float64)
    inp = make_inputs(samples, rate_tokens_per_s)
    live = live_turns if live_turns is not None else np.zeros(0, dtype=np.int64)
    hazard = turn_hazard(inp.turns, live, inp.finish_fraction)
    cont = continuation_table(
        inp, float(hs[-1]), rng, max(256, paths // 2), hazard=hazard, start_turns=live + 1
    )
    kinds = {
        TOOL_CALL: _tool_call_table(inp, cont, hs, min_tail),
        QUEUED: _queued_table(inp, cont, hs, min_tail),
        PREFILL: _decode_table(inp, cont, hs, rng, paths, min_tail, wait=True),
        DECODE: _decode_table(inp, cont, hs, rng, paths, min_tail, wait=False),
    }
    return TaskTable(hs, inp.rate, cont, kinds, hazard)
