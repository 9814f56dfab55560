"""The lifecycle model's ingredients: empirical inputs per task, the turn-count hazard, the continuation table.

The model (a semi-Markov renewal process per trajectory, every distribution empirical and per task):
  turn submitted -> prefill wait W -> decode of L tokens at r tokens/s -> gap D outside the model -> the next
  turn (bringing N new prompt tokens) or the trajectory's end -> ...
Whether a gap ends in a turn or the end is decided by the turn-count hazard h(k) = P(T = k+1 | T >= k+1), T the
number of turns of a trajectory and k the 0-based index of the turn that just ended — estimated with live
trajectories as censored observations (Kaplan–Meier style: a trajectory live at turn j is known to have T > k+1
for every k < j), so early in a run, before long trajectories finish, the hazard is not overstated.

The continuation table holds the first two moments of what a trajectory does over the next u seconds after a turn
was just submitted (Monte Carlo over seeded paths, on a grid of u): later arrivals' new tokens, seconds spent
decoding, P(decoding at u) and the context it then holds. Its later gaps end the trajectory with the
hazard of their turn, the paths starting at turns drawn from the live trajectories' next turns: one table per task
serves every trajectory, so for a given trajectory the later turns' hazards are the population's (a documented
approximation; the next turn's own outcome is exact per trajectory, see lifecycle_tables).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # a type only: distributions imports bounds, which reads PRIORS from here
    from services.forecaster.distributions import TaskSamples

# Stand-ins before anything is observed: a 1 s gap always followed by a turn, 256 output and new tokens per
# turn, no prefill or queue wait, 30 tokens/s per sequence. Where they come from: round numbers of the right
# order for an LLM agent turn, fitted to no trace; each is replaced by the run's own samples as soon as one
# exists (a kind with no sample at all is the only place a prior is read), unless a `PriorSamples` is given.
PRIORS = {"gap_s": 1.0, "output_tokens": 256.0, "new_tokens": 256.0, "decode_rate_tokens_per_s": 30.0}
PRIOR_POINTS = 64  # quantiles a `PriorSamples` distribution is summarised by


@dataclass(frozen=True)
class PriorSamples:
    """What a new workload is expected to look like before its own first trajectories say: per kind, samples
    from other workloads (`prorsa.forecast_eval.loto` pools the other shipped traces, the left-out one never).
    A kind's prior is its whole distribution instead of one round number, and it adapts online the way `PRIORS`
    do: the run's first own observation of the kind replaces it.

    Why not keep it beside the run's own samples as a few pseudo-observations (tried: 8, weight 8 / (n + 8)):
    other agents' distributions are heavy-tailed and far apart (new tokens per later turn: a median of 63 on
    math, 1,485 on general), so even 8 pseudo-observations moved a kind's mean for dozens of observations; left
    out, math's prefill WAPE went from 0.42x to 1.60x naive's and azure-code's decode from 0.57x to 1.69x
    (docs/benchmarks.md, "Bands with a bound, leave-one-trace-out")."""

    gap_s: np.ndarray  # tool latencies (s), gaps that end in a turn
    output_tokens: np.ndarray  # output tokens per turn
    new_tokens: np.ndarray  # new prompt tokens per later turn

    def points(self, kind: str) -> np.ndarray:
        """PRIOR_POINTS evenly spaced quantiles of the kind's samples (empty without samples)."""
        x = np.asarray(getattr(self, kind), dtype=np.float64)
        x = x[np.isfinite(x) & (x >= 0.0)]
        if not len(x):
            return np.zeros(0)
        return np.quantile(x, (np.arange(PRIOR_POINTS) + 0.5) / PRIOR_POINTS)


