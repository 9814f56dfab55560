"""`lifecycle`: demand from the tracker's per-trajectory picture and the learned lifecycle distributions.

What it knows, and where from. Everything about a task — turn counts, tool (gap) times, output lengths, new tokens
per turn, prefill and queue waits, the decode rate — is learnt online from this run's own lifecycle events
(`learner.py`, `distributions.py`), per task and turn bucket, falling back to the run's pooled samples. Nothing
is fitted offline to a trace. The priors, used only until the run has observed a kind, are stand-ins of the
right order and no more (`lifecycle_model.PRIORS`: a 1 s gap, 256 tokens in and out per turn, 30 tokens/s), and
are replaced as soon as one sample of that kind exists. With `prior` (`lifecycle_model.PriorSamples`: other
workloads' gaps, outputs and new tokens — in `prorsa forecast-eval --leave-one-out`, the other shipped traces) a
new workload starts from those distributions instead, each replaced, as a prior is, by the run's first own
observation of its kind. What no series model has is the structure, one piece per term:
  term              structural knowledge it uses
  tool_call         a trajectory in a tool call returns (or ends) with a prompt whose context is known: the
                    tracker's context plus the new tokens of a turn; when, from the gap's conditional survival
                    given the time already spent; whether, from the turn-count hazard and that time;
  decode            a decoding trajectory ends its output and comes back after a gap: its remaining tokens given
                    the ones already generated, then the continuation table;
  prefill / queued  a submitted prompt is decoded next; a queued first turn arrives with its whole context;
  pending hints     the driver knows when the first prompts of a step it submitted arrive (`PendingArrival`);
  next step         the next step's first prompts come a training time after the run drained, with the last
                    step's first-prompt profile (`steps.py`; learnt from this run's step boundaries, no prior);
  GRPO groups       a group's samples share one first prompt: they appear as equal prompts at equal offsets in
                    the hints and the step profile (no term of its own: the prompt is counted once per sample,
                    as the demand definition does).
q10/q90 are recalibrated online on this predictor's own matured forecasts (`calibration.py`).

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

By turn: a trajectory at turn k uses the tables of its task's turn bucket (`distributions.turn_bucket`), built
from the samples filed under that bucket (a kind with fewer than `min_task_samples` of them, and the turn counts
and queue waits, come from the whole task); a bucket without enough gaps or outputs uses the task's tables.

Decode tokens are r * (seconds decoding), r being the decode throughput per sequence in the decode state over
the last `rate_windows` series windows (tokens generated / sequence-seconds in decode): it follows the engines'
load (batch size, prefill interference) where the per-request rate learned from finished requests lags; until
`min_rate_seconds` of decoding were seen, the learned rate. How far that throughput moves over a horizon is
backtested on the last `rate_history` windows and added to the decode demand's variance.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np

from proto import TaskOutlook
from services.forecaster.base import MetricForecast, Predictor, normal_triple, register
from services.forecaster.distributions import (
    POOLED,
    TURN_BUCKET_EDGES,
    TURN_BUCKETS,
    DistributionsView,
    TaskSamples,
    turn_bucket,
)
from services.forecaster.lifecycle_model import PriorSamples, impute_censored
from services.forecaster.lifecycle_outlook import lifecycle_outlook
from services.forecaster.lifecycle_stack import Stack, build_stack, stacked_moments
from services.forecaster.lifecycle_tables import TaskTable, TurnFigures, build_task_table, task_figures
from services.forecaster.picture import DECODE, QUEUED, TOOL_CALL, Picture
from services.forecaster.series import HORIZONS_S, SeriesPoint
from services.forecaster.steps import Scenario

# A refit's result: (distributions version, tables by key, reusable turn-bucket tables with their fingerprints,
# every task's turn figures for the outlook)
Fitted = tuple[int, dict[str, TaskTable], dict[str, tuple[Hashable, TaskTable]], dict[str, TurnFigures]]


def turn_key(task: str, bucket: int) -> str:
    """Name of the tables of one task's turn bucket."""
    return f"{task}@{bucket}"


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
        rate_windows: int = 5,
        min_rate_seconds: float = 2.0,
        rate_history: int = 300,
        calibrate: bool = True,
        next_step: bool = True,
        prior: PriorSamples | None = None,
    ) -> None:
        super().__init__(horizons_s, window_s, calibrate=calibrate)
        self.prior = prior  # other workloads' samples a new one starts from (None: the round PRIORS)
        self.next_step = next_step  # forecast the next RL step's first turns while the run is drained
        self.paths = paths
        self.min_task_samples = min_task_samples
        self.min_rate_seconds = min_rate_seconds
        self.rate_windows = rate_windows
        # (decode tokens, sequence-seconds in decode) per window: the latest `rate_windows` give the throughput,
        # all of them its backtested error
        self._rate: deque[tuple[float, float]] = deque(maxlen=rate_history)
        # table key -> (its inputs' fingerprint, table): turn-bucket tables a refit may reuse (`build_tables`)
        self._reuse: dict[str, tuple[Hashable, TaskTable]] = {}
        self._last_point: SeriesPoint | None = None
        self._seeds = np.random.SeedSequence(seed)
        self.picture: Picture | None = None
        self._fitted_version = -1
        self._stacked: tuple[dict[str, TaskTable], Stack] | None = None
        self._scratch: dict[str, np.ndarray] = {}  # reusable buffers of the vectorised sum
        self.tables: dict[str, TaskTable] = {
            POOLED: build_task_table(
                None,
                0.0,
                self.horizons_s,
                np.random.default_rng(self._seeds.spawn(1)[0]),
                paths=paths,
                prior=prior,
            )
        }
        # task -> one turn of it, for the outlook (`lifecycle_outlook.py`); the pooled one until the first refit
        self.figures: dict[str, TurnFigures] = {POOLED: task_figures(None, None, 0.0, prior=prior)}

    def _on_point(self, point: SeriesPoint) -> None:
        self._last_point = point

    def _on_picture(self, picture: Picture) -> None:
        p = self._last_point
        if p is not None:
            # the window that just closed: concurrency at its start (the point) and its end (this picture)
            conc = 0.5 * (p.decode_concurrency + picture.decode_concurrency)
            self._rate.append((p.decode_tokens, conc * p.window_s))
            self._last_point = None
        self.picture = picture

    def decode_throughput(self) -> float | None:
        """Tokens per second per sequence in the decode state over the latest windows (None: too little seen)."""
        recent = list(self._rate)[-self.rate_windows :]
        tokens = sum(t for t, _ in recent)
        seconds = sum(s for _, s in recent)
        return tokens / seconds if seconds >= self.min_rate_seconds else None

    def throughput_error(self, horizon_s: float) -> float:
        """Relative RMS error of `decode_throughput` as a forecast of the throughput over the next `horizon_s`,
        backtested on the kept windows (0 with too few): the engines' load moves the per-sequence rate, which
        the decode demand's variance must include besides the uncertainty of the seconds decoded."""
        k = max(1, round(horizon_s / self.window_s))
        w = self.rate_windows
        if len(self._rate) < w + k + 10:
            return 0.0
        tok, sec = (np.array(x) for x in zip(*self._rate, strict=True))
        ct, cs = np.concatenate(([0.0], np.cumsum(tok))), np.concatenate(([0.0], np.cumsum(sec)))
        i = np.arange(w, len(tok) - k + 1)  # forecast made after window i - 1
        est_s, real_s = cs[i] - cs[i - w], cs[i + k] - cs[i]
        ok = (est_s >= self.min_rate_seconds) & (real_s >= self.min_rate_seconds)
        if ok.sum() < 10:
            return 0.0
        est = (ct[i] - ct[i - w])[ok] / est_s[ok]
        real = (ct[i + k] - ct[i])[ok] / real_s[ok]
        rel = real / np.maximum(est, 1e-9) - 1.0
        weight = real_s[ok]
        return float(np.sqrt(np.sum(weight * rel * rel) / np.sum(weight)))

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
        censored = censored_progress(pic, now)
        seed = self._seeds.spawn(1)[0]
        hs, paths, min_n = self.horizons_s, self.paths, self.min_task_samples
        reuse = dict(self._reuse)  # tables are immutable: sharing them with the job's thread is safe
        prior = self.prior

        def job() -> Fitted:
            rng = np.random.default_rng(seed)
            built: dict[str, tuple[Hashable, TaskTable]] = {}
            tables = build_tables(view, rate, hs, rng, live, paths, min_n, censored, reuse, built, prior)
            pooled = view.tasks.get(POOLED)
            figures = {
                task: task_figures(view.tasks.get(task), pooled, rate, live.get(task), prior)
                for task in sorted({*view.tasks, *live})
            }
            return view.version, tables, built, figures

        return job

    def install(self, fitted: Fitted) -> None:
        self._fitted_version, self.tables, self._reuse, self.figures = fitted

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
        elif pic is not None and pic.n == 0 and pic.distributions is not None and self.next_step:
            scenarios = pic.distributions.steps.expected(now)
            if scenarios:
                self._add_next_step(scenarios, now, sums)
        out: MetricForecast = {
            m: [] for m in ("prefill_tokens", "decode_tokens", "decode_concurrency", "kv_tokens")
        }
        rate = pic.decode_rate_tokens_per_s if pic is not None else None
        rate = rate or self.decode_throughput() or pooled.decode_rate_tokens_per_s
        for q in (0, 1):  # decode tokens = r * seconds decoding
            sums["decode"][q] = sums["seconds"][q] * rate ** (q + 1)
        for h in horizons:
            mean = {q: _at(hs_t, v[0], h) for q, v in sums.items()}
            var = {q: _at(hs_t, v[1], h) for q, v in sums.items()}
            out["prefill_tokens"].append(normal_triple(mean["prefill"], var["prefill"]))
            rate_var = (self.throughput_error(h) * mean["decode"]) ** 2
            out["decode_tokens"].append(normal_triple(mean["decode"], var["decode"] + rate_var))
            out["decode_concurrency"].append(normal_triple(mean["seconds"] / h, var["seconds"] / (h * h)))
            out["kv_tokens"].append(normal_triple(mean["kv"], var["kv"]))
        return out

    def outlook(self, now: float, horizon_s: float) -> list[TaskOutlook] | None:
        """The demand outlook from the tables and the live picture (`lifecycle_outlook.py`)."""
        pic = self.picture
        if pic is None:
            return None
        rate = pic.decode_rate_tokens_per_s or self.decode_throughput() or 0.0
        pooled = self.figures[POOLED]
        return lifecycle_outlook(pic, lambda task: self.figures.get(task, pooled), rate, horizon_s)

    def _table(self, task: str, bucket: int | None = None) -> TaskTable:
        t = self.tables.get(turn_key(task, bucket)) if bucket is not None else None
        return t or self.tables.get(task) or self.tables[POOLED]

    def _stack(self) -> Stack:
        """The current tables stacked for one vectorised pass (rebuilt when a refit installs new tables)."""
        if self._stacked is None or self._stacked[0] is not self.tables:
            self._stacked = (self.tables, build_stack(self.tables))
        return self._stacked[1]

    def _add_trajectories(self, pic: Picture, now: float, sums: dict[str, list[np.ndarray]]) -> None:
        stack = self._stack()
        age_s = max(0.0, now - pic.ts_s)
        # The table of each trajectory's (task, turn bucket), else its task's, else the pooled one.
        combo = pic.task.astype(np.int64) * TURN_BUCKETS + np.searchsorted(
            TURN_BUCKET_EDGES, pic.turn, "right"
        )
        uniq, inverse = np.unique(combo, return_inverse=True)
        slots = [
            stack.slots.get(turn_key(pic.task_names[c // TURN_BUCKETS], c % TURN_BUCKETS))
            for c in uniq.tolist()
        ]
        names = [pic.task_names[c // TURN_BUCKETS] for c in uniq.tolist()]
        per_combo = [s if s is not None else stack.slot(n) for s, n in zip(slots, names, strict=True)]
        slot = np.array(per_combo, dtype=np.int64)[inverse.ravel()]
        state = pic.state.astype(np.int64)
        x = np.where(state == DECODE, pic.generated, pic.time_in_state_s + age_s)
        turn, ctx = pic.turn, pic.context
        named = {p.traj_id for p in pic.pending if p.traj_id}
        if named:  # queued trajectories named by a hint follow the hint instead
            hinted = np.fromiter((t in named for t in pic.traj_ids), dtype=bool, count=pic.n)
            keep = ~(hinted & (state == QUEUED))
            slot, state, x, turn, ctx = slot[keep], state[keep], x[keep], turn[keep], ctx[keep]
        mean, var = stacked_moments(stack, slot, state, x, turn, ctx, self._scratch)
        self._accumulate(sums, mean, var)

    def _add_pending(self, pic: Picture, now: float, sums: dict[str, list[np.ndarray]]) -> None:
        """Hinted first turns: `prompt_tokens` arrive at `at_s` exactly, then the continuation table."""
        items = [(p.at_s - now, float(p.prompt_tokens), p.task) for p in pic.pending]
        mean, var = self._first_turns(items)
        self._accumulate(sums, mean, var)

    def _add_next_step(
        self, scenarios: list[Scenario], now: float, sums: dict[str, list[np.ndarray]]
    ) -> None:
        """The next step's first turns (`steps.py`): a mixture over its start times. Per scenario the first
        turns are independent; the mixture's variance adds the spread between scenarios."""
        first = np.zeros((3, len(self.tables[POOLED].horizons_s)))
        second = np.zeros_like(first)
        for sc in scenarios:
            items = [(sc.start_s + off - now, tokens, task) for off, tokens, task in sc.arrivals]
            m, v = self._first_turns(items)
            first += sc.weight * m
            second += sc.weight * (v + m * m)
        self._accumulate(sums, first, np.maximum(second - first * first, 0.0))

    def _first_turns(self, items: list[tuple[float, float, str]]) -> tuple[np.ndarray, np.ndarray]:
        """Summed (mean, var), each (3 quantities, H), of first turns of (seconds from now, prompt tokens, task):
        the prompt arrives then, and the task's turn-0 continuation table says what follows."""
        hs = self.tables[POOLED].horizons_s
        total_m, total_v = np.zeros((3, len(hs))), np.zeros((3, len(hs)))
        by_task: dict[str, list[tuple[float, float]]] = {}
        for tau, tokens, task in items:
            by_task.setdefault(task, []).append((max(0.0, tau), tokens))
        for task, rows in by_task.items():
            table = self._table(task, turn_bucket(0))
            tau, c = (np.array(v)[:, None] for v in zip(*rows, strict=True))
            rem = table.horizons_s[None, :] - tau  # (hints, H)
            ok = rem >= 0.0
            a1, a2, s1, s2, i1, gi, g2i = (np.where(ok, v, 0.0) for v in table.cont.at(rem))
            mean = np.stack([np.where(ok, c, 0.0) + a1, s1, c * i1 + gi])  # (3, hints, H)
            second = np.stack([np.where(ok, c * c + 2 * c * a1, 0.0) + a2, s2, c * c * i1 + 2 * c * gi + g2i])
            total_m += mean.sum(axis=1)
            total_v += np.maximum(second - mean * mean, 0.0).sum(axis=1)
        return total_m, total_v

    @staticmethod
    def _accumulate(sums: dict[str, list[np.ndarray]], mean: np.ndarray, var: np.ndarray) -> None:
        for i, q in enumerate(("prefill", "seconds", "kv")):
            sums[q][0] += mean[i]
            sums[q][1] += var[i]


def _at(hs: np.ndarray, values: np.ndarray, h: float) -> float:
    """A table value at horizon h: exact on the table's horizons, linear in between (0 at h = 0)."""
    return float(np.interp(h, np.concatenate(([0.0], hs)), np.concatenate(([0.0], values))))


def censored_progress(pic: Picture, now: float) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Table key -> (time spent so far in the current tool call, tokens generated so far in the current decode)
    of the live trajectories: lower bounds of a gap and an output length still in progress (censored)."""
    age_s = max(0.0, now - pic.ts_s)
    tool = pic.state == TOOL_CALL
    dec = (pic.state == DECODE) & (pic.generated > 0)
    bucket = np.searchsorted(TURN_BUCKET_EDGES, pic.turn, "right")
    groups: dict[str, np.ndarray] = {POOLED: np.ones(pic.n, dtype=bool)}
    for code, name in enumerate(pic.task_names):
        mine = pic.task == code
        groups[name] = mine
        for b in np.unique(bucket[mine]).tolist():
            groups[turn_key(name, b)] = mine & (bucket == b)
    return {
        key: (pic.time_in_state_s[m & tool] + age_s, pic.generated[m & dec].copy())
        for key, m in groups.items()
    }


def build_tables(
    view: DistributionsView,
    rate_tokens_per_s: float,
    horizons_s: tuple[float, ...],
    rng: np.random.Generator,
    live_turns: dict[str, np.ndarray] | None = None,
    paths: int = 2048,
    min_task_samples: int = 30,
    censored: dict[str, tuple[np.ndarray, np.ndarray]] | None = None,
    reuse: dict[str, tuple[Hashable, TaskTable]] | None = None,
    built: dict[str, tuple[Hashable, TaskTable]] | None = None,
    prior: PriorSamples | None = None,
) -> dict[str, TaskTable]:
    """Tables for the pooled task, every task and every (task, turn bucket) with enough observations (pure).

    `live_turns`: task -> current turns of its live trajectories (censored observations of the turn count);
    `censored`: table key -> gaps and outputs still in progress (`censored_progress`), completed by imputation
    (`lifecycle_model.impute_censored`) before the tables are built.
    `built` is filled with (fingerprint, table) for each turn-bucket table no live trajectory is in; given back
    as `reuse` to the next call, such a table is built again only when its samples or the decode rate (to 5 %)
    changed. (Its hazard may then be a refit old; a bucket with a trajectory in it is always rebuilt.)"""
    live = live_turns or {}
    cens = censored or {}
    old = reuse or {}
    tables: dict[str, TaskTable] = {}
    rate_step = round(math.log(max(rate_tokens_per_s, 1e-9)) / math.log(1.05))

    def enough(s: TaskSamples) -> bool:
        return s.size("gap_s") >= min_task_samples and s.size("output_tokens") >= min_task_samples

    def build(
        key: str, s: TaskSamples | None, turns: np.ndarray | None, starts: np.ndarray | None = None
    ) -> None:
        idle = s is not None and starts is None and key not in cens and "@" in key
        fp = (rate_step, _fingerprint(s)) if idle and s is not None else None
        if fp is not None and key in old and old[key][0] == fp:
            tables[key] = old[key][1]
        else:
            if s is not None and key in cens:
                s = _with_censored(s, *cens[key], rng)
            tables[key] = build_task_table(
                s, rate_tokens_per_s, horizons_s, rng, turns, paths, start_turns=starts, prior=prior
            )
        if fp is not None and built is not None:
            built[key] = (fp, tables[key])

    tasks = sorted(t for t in view.tasks if t != POOLED)
    for task in tasks:
        if enough(view.tasks[task]):
            build(task, view.tasks[task], live.get(task))
    if len(tasks) == 1 and tasks[0] in tables:
        tables[POOLED] = tables[tasks[0]]  # one task: the pooled samples are the same samples
    else:
        build(POOLED, view.tasks.get(POOLED), live.get(POOLED))
    for (task, bucket), s in sorted(view.by_turn.items()):
        parent = view.tasks.get(task)
        if parent is None or not enough(s):
            continue
        turns = live.get(task)
        starts = None
        if turns is not None:
            mine = turns[np.searchsorted(TURN_BUCKET_EDGES, turns, "right") == bucket]
            starts = mine + 1 if len(mine) else None
        build(turn_key(task, bucket), _filled(s, parent, min_task_samples), turns, starts)
    return tables


def _fingerprint(s: TaskSamples) -> tuple[tuple[int, float], ...]:
    """Sizes and sums of a task's samples (what decides whether its tables would change)."""
    arrays = (
        s.gap_s,
        s.gap_is_turn,
        s.queue_wait_s,
        s.prefill_wait_s,
        s.output_tokens,
        s.new_tokens,
        s.turns,
    )
    return tuple((len(a), float(np.sum(a))) for a in arrays)


def _with_censored(
    s: TaskSamples, gaps: np.ndarray, outputs: np.ndarray, rng: np.random.Generator
) -> TaskSamples:
    """Gaps and outputs completed with the ones in progress, while their rings hold every observation since the
    start (a full ring holds a recent window of ended ones, which in-progress ones would double-count)."""
    gap, is_turn, out = s.gap_s, s.gap_is_turn, s.output_tokens
    if "gap_s" in s.filling:
        gap, flags = impute_censored(gap, gaps, rng, is_turn)
        is_turn = is_turn if flags is None else flags
    if "output_tokens" in s.filling:
        out, _ = impute_censored(out, outputs, rng)
    return dataclasses.replace(s, gap_s=gap, gap_is_turn=is_turn, output_tokens=out)


def _filled(s: TaskSamples, parent: TaskSamples, min_samples: int) -> TaskSamples:
    """A turn bucket's samples, with the task's for the kinds it has too few of (and always for the kinds not
    kept by turn: turn counts, queue waits)."""
    out: dict[str, Any] = {}
    own = set()
    for f in dataclasses.fields(TaskSamples):
        if f.name in ("gap_is_turn", "filling"):
            continue
        mine = getattr(s, f.name)
        enough = len(mine) >= min_samples and f.name not in ("turns", "queue_wait_s")
        out[f.name] = mine if enough else getattr(parent, f.name)
        if enough:
            own.add(f.name)
    out["gap_is_turn"] = s.gap_is_turn if "gap_s" in own else parent.gap_is_turn
    out["filling"] = frozenset(
        k for k in s.filling | parent.filling if k in (s.filling if k in own else parent.filling)
    )
    return TaskSamples(**out)
