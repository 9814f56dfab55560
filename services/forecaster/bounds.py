"""The physically possible range of demand over a horizon: what every issued quantile is kept inside. Pure.

Why: the allocator plans its risk scenarios on q10 / q50 / q90, so a quantile outside what the live trajectories
could possibly ask for is not a wide forecast but a wrong one (issue 32: a decode band of 8e7 tokens/s against a
few hundred realised). Every predictor's output passes through `clip` (`base.Predictor.forecast_triples`), after
calibration, so no path — a statsmodels member, a calibrator, the ensemble's average — can leave the range.

The range of metric m over (now, now + h] is [0, U_m(h)], U built from the live picture and the run's own limits
(`Limits`, learnt online from lifecycle events: the largest values seen, times `MARGIN`):
  N(h)     trajectories that may be in the model within h: the live ones, the driver's announced first turns due by
           now + h (`PendingArrival`), and A(h) more, A(h) = the most trajectory starts the run has seen within any
           span of h (an arrival process, the next RL step's burst: both have shown what they can bring);
  T(h)     turns one trajectory may submit within h: 1 + floor(h / c), c = the shortest turn-to-turn cycle seen
           (before one was seen: `PRIOR_CYCLE_S`);
  prefill  U = sum over queued trajectories of max(context, F) + announced prompts due by now + h + A(h) F
               + N(h) T(h) n, with n the largest new-token count of a later turn and F the largest first prompt;
  decode   U = N(h) r h, r = RATE_MARGIN times the fastest per-sequence decode rate seen (before one was seen:
           PRIOR_RATE_MAX): a sequence decoding alone at the end of a step runs faster than the loaded ones the
           run has timed so far, by up to the engine's batch-1 / loaded step-time ratio;
  decode_concurrency   U = N(h);
  kv       U = the live contexts + announced prompts + A(h) F + N(h) T(h) (n + o), o the largest output.
Token maxima are the largest observation so far times MARGIN; before a kind has a sample, its prior
(`lifecycle_model.PRIORS`) times MARGIN. A first observation larger than the margin lifts the bound at once, so a
bound can only be exceeded by a value the run has never shown before (counted by the evaluation as a miss).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import islice

import numpy as np

from services.forecaster.lifecycle_model import PRIORS

MARGIN = 1.5  # head-room over the largest token count the run has shown
RATE_MARGIN = 3.0  # head-room over the fastest per-sequence decode rate it has shown (module header)
# tokens/s per sequence before any was timed: faster than any engine we model decodes one sequence
PRIOR_RATE_MAX = 500.0
PRIOR_CYCLE_S = 1.0  # shortest turn-to-turn cycle assumed before one was seen (the gap prior: no decode time)
_MAX_STARTS = 65_536  # start times kept for A(h) (bounded memory)


@dataclass
class _Window:
    """A(h)'s sliding window: the starts within h of the newest one, the most it held, the starts it has seen."""

    times: deque[float] = field(default_factory=deque)
    best: int = 0
    done: int = 0


class Limits:
    """The run's largest observed values (module header), fed by `learner.EventLearner`."""

    def __init__(self) -> None:
        self.new_tokens_max = 0.0  # largest new-token count of a later turn
        self.first_prompt_max = 0.0  # largest first prompt
        self.output_tokens_max = 0.0  # largest output of one turn
        self.decode_rate_max = 0.0  # fastest per-sequence decode rate (tokens/s)
        self.cycle_min_s = math.inf  # shortest time between two turns of one trajectory
        self._starts: deque[float] = deque(maxlen=_MAX_STARTS)
        self._total = 0  # starts ever seen
        self._windows: dict[float, _Window] = {}  # h -> its sliding window over the starts

    # --- input ------------------------------------------------------------------------------------------------
    def started(self, now: float) -> None:
        if math.isfinite(now):
            self._starts.append(now)
            self._total += 1

    def turn(self, new_tokens: float, first: bool, cycle_s: float | None) -> None:
        if first:
            self.first_prompt_max = max(self.first_prompt_max, new_tokens)
        else:
            self.new_tokens_max = max(self.new_tokens_max, new_tokens)
        if cycle_s is not None and cycle_s > 0.0:
            self.cycle_min_s = min(self.cycle_min_s, cycle_s)

    def output(self, tokens: float) -> None:
        self.output_tokens_max = max(self.output_tokens_max, tokens)

    def decode_rate(self, tokens_per_s: float) -> None:
        if math.isfinite(tokens_per_s):
            self.decode_rate_max = max(self.decode_rate_max, tokens_per_s)

    # --- derived ----------------------------------------------------------------------------------------------
    @property
    def new_max(self) -> float:
        return MARGIN * max(self.new_tokens_max, PRIORS["new_tokens"])

    @property
    def first_max(self) -> float:
        return MARGIN * max(self.first_prompt_max, self.new_tokens_max, PRIORS["new_tokens"])

    @property
    def out_max(self) -> float:
        return MARGIN * max(self.output_tokens_max, PRIORS["output_tokens"])

    @property
    def rate_max(self) -> float:
        return RATE_MARGIN * self.decode_rate_max if self.decode_rate_max > 0.0 else PRIOR_RATE_MAX

    def turns_within(self, h: float) -> float:
        c = self.cycle_min_s if math.isfinite(self.cycle_min_s) else PRIOR_CYCLE_S
        return 1.0 + math.floor(h / max(c, 1e-3))

    def arrivals_within(self, h: float) -> int:
        """A(h): the most starts seen within any span of h seconds (module header). A sliding window per h over
        the starts since the last call (O(1) per start: a run of 10,000 trajectories asks every second)."""
        w = self._windows.setdefault(h, _Window())
        fresh = min(self._total - w.done, len(self._starts))
        for t in reversed(list(islice(reversed(self._starts), fresh))):
            w.times.append(t)
            while w.times[0] < t - h:
                w.times.popleft()
            w.best = max(w.best, len(w.times))
        w.done = self._total
        return w.best


def demand_bound(
    limits: Limits,
    n_live: int,
    queued_context: np.ndarray,
    live_context_tokens: float,
    pending: Sequence[tuple[float, float]],
    horizons: Sequence[float],
) -> dict[str, list[float]]:
    """U_m(h) per metric and horizon (module header).

    `queued_context`: the contexts of the live trajectories still waiting for their first turn; `pending`:
    (seconds from now, prompt tokens) of the driver's announced first turns."""
    n_max, f_max, o_max, r_max = limits.new_max, limits.first_max, limits.out_max, limits.rate_max
    queued = float(np.maximum(queued_context, f_max).sum()) if len(queued_context) else 0.0
    out: dict[str, list[float]] = {
        m: [] for m in ("prefill_tokens", "decode_tokens", "decode_concurrency", "kv_tokens")
    }
    for h in horizons:
        due = [tokens for tau, tokens in pending if tau <= h]
        a = limits.arrivals_within(h)
        n = n_live + len(due) + a
        turns = limits.turns_within(h)
        announced = float(sum(due)) + a * f_max
        out["prefill_tokens"].append(queued + announced + n * turns * n_max)
        out["decode_tokens"].append(n * r_max * h)
        out["decode_concurrency"].append(float(n))
        out["kv_tokens"].append(live_context_tokens + announced + n * turns * (n_max + o_max))
    return out
