"""`prorsa` and `oracle`: choose the prefill/decode split that finishes in-flight plus forecast work soonest.

Objective (details and the switch-cost model in `objective.py`): for every candidate split — P prefill engines and
D = N − P decode engines for P in [floor, N − floor], plus one `mixed` engine standing in for a role whose work
would not keep a whole engine busy — project the completion time T_h of the work in flight (queues, running decodes)
plus the demand forecast over each horizon h, including the cost of the moves that reach it (drain + role switch
delay, recomputed prefix cache and migrated decodes), and score it by the mean of T_h / h. Per-engine rates come from
the performance model of the profile, corrected online by the EWMA of observed / modelled throughput.

Demand: the forecast's chosen quantile (q50 by default) per horizon: prefill_tokens arriving, decode_tokens to
generate, decode_concurrency, kv_tokens (→ context per sequence). Without a forecast (`prorsa` only) it falls back to
in-flight work plus the recent arrival rate (`recent_*` fields, else the observed prefill rate) over 10 s and 30 s.

Decision rules:
* floor: a role with demand (queued, running, computed lately or forecast) keeps at least one capable engine; a
  split that breaks this is never chosen, and a view that breaks it is repaired at once (no hysteresis);
* hysteresis: switch only if the best split beats the current one by more than `margin` (relative) and `min_gain`
  (absolute, in horizon fractions), and the same direction of change won `persist` decisions in a row — noise in the
  forecast then moves nothing;
* the engines that move are those with the least work in flight.

`oracle` is the same optimisation fed the true future demand: the simulator builds `ClusterView.forecast` from the
workload's truth. It raises PolicyError without a forecast, and acts on the first decision (`persist` = 1: the truth
has no noise to wait out).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from proto import DemandForecast, Quantiles
from services.allocator.capacity import (
    DEFAULT_CONTEXT_TOKENS,
    DEFAULT_ISL_TOKENS,
    CapacityModel,
    request_means,
)
from services.allocator.policies.common import (
    DECODE_CAPABLE,
    Split,
    current_split,
    floor_fix,
    forecast_of,
    initial_roles,
    make_capacity,
    moves_for_split,
    parse_options,
    role_demand,
)
from services.allocator.policies.objective import HorizonDemand, Rates, move_costs, score
from services.allocator.policy import AllocatorPolicy, ClusterView, Plan, PolicyError

QUANTILES = ("q10", "q50", "q90")


@dataclass
class ProrsaPolicy(AllocatorPolicy):
    name: str = "prorsa"
    uses_forecast: ClassVar[bool] = True  # plans on ClusterView.forecast (the truth for `oracle`)
    interval_s: float = 5.0
    capacity: CapacityModel = field(default_factory=lambda: make_capacity(None))
    margin: float = 0.10  # relative gain a switch must promise
    min_gain: float = 0.02  # absolute gain, in fractions of the horizon
    persist: int = 2  # decisions in a row the same direction must win
    quantile: str = "q50"  # forecast quantile planned for
    allow_mixed: int = 2  # 1: one mixed engine may stand in for a role with little work; 2: also full colocation where efficient
    drain_timeout_s: float = 30.0  # decodes outlasting this are migrated by re-prefill (RoleSwitchCommand)
    amortize_s: float = (
        120.0  # a move's one-time cost is weighed against this long a split serves (objective.score)
    )
    # start-up roles: "split" (prefill_fraction of the engines prefill), "mixed", or "auto" (`colocation_efficient`)
    initial: str = "auto"
    # Colocation counts as efficient when a mixed engine prefills at least this share of a dedicated engine's rate.
    # Set from the simulator's Table 2 runs (docs/benchmarks.md): splits beat colocation at 0.12 (deepseek-v3.2,
    # 8 DP ranks), colocation wins at 0.36 (mimo-v2.5-pro) and 0.80 (qwen3-235b); 0.25, about the geometric mean
    # of 0.12 and 0.5, leaves margin on both sides. (0.5 started mimo split and cost it 5-18 %.)
    colocate_at: float = 0.25
    fallback_horizons_s: tuple[float, ...] = (10.0, 30.0)
    # start-up share of prefill engines: agentic turns are decode-bound once prefix caching serves the context
    # (SWE trace: new prompt tokens per turn ≈ 0.6 × output tokens in steady state, DESIGN.md)
    prefill_fraction: float = 0.25
    require_forecast: bool = False
    # split → score at the last decision (logs, tests)
    last_scores: dict[str, float] = field(default_factory=dict)
    _pending: tuple[int, int, int] | None = field(default=None, repr=False)
    _pending_count: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        if self.quantile not in QUANTILES:
            raise PolicyError(
                f"{self.name}: quantile must be one of {', '.join(QUANTILES)}, got {self.quantile!r}"
            )
        if self.initial not in ("split", "mixed", "auto"):
            raise PolicyError(f"{self.name}: initial must be split, mixed or auto, got {self.initial!r}")
        if self.persist < 1:
            raise PolicyError(f"{self.name}: persist must be >= 1")

    def initial_plan(self, engine_ids: Sequence[str]) -> Plan:
        if self.initial == "mixed" or (self.initial == "auto" and self.colocation_efficient()):
            return Plan(
                roles=dict.fromkeys(engine_ids, "mixed"), reason=f"{self.name}: initial roles (colocated)"
            )
        return Plan(
            roles=initial_roles(engine_ids, self.prefill_fraction), reason=f"{self.name}: initial roles"
        )

    def colocation_efficient(self) -> bool:
        """Whether a mixed engine prefills at least `colocate_at` of a dedicated one's rate (at the default prompt
        and a half-full decode batch): then colocation wastes little and starts without a split to guess. With
        many DP attention ranks a prompt chunk on one rank stalls every rank's decode, and a split starts ahead."""
        ctx = DEFAULT_CONTEXT_TOKENS
        batch = self.capacity.decode_batch_limit(ctx) / 2
        mixed_prefill, _, _ = self.capacity.mixed_tokens_per_s(batch, ctx, 0.0, DEFAULT_ISL_TOKENS)
        return mixed_prefill >= self.colocate_at * self.capacity.prefill_tokens_per_s(DEFAULT_ISL_TOKENS, 0.0)

    def plan(self, view: ClusterView) -> Plan | None:
        forecast = forecast_of(view)
        if self.require_forecast and forecast is None:
            raise PolicyError(
                f"{self.name} needs the true future demand in ClusterView.forecast (simulator only)"
            )
        self.capacity.observe(view)
        prefill_demand, decode_demand = role_demand(view)
        current = current_split(view)
        demands = self.demands(view, forecast)
        if not any(d.prefill_tokens > 0 or d.decode_tokens > 0 for d in demands):
            self._pending, self._pending_count = None, 0
            return floor_fix(view, self.name)  # nothing to plan for; only repair an empty role with demand
        isl, cached, _ = request_means(view)
        rates = Rates(self.capacity.prefill_tokens_per_s(isl, cached), cached, isl)
        costs = move_costs(view, self.capacity, self.drain_timeout_s, rates)
        scored = self._search(
            current,
            self.candidates(len(view.engines), prefill_demand, decode_demand, demands, rates),
            lambda c: score(c, current, demands, self.capacity, rates, costs, self.amortize_s),
        )
        current_score = scored.get(current)
        if current_score is None:
            current_score = score(current, current, demands, self.capacity, rates, costs, self.amortize_s)
        best = min(scored, key=lambda c: (scored[c], _distance(c, current)))
        self.last_scores = {str(c): j for c, j in scored.items()}
        return self._decide(view, current, best, current_score, scored[best], prefill_demand, decode_demand)

    def _decide(
        self,
        view: ClusterView,
        current: Split,
        best: Split,
        current_j: float,
        best_j: float,
        prefill_demand: bool,
        decode_demand: bool,
    ) -> Plan | None:
        reason = f"{self.name}: {current} -> {best}, projected {current_j:.3f} -> {best_j:.3f} of the horizon"
        if not current.covers(prefill_demand, decode_demand):
            self._pending, self._pending_count = None, 0
            return Plan(
                roles=moves_for_split(view, best), reason=reason + " (a role with demand had no engine)"
            )
        gain = current_j - best_j
        worth = (
            best != current
            and gain > self.min_gain
            and (math.isinf(current_j) or gain > self.margin * current_j)
        )
        if not worth:
            self._pending, self._pending_count = None, 0
            return None
        direction = (
            _sign(best.prefill - current.prefill),
            _sign(best.decode - current.decode),
            _sign(best.mixed - current.mixed),
        )
        self._pending_count = self._pending_count + 1 if direction == self._pending else 1
        self._pending = direction
        if self._pending_count < self.persist:
            return None
        self._pending, self._pending_count = None, 0
        return Plan(roles=moves_for_split(view, best), reason=reason)

    @staticmethod
    @staticmethod
    def _search(
        current: Split, candidates: list[Split], evaluate: Callable[[Split], float]
    ) -> dict[Split, float]:
        """Scores of the candidates worth scoring: all of them up to 48 plain splits; beyond, a coarse-to-fine
        search over P (every ⌈n/16⌉-th split, then a quarter of that step around the best, down to step 1) —
        the score is near-unimodal in P (prefill time falls and decode time rises as P grows). Mixed candidates
        and the current split are always scored."""
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

    def candidates(
        self,
        n: int,
        prefill_demand: bool,
        decode_demand: bool,
        demands: Sequence[HorizonDemand],
        rates: Rates,
    ) -> list[Split]:
        """Splits that keep an engine for every role with demand (module doc)."""
        p_min = 1 if prefill_demand else 0
        d_min = 1 if decode_demand else 0
        out = [Split(p, n - p) for p in range(p_min, n - d_min + 1)]
        if n == 1 or (self.allow_mixed and n >= 2):
            light_prefill = all(d.prefill_tokens < rates.prefill_per_engine * d.horizon_s for d in demands)
            one_decoder = [
                self.capacity.decode_cluster_tokens_per_s(1, d.sequences, d.context_per_seq_tokens)
                for d in demands
            ]
            light_decode = all(
                d.decode_tokens < r * d.horizon_s for d, r in zip(demands, one_decoder, strict=True)
            )
            if n == 1 or light_prefill:
                out.append(Split(0, n - 1, 1))
            if n >= 2 and light_decode:
                out.append(Split(n - 1, 0, 1))
        if self.allow_mixed >= 2 and n >= 2 and self.colocation_efficient():
            # Colocation: where chunked prefill costs decode little (no DP attention), every engine doing both
            # beats any split that leaves one role's engines idle part of the time. Hybrids (a few prefill
            # engines beside mixed ones) are not offered: affinity routing sends most turns to the mixed engine
            # that holds their cache, so the objective's model of them (prefill served by the dedicated engines
            # first) does not hold.
            out.append(Split(0, 0, n))
        return [c for c in dict.fromkeys(out) if c.covers(prefill_demand, decode_demand)]

    def demands(self, view: ClusterView, forecast: DemandForecast | None) -> list[HorizonDemand]:
        """In-flight work plus forecast (or, without one, recent) demand per horizon (module doc)."""
        isl, _, osl = request_means(view)
        roles = view.roles()
        decoders = [e for e in view.engines if roles[e.engine_id] in DECODE_CAPABLE]
        owed = sum(max(0, e.in_flight_tokens - e.queued_prefill_tokens) for e in decoders)
        batch_now = sum(e.decode_batch for e in view.engines)
        kv_now = sum(e.kv_used_tokens for e in decoders)
        ctx_now = kv_now / batch_now if batch_now and kv_now else DEFAULT_CONTEXT_TOKENS
        seqs_now = float(batch_now + view.decode_queue_len)
        queued_decode = view.decode_queue_len * osl
        out: list[HorizonDemand] = []
        if forecast is not None:
            for h in sorted(forecast.horizons, key=lambda h: h.horizon_s):
                if not (h.horizon_s > 0 and math.isfinite(h.horizon_s)):
                    continue
                seqs = self._q(h.decode_concurrency) or seqs_now
                kv = self._q(h.kv_tokens)
                wd = max(self._q(h.decode_tokens), owed) + queued_decode
                ctx = kv / seqs if kv > 0 and seqs > 0 else ctx_now
                out.append(
                    _horizon(
                        h.horizon_s, view.prefill_queue_tokens + self._q(h.prefill_tokens), wd, seqs, ctx
                    )
                )
        if not out:
            if view.recent_window_s > 0 and view.recent_requests > 0:
                arrival = view.recent_requests * isl / view.recent_window_s
            else:
                arrival = view.prefill_tokens_per_s
            for hs in self.fallback_horizons_s:
                wd = max(owed, view.decode_tokens_per_s * hs) + queued_decode
                out.append(_horizon(hs, view.prefill_queue_tokens + arrival * hs, wd, seqs_now, ctx_now))
        return out

    def _q(self, q: Quantiles) -> float:
        value = float(getattr(q, self.quantile))
        return value if math.isfinite(value) and value > 0 else 0.0