@dataclass(frozen=True)
class Inputs:
    """One task's samples, with priors filled in where nothing was observed."""

    gap: np.ndarray  # every gap's duration (s)
    gap_is_turn: np.ndarray  # its outcome: True = next turn, False = end of trajectory
    gap_turn: np.ndarray  # durations of gaps that ended in a turn (never empty)
    gap_finish: np.ndarray  # durations of gaps that ended the trajectory (may be empty)
    qwait: np.ndarray  # queue waits (may be empty: first turns are submitted at once)
    pwait: np.ndarray  # prefill waits (never empty)
    out: np.ndarray  # output tokens per turn (never empty, >= 1)
    new: np.ndarray  # new prompt tokens per later turn (never empty)
    turns: np.ndarray  # turns per ended trajectory (may be empty)
    rate: float  # per-sequence decode rate, tokens/s

    @property
    def mu_new(self) -> float:
        return float(self.new.mean())

    @property
    def new_sq(self) -> float:
        return float(np.mean(self.new**2))

    @property
    def finish_fraction(self) -> float:
        return float(1.0 - self.gap_is_turn.mean()) if len(self.gap_is_turn) else 0.0


def make_inputs(s: TaskSamples | None, rate: float, prior: PriorSamples | None = None) -> Inputs:
    """One task's model inputs: its samples; where a kind has none yet, `prior`'s distribution of it
    (`PriorSamples`), else the round `PRIORS`."""
    empty = np.zeros(0)

    def get(name: str) -> np.ndarray:
        own = empty if s is None else getattr(s, name)
        if not len(own) and prior is not None and name in ("output_tokens", "new_tokens"):
            return prior.points(name)
        return own

    gap, is_turn = get("gap_s"), (np.zeros(0, dtype=bool) if s is None else s.gap_is_turn)
    if not len(gap) and prior is not None:  # the prior's gaps are gaps that end in a turn
        gap = prior.points("gap_s")
        is_turn = np.ones(len(gap), dtype=bool)
    gap_turn = gap[is_turn] if len(gap) else empty
    if not len(gap_turn):
        gap_turn = np.array([PRIORS["gap_s"]])
    if not len(gap):
        gap, is_turn = gap_turn, np.ones(len(gap_turn), dtype=bool)
    out, new, pwait = get("output_tokens"), get("new_tokens"), get("prefill_wait_s")
    return Inputs(
        gap=gap,
        gap_is_turn=is_turn,
        gap_turn=gap_turn,
        gap_finish=gap[~is_turn],
        qwait=get("queue_wait_s"),
        pwait=pwait if len(pwait) else np.zeros(1),
        out=np.maximum(out if len(out) else np.array([PRIORS["output_tokens"]]), 1.0),
        new=new if len(new) else np.array([PRIORS["new_tokens"]]),
        turns=get("turns"),
        rate=rate if rate > 0.0 else PRIORS["decode_rate_tokens_per_s"],
    )


def turn_hazard(
    turns: np.ndarray, live_turns: np.ndarray, fallback: float, max_turn: int = 1024, min_at_risk: int = 10
) -> np.ndarray:
    """h[k] = P(a trajectory ends after turn k | it reached turn k), k = 0..K; the last entry holds for all k >= K.

    `turns`: turn counts of ended trajectories; `live_turns`: 0-based current turn of live ones (censored).
    Where fewer than `min_at_risk` trajectories are at risk, the tail's pooled rate is used (or the average over
    all turns); with no trajectory at risk enough anywhere, `fallback`."""
    t = np.clip(turns.astype(np.int64), 1, max_turn + 1) - 1  # index of the last turn
    live = np.clip(live_turns.astype(np.int64), 0, max_turn + 1)
    size = int(max(t.max(initial=0), live.max(initial=0))) + 2
    events = np.bincount(t, minlength=size).astype(np.float64)[:size]
    # at risk at k: ended with last turn >= k, or live at a turn > k
    ended_at_risk = np.cumsum(events[::-1])[::-1]
    live_count = np.bincount(live, minlength=size + 1).astype(np.float64)[: size + 1]
    live_at_risk = np.cumsum(live_count[::-1])[::-1][1:]
    at_risk = ended_at_risk + live_at_risk
    h = np.where(at_risk > 0, events / np.maximum(at_risk, 1.0), 0.0)
    reliable = at_risk >= min_at_risk
    if not reliable.any():
        return np.array([fallback])
    last = int(np.nonzero(reliable)[0][-1])
    tail_events, tail_risk = events[last + 1 :].sum(), at_risk[last + 1 :].sum()
    # Beyond the turns with enough trajectories at risk: their pooled rate, else the average over all turns.
    tail = tail_events / tail_risk if tail_risk >= min_at_risk else events.sum() / at_risk.sum()
    h = np.append(np.where(reliable, h, tail)[: last + 1], tail)
    return np.clip(h, 0.0, 1.0)


