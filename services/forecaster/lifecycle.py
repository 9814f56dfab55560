"""`lifecycle`: demand from the tracker's per-trajectory picture and the learned lifecycle distributions.

Each live trajectory contributes according to its state and progress (see `lifecycle_tables.py` for the model):
  tool_call  returns within h with P(D <= s + h | D > s) from the task's empirical gap distribution (s = time
             already spent), bringing N new prompt tokens, then decodes, and may come back again within h;
  decode     emits E[min(L - g, r h) | L > g] more tokens within h (capped at the observed per-sequence rate r),
             then leaves the model and may return within h;
  prefill    its prompt arrived already; it will decode (and may return) within h;
  queued     its first prompt (the context tokens) arrives per the task's queue-wait distribution — or exactly at
             the time of a `PendingArrival` hint naming it; hints without a trajectory id are first turns of
             trajectories the driver has not started yet.
Contributions are summed with their variances, and q10/q50/q90 come from a normal approximation of the sum.

Tables are rebuilt by `refit_job` (pure, seeded; the service runs it on a thread) from a frozen copy of the
distributions; until the first refit the tables are built from `PRIORS`. Tasks with fewer than
`min_task_samples` gaps or output lengths use the pooled task's tables.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from services.forecaster.base import MetricForecast, Predictor, normal_triple, register
from services.forecaster.distributions import POOLED, DistributionsView
from services.forecaster.lifecycle_stack import Stack, build_stack, stacked_moments
from services.forecaster.lifecycle_tables import TaskTable, build_task_table
from services.forecaster.picture import DECODE, QUEUED, Picture
from services.forecaster.series import HORIZONS_S


@register("lifecycle")
class LifecyclePredictor(Predictor):
    name = "lifecycle"

    def __init__(
        self,
        horizons_s: Sequence[float] = HORIZONS_S,
        window_s: float = 1.0,
        seed: int = 0,
        paths: int = 2048,
        min_task_samples: int = 30,
    ) -> None:
        super().__init__(horizons_s, window_s)
        self.paths = paths
        self.min_task_samples = min_task_samples
        self._seeds = np.random.SeedSequence(seed)
        self.picture: Picture | None = None
        self._fitted_version = -1
        self._stacked: tuple[dict[str, TaskTable], Stack] | None = None
        self._scratch: dict[str, np.ndarray] = {}  # reusable buffers of the vectorised sum
        self.tables: dict[str, TaskTable] = {
            POOLED: build_task_table(
                None, 0.0, self.horizons_s, np.random.default_rng(self._seeds.spawn(1)[0]), paths=paths
            )
        }

    def _on_picture(self, picture: Picture) -> None:
        self.picture = picture

    # --- fitting ----------------------------------------------------------------------------------------------
    def refit_job(self, now: float) -> Callable[[], Any] | None:
        pic = self.picture
        if pic is None or pic.distributions is None:
            return None
        view = pic.distributions.freeze()
        if view.version == self._fitted_version and not pic.decode_rate_tokens_per_s:
            return None
        rate = pic.decode_rate_tokens_per_s or view.decode_rate_tokens_per_s
        live = {name: pic.turn[pic.task == code] for code, name in enumerate(pic.task_names)}
        live[POOLED] = pic.turn
        seed = self._seeds.spawn(1)[0]
        hs, paths, min_n = self.horizons_s, self.paths, self.min_task_samples

        def job() -> tuple[int, dict[str, TaskTable]]:
            return view.version, build_tables(view, rate, hs, np.random.default_rng(seed), live, paths, min_n)

        return job

    def install(self, fitted: tuple[int, dict[str, TaskTable]]) -> None:
        self._fitted_version, self.tables = fitted

    # --- forecasting ------------------------------------------------------------------------------------------
    def _forecast(self, now: float, horizons: tuple[float, ...]) -> MetricForecast:
        pooled = self.tables[POOLED]
        hs_t = pooled.horizons_s
        sums = {q: [np.zeros(len(hs_t)), np.zeros(len(hs_t))] for q in ("prefill", "decode", "seconds", "kv")}
        pic = self.picture
        if pic is not None and pic.n:
            self._add_trajectories(pic, now, sums)
        if pic is not None and pic.pending:
            self._add_pending(pic, now, sums)
        out: MetricForecast = {
            m: [] for m in ("prefill_tokens", "decode_tokens", "decode_concurrency", "kv_tokens")
        }
        for h in horizons:
            mean = {q: _at(hs_t, v[0], h) for q, v in sums.items()}
            var = {q: _at(hs_t, v[1], h) for q, v in sums.items()}
            out["prefill_tokens"].append(normal_triple(mean["prefill"], var["prefill"]))
            out["decode_tokens"].append(normal_triple(mean["decode"], var["decode"]))
            out["decode_concurrency"].append(normal_triple(mean["seconds"] / h, var["seconds"] / (h * h)))
            out["kv_tokens"].append(normal_triple(mean["kv"], var["kv"]))
        return out

    def _table(self, task: str) -> TaskTable:
        return self.tables.get(task) or self.tables[POOLED]

    def _stack(self) -> Stack:
        """The current tables stacked for one vectorised pass (rebuilt when a refit installs new tables)."""
        if self._stacked is None or self._stacked[0] is not self.tables:
            self._stacked = (self.tables, build_stack(self.tables))
        return self._stacked[1]

    def _add_trajectories(self, pic: Picture, now: float, sums: dict[str, list[np.ndarray]]) -> None:
        stack = self._stack()
        age_s = max(0.0, now - pic.ts_s)
        slot = np.array([stack.slot(name) for name in pic.task_names], dtype=np.int64)[pic.task]
        state = pic.state.astype(np.int64)
        x = np.where(state == DECODE, pic.generated, pic.time_in_state_s + age_s)
        turn, ctx = pic.turn, pic.context
        named = {p.traj_id for p in pic.pending if p.traj_id}
        if named:  # queued trajectories named by a hint follow the hint instead
            hinted = np.fromiter((t in named for t in pic.traj_ids), dtype=bool, count=pic.n)
            keep = ~(hinted & (state == QUEUED))
            slot, state, x, turn, ctx = slot[keep], state[keep], x[keep], turn[keep], ctx[keep]
        mean, var = stacked_moments(stack, slot, state, x, turn, ctx, self._scratch)
        self._accumulate(sums, self.tables[POOLED], mean, var)

    def _add_pending(self, pic: Picture, now: float, sums: dict[str, list[np.ndarray]]) -> None:
        """Hinted first turns: `prompt_tokens` arrive at `at_s` exactly, then the continuation table."""
        by_task: dict[str, list[tuple[float, float]]] = {}
        for p in pic.pending:
            by_task.setdefault(p.task, []).append((max(0.0, p.at_s - now), float(p.prompt_tokens)))
        for task, items in by_task.items():
            table = self._table(task)
            tau, c = (np.array(v)[:, None] for v in zip(*items, strict=True))
            rem = table.horizons_s[None, :] - tau  # (hints, H)
            ok = rem >= 0.0
            a1, a2, s1, s2, i1, gi, g2i = (np.where(ok, v, 0.0) for v in table.cont.at(rem))
            mean = np.stack([np.where(ok, c, 0.0) + a1, s1, c * i1 + gi])  # (3, hints, H)
            second = np.stack([np.where(ok, c * c + 2 * c * a1, 0.0) + a2, s2, c * c * i1 + 2 * c * gi + g2i])
            var = np.maximum(second - mean * mean, 0.0)
            self._accumulate(sums, table, mean.sum(axis=1), var.sum(axis=1))

    @staticmethod
    def _accumulate(
        sums: dict[str, list[np.ndarray]], table: TaskTable, mean: np.ndarray, var: np.ndarray
    ) -> None:
        r = table.decode_rate_tokens_per_s
        for i, q in enumerate(("prefill", "seconds", "kv")):
            sums[q][0] += mean[i]
            sums[q][1] += var[i]
        sums["decode"][0] += r * mean[1]
        sums["decode"][1] += r * r * var[1]


def _at(hs: np.ndarray, values: np.ndarray, h: float) -> float:
    """A table value at horizon h: exact on the table's horizons, linear in between (0 at h = 0)."""
    return float(np.interp(h, np.concatenate(([0.0], hs)), np.concatenate(([0.0], values))))


def build_tables(
    view: DistributionsView,
    rate_tokens_per_s: float,
    horizons_s: tuple[float, ...],
    rng: np.random.Generator,
    live_turns: dict[str, np.ndarray] | None = None,
    paths: int = 2048,
    min_task_samples: int = 30,
) -> dict[str, TaskTable]:
    """Tables for the pooled task and every task with enough observations of its own (pure).

    `live_turns`: task -> current turns of its live trajectories (censored observations of the turn count)."""
    live = live_turns or {}
    tables: dict[str, TaskTable] = {}
    for task, s in sorted(view.tasks.items()):
        if task == POOLED or (
            s.size("gap_s") >= min_task_samples and s.size("output_tokens") >= min_task_samples
        ):
            tables[task] = build_task_table(s, rate_tokens_per_s, horizons_s, rng, live.get(task), paths)
    if POOLED not in tables:
        tables[POOLED] = build_task_table(None, rate_tokens_per_s, horizons_s, rng, live.get(POOLED), paths)
    return tables