def _horizon(h: float, wp: float, wd: float, seqs: float, ctx: float) -> HorizonDemand:
    seqs = max(seqs, 1.0) if wd > 0 else max(seqs, 0.0)  # work to decode runs on at least one sequence
    return HorizonDemand(h, max(0.0, wp), max(0.0, wd), seqs, max(1.0, ctx))


def _sign(x: int) -> int:
    return (x > 0) - (x < 0)


def _distance(a: Split, b: Split) -> int:
    return abs(a.prefill - b.prefill) + abs(a.decode - b.decode) + abs(a.mixed - b.mixed)


_OPTIONS: dict[str, float | int | str] = {
    "interval_s": 5.0,
    "margin": 0.10,
    "min_gain": 0.02,
    "persist": 2,
    "quantile": "q50",
    "allow_mixed": 2,
    "drain_timeout_s": 30.0,
    "prefill_fraction": 0.25,
    "amortize_s": 120.0,
    "initial": "auto",
    "colocate_at": 0.25,
}


def make_prorsa(args: Sequence[str], n_engines: int, profile: object | None = None) -> ProrsaPolicy:
    """`prorsa[:key=value...]`, keys: interval_s, margin, min_gain, persist, quantile (q10|q50|q90), allow_mixed
    (0|1|2), drain_timeout_s, prefill_fraction, amortize_s, initial (auto|split|mixed), colocate_at. Raises
    PolicyError on bad arguments or profile."""
    opts = parse_options("prorsa", args, _OPTIONS)
    return ProrsaPolicy(capacity=make_capacity(profile), **opts)  # type: ignore[arg-type]


def make_oracle(args: Sequence[str], n_engines: int, profile: object | None = None) -> ProrsaPolicy:
    """`oracle[:key=value...]` (same keys as prorsa, persist defaults to 1). Needs a truth forecast in every view."""
    opts = parse_options("oracle", args, {**_OPTIONS, "persist": 1})
    return ProrsaPolicy(name="oracle", capacity=make_capacity(profile), require_forecast=True, **opts)  # type: ignore[arg-type]