def impute_censored(
    samples: np.ndarray,
    censored: np.ndarray,
    rng: np.random.Generator,
    flags: np.ndarray | None = None,
    min_tail: int = 20,
) -> tuple[np.ndarray, np.ndarray | None]:
    """`samples` plus one completed value per censored observation c (a duration or length known to be > c).

    Why: the samples are the gaps and outputs that have *ended*; the long ones still in progress are missing, so
    early in a run (or a step) the sample is biased short and the model cycles trajectories too fast. Each c is
    completed by a draw from the samples above c (redistribution to the right, the Kaplan-Meier idea, done by
    imputation so the tables keep equally weighted samples); where fewer than `min_tail` lie above c, from the
    `min_tail` largest scaled by c / x0, x0 the largest value with `min_tail` samples above it (a scale-free
    tail, as in `lifecycle_tables._tail`). `flags` (a gap's outcome) are carried with the drawn sample.
    Returns (values, flags or None); the samples unchanged when there is nothing censored or too few samples."""
    c = censored[censored > 0.0]
    n = len(samples)
    if not len(c) or n <= min_tail:
        return samples, flags
    order = np.argsort(samples, kind="stable")
    s = samples[order]
    first_above = np.searchsorted(s, c, side="right")
    few = n - first_above < min_tail
    lo = np.where(few, n - min_tail, first_above)
    idx = lo + np.minimum((rng.random(len(c)) * (n - lo)).astype(np.int64), n - lo - 1)
    x0 = s[n - min_tail - 1]
    scale = np.where(few & (c > x0) & (x0 > 0.0), c / max(x0, 1e-300), 1.0)
    values = np.concatenate((samples, s[idx] * scale))
    if flags is None:
        return values, None
    return values, np.concatenate((flags, flags[order][idx]))


