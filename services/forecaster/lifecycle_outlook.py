"""`lifecycle`'s demand outlook (`outlook.py`): the turns ahead from its per-task figures and the live picture.

Per live task, from the task's figures (`lifecycle_tables.TurnFigures`, made at every refit from the task's own
samples, kind by kind the pooled task's where it has fewer than a few) and each live trajectory i at turn k_i:
  new_tokens, output_tokens, tool_s  the task's per-turn distributions (the samples, priors where there are none —
                                     then `observed` is 0);
  turns                              the task's turn rate by Little's law over the two stations whose times do not
                                     depend on the split: λ = (in a tool call + decoding) / (E[tool s] + E[output] /
                                     r), r the per-sequence decode rate the forecast uses (the prefill station's wait
                                     is the queue the split makes, and the learned waits lag it by the minute their
                                     ring covers: at 512 trajectories they priced a tail of short waits at 15-22 s);
                                     over the horizon h, λ h turns, a Poisson count;
  per trajectory                     its share of those turns ∝ k_i + 1, the turns it has made: in an RL step, whose
                                     trajectories start together, its turn rate so far (the fast ones have made
                                     more turns, and longer contexts; weighing each trajectory alike put the
                                     context of the turns ahead 10-15 % below the turns' own at 512 trajectories);
  context_tokens                     each trajectory's context at its next prefill — queued or in prefill: its
                                     context now (that prefill is this turn's); in a tool call: its context plus
                                     a turn's mean new tokens; decoding g tokens: plus the rest of its answer,
                                     E[L - g | L > g], too — weighted by its share of the turns and the
                                     probability that the next turn comes, 1 - h(k_i) (`TaskTable.hazard`; 1 for a
                                     turn already submitted; h the task's turn-count hazard, `TurnFigures.hazard`);
  finished                           each turn ends its trajectory with the hazard of its turn: λ h Σ share_i h(k_i),
                                     a Poisson count.
The figures are the refit's (every 30 s, or sooner on news): they lag as the forecast's own tables do.
Cost: one pass of a few vector operations per task over its live trajectories.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from proto import MAX_OUTLOOK_S, MAX_OUTLOOK_TOKENS, Estimate, TaskOutlook
from services.forecaster.lifecycle_tables import Figure, TurnFigures
from services.forecaster.outlook import count_estimate, outlook_row, population, weighted_estimate
from services.forecaster.picture import DECODE, PREFILL, TOOL_CALL, Picture


def _estimate(f: Figure, observed: int, limit: float) -> Estimate:
    """A per-turn figure held within [0, limit] (its samples are; the guard is for a prior's or a bug's)."""
    mean, q10, q50, q90 = (min(max(0.0, v), limit) for v in f)
    return Estimate(mean=mean, q10=q10, q50=max(q10, q50), q90=max(q10, q50, q90), observed=observed)


def lifecycle_outlook(
    pic: Picture, figures_of: Callable[[str], TurnFigures], rate_tokens_per_s: float, horizon_s: float
) -> list[TaskOutlook]:
    """Per live task of `pic`, its outlook over `horizon_s` (module header). `figures_of(task)`: one turn of the
    task; `rate_tokens_per_s`: the per-sequence decode rate the forecast uses (0: the one learned at the refit)."""
    pop = population(pic)
    out = []
    for code, task in enumerate(pic.task_names):
        mine = pic.task == code
        if not mine.any():
            continue
        f = figures_of(task)
        state, ctx, turn = pic.state[mine], pic.context[mine], pic.turn[mine]
        hazard = f.hazard[np.minimum(turn, len(f.hazard) - 1)]
        submitted = state <= PREFILL  # queued or in prefill: the next prefill is this turn's
        p_next = np.where(submitted, 1.0, 1.0 - hazard)
        decoding = state == DECODE
        rest = np.zeros(len(state))
        rest[decoding] = f.remaining_output(pic.generated[mine][decoding])
        ahead = np.where(submitted, ctx, ctx + rest + f.new_tokens[0])
        rate = rate_tokens_per_s if rate_tokens_per_s > 0.0 else f.decode_rate_tokens_per_s
        looping = float(pop[code][DECODE] + pop[code][TOOL_CALL])
        turns_per_s = looping / max(f.tool_s[0] + f.output_tokens[0] / max(rate, 1e-9), 1e-9)
        share = turn + 1.0
        share = share / share.sum()
        live = int(mine.sum())
        new_obs, out_obs, tool_obs = f.observed
        out.append(
            outlook_row(
                task,
                pop[code],
                turns=count_estimate(turns_per_s * horizon_s, live),
                finished=count_estimate(turns_per_s * horizon_s * float(np.dot(share, hazard)), live),
                new_tokens=_estimate(f.new_tokens, new_obs, MAX_OUTLOOK_TOKENS),
                output_tokens=_estimate(f.output_tokens, out_obs, MAX_OUTLOOK_TOKENS),
                context_tokens=weighted_estimate(ahead, share * p_next, MAX_OUTLOOK_TOKENS),
                tool_s=_estimate(f.tool_s, tool_obs, MAX_OUTLOOK_S),
            )
        )
    return out