def draw(a: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Resample `a` with uniforms `u` (common random numbers: the same u pick the same ranks of sorted a)."""
    return a[np.minimum((u * len(a)).astype(np.int64), len(a) - 1)]


@dataclass(frozen=True)
class ContTable:
    """Moments over paths that start with a turn just submitted, on the remaining-time grid `u`."""

    u: np.ndarray  # (n_u,) seconds
    a1: np.ndarray  # E[new prompt tokens of later arrivals within u]
    a2: np.ndarray  # E[...^2]
    s1: np.ndarray  # E[seconds decoding within u]
    s2: np.ndarray
    i1: np.ndarray  # P(decoding at u)
    gi: np.ndarray  # E[growth * 1(decoding at u)], growth = tokens added to the context since the start
    g2i: np.ndarray  # E[growth^2 * 1(decoding at u)]

    def at(self, rem: np.ndarray) -> tuple[np.ndarray, ...]:
        """The seven moments at remaining times `rem` (clipped to the grid; zero for rem < 0 is the caller's).

        Linear interpolation on the grid, which is uniform (`continuation_table`): the bracket is found by one
        division and shared by the seven arrays (seven `np.interp` calls would search seven times)."""
        u = self.u
        x = np.clip(rem, 0.0, u[-1])
        if len(u) < 2:
            return tuple(np.full(np.shape(x), arr[0]) for arr in self._stacked())
        step = u[1] - u[0]
        i = np.minimum((x / step).astype(np.int64), len(u) - 2)
        w = x - u[i]
        out = []
        for arr in self._stacked():
            lo = arr[i]
            out.append(lo + (arr[i + 1] - lo) * (w / step))
        return tuple(out)

    def _stacked(self) -> tuple[np.ndarray, ...]:
        return (self.a1, self.a2, self.s1, self.s2, self.i1, self.gi, self.g2i)


def continuation_table(
    inp: Inputs,
    u_max: float,
    rng: np.random.Generator,
    paths: int = 1024,
    n_u: int = 91,
    hazard: np.ndarray | None = None,
    start_turns: np.ndarray | None = None,
) -> ContTable:
    """Monte-Carlo moments of a trajectory whose turn was just submitted (see the module header).

    With `hazard` and `start_turns` (the turn indices paths start at, e.g. the live trajectories' next turns),
    each later gap ends the trajectory with the hazard of its turn; otherwise with the gaps' observed outcomes.

    Each path's quantities are piecewise polynomial in u (a decode contributes on [start, end) and a constant
    after; an arrival is a step), so a turn is recorded in O(paths) as jumps of polynomial coefficients in
    difference arrays, summed over the grid once at the end, instead of O(paths x grid) work per turn."""
    u = np.linspace(0.0, u_max, n_u)
    # Difference arrays (coefficient, path, grid): a coefficient at grid point j is the cumulative sum to j.
    # Coefficients: arrivals' tokens; seconds decoded s0 + s1 u; decoding indicator; context grown while decoding
    # g0 + g1 u; its square q0 + q1 u + q2 u^2.
    A, S0, S1, IND, G0, G1, Q0, Q1, Q2 = range(9)
    d = np.zeros((9, paths, n_u + 1))
    start = np.zeros(paths)
    grown = np.zeros(paths)
    alive = np.ones(paths, dtype=bool)
    by_hazard = hazard is not None and start_turns is not None and len(start_turns) > 0
    turn = (
        draw(np.sort(start_turns), rng.random(paths)).astype(np.int64)
        if by_hazard
        else np.zeros(paths, np.int64)
    )
    r = inp.rate
    while alive.any():
        w = draw(inp.pwait, rng.random(paths))
        dur = draw(inp.out, rng.random(paths)) / r
        n_new = draw(inp.new, rng.random(paths))
        if by_hazard:
            gap = draw(inp.gap_turn, rng.random(paths))
            goes_on = rng.random(paths) >= hazard[np.minimum(turn, len(hazard) - 1)]
        else:
            gidx = np.minimum((rng.random(paths) * len(inp.gap)).astype(np.int64), len(inp.gap) - 1)
            gap, goes_on = inp.gap[gidx], inp.gap_is_turn[gidx]
        ds = start + w
        rows = np.nonzero(alive)[0]
        t0, t1 = ds[rows], ds[rows] + dur[rows]
        lo = np.searchsorted(u, t0, "left")  # first grid point decoding (u >= start) ...
        hi = np.searchsorted(u, t1, "left")  # ... and the first one after (u >= end)
        c0 = grown[rows] - r * t0  # context grown by u while decoding: c0 + r u
        one = np.ones(len(rows))
        band = np.stack([0 * one, -t0, one, one, c0, r * one, c0 * c0, 2.0 * r * c0, r * r * one])
        d[:, rows, lo] += band  # rows are distinct: plain fancy-index adds are exact
        d[:, rows, hi] -= band
        d[S0, rows, hi] += dur[rows]  # after the decode: all of it
        nxt = ds + dur + gap
        alive = alive & goes_on & (nxt <= u_max)
        back = np.nonzero(alive)[0]
        d[A, back, np.searchsorted(u, nxt[back], "left")] += n_new[back]
        grown = grown + dur * r + n_new
        start = nxt
        turn = turn + 1
    c = np.cumsum(d[:, :, :n_u], axis=2)
    a = c[A]
    s = c[S0] + c[S1] * u
    gi = c[G0] + c[G1] * u
    g2i = c[Q0] + c[Q1] * u + c[Q2] * u * u
    m = lambda x: x.mean(axis=0)  # noqa: E731
    return ContTable(u, m(a), m(a * a), m(s), m(s * s), m(c[IND]), m(gi), m(g2i))
