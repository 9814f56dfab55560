"""`dynamo`: NVIDIA Dynamo's SLA planner sizing prefill and decode replicas, on a fixed fleet of engines.

After ai-dynamo/dynamo components/planner/src/dynamo/planner/utils/planner_core.py (`Planner.observe_metrics`,
`predict_load`, `_compute_replica_requirements`) and utils/load_predictor.py; own code. Every
`adjustment_interval_s` (Dynamo's `--adjustment-interval`):
1. observe the interval just ended: request count, mean ISL, mean OSL (Dynamo reads Prometheus; here the
   ClusterView's `recent_*` fields, summed over the decisions inside the interval);
2. predict the next interval's three values, one load predictor each (`constant` or `arima`);
3. prefill engines P = ⌈num_req · ISL / interval / prefill tokens/s of one engine at that ISL⌉;
   decode engines D = ⌈num_req · OSL / interval / decode tokens/s of one engine⌉, that rate being the best one whose
   step time (inter-token latency) stays within `itl_s` at context ISL + OSL / 2 (Dynamo's
   `find_best_throughput_per_gpu(itl, context_length)`);
4. at least one of each (`min_endpoint`); above the engine budget both scale by budget / (P + D) (Dynamo's rule).
No traffic in the interval (no request, or no finished request to measure OSL) → no adjustment, as in Dynamo.

Adaptations, each changing behaviour, so stated here:
* a fixed fleet of N engines where an idle engine is free: under budget the spare engines go out in the same
  proportion (Dynamo would release them): P = clamp(round(N · P / (P + D)), 1, N − 1), D = N − P; neither role gets
  less than it asked for.
* ISL is the uncached prompt, rated at the mean cached prefix (the model's prefill cost). Dynamo's planner counts
  whole prompts; on agentic contexts (~100× the new tokens) it would ask for ~100× the prefill engines: this is the
  charitable reading of the baseline.
* no TTFT/ITL correction factors (the view has no latencies): Dynamo's `--no-correction` mode.
* between adjustments a fast loop (after Dynamo's newer load-based scaling) runs every `interval_s`: it moves one
  engine toward a role whose queue holds more than `fast_prefill_queue_s` of prefill work per prefill engine, or a
  decode queue longer than `fast_decode_queue_per_engine` per decode engine.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from services.allocator.capacity import CapacityModel, request_means
from services.allocator.policies.common import (
    Split,
    engines_by_role,
    floor_fix,
    initial_roles,
    make_capacity,
    moves_for_split,
    parse_options,
    role_demand,
)
from services.allocator.policies.load_predictors import LOAD_PREDICTORS, ConstantPredictor
from services.allocator.policy import AllocatorPolicy, ClusterView, Plan, PolicyError


@dataclass
class _Interval:
    """Request-level load summed over the decisions of one adjustment interval."""

    window_s: float = 0.0
    requests: int = 0
    isl_sum: float = 0.0  # Σ requests × mean ISL
    cached_sum: float = 0.0
    osl_sum: float = 0.0  # Σ window × mean OSL (OSL is measured on finished requests, so time-weighted)
    osl_window_s: float = 0.0

    def add(self, v: ClusterView) -> None:
        if v.recent_window_s <= 0:
            return
        self.window_s += v.recent_window_s
        self.requests += max(0, v.recent_requests)
        self.isl_sum += max(0, v.recent_requests) * max(0.0, v.recent_mean_isl_tokens)
        self.cached_sum += max(0, v.recent_requests) * max(0.0, v.recent_mean_cached_tokens)
        if v.recent_mean_osl_tokens > 0:
            self.osl_sum += v.recent_window_s * v.recent_mean_osl_tokens
            self.osl_window_s += v.recent_window_s


@dataclass
class DynamoPolicy(AllocatorPolicy):
    name: str = "dynamo"
    interval_s: float = 5.0  # fast loop
    capacity: CapacityModel = field(default_factory=lambda: make_capacity(None))
    adjustment_interval_s: float = 60.0  # slow loop (Dynamo's --adjustment-interval)
    predictor: str = "arima"  # "constant" | "arima"
    window: int = 20  # points each predictor keeps
    itl_s: float = 0.05  # inter-token latency target of a decode engine (Dynamo's --itl)
    fast_prefill_queue_s: float = 5.0
    fast_decode_queue_per_engine: float = 8.0
    prefill_fraction: float = 0.5  # start-up share of prefill engines (Dynamo's start_num_p / N)
    last_sizing: dict[str, float] = field(default_factory=dict)  # the last slow decision's inputs and outputs
    _interval: _Interval = field(default_factory=_Interval, repr=False)
    _next_adjust_s: float | None = field(default=None, repr=False)
    _predictors: dict[str, ConstantPredictor] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.predictor not in LOAD_PREDICTORS:
            raise PolicyError(
                f"dynamo: unknown predictor {self.predictor!r}; known: {', '.join(LOAD_PREDICTORS)}"
            )
        cls = LOAD_PREDICTORS[self.predictor]
        self._predictors = {k: cls(window=self.window) for k in ("num_req", "isl", "cached", "osl")}

    def initial_plan(self, engine_ids: Sequence[str]) -> Plan:
        return Plan(roles=initial_roles(engine_ids, self.prefill_fraction), reason="dynamo: initial roles")

    def plan(self, view: ClusterView) -> Plan | None:
        self._interval.add(view)
        fix = floor_fix(view, "dynamo")
        if fix is not None:
            return fix
        if self._next_adjust_s is None:
            self._next_adjust_s = view.now + self.adjustment_interval_s
        if view.now >= self._next_adjust_s:
            self._next_adjust_s = view.now + self.adjustment_interval_s
            return self._adjust(view)
        return self._fast(view)

    # --- slow loop ------------------------------------------------------------------------------------------
    def _adjust(self, view: ClusterView) -> Plan | None:
        obs, self._interval = self._interval, _Interval()
        if obs.window_s <= 0 or obs.requests == 0 or obs.osl_window_s <= 0:
            return None  # no traffic measured: Dynamo skips the adjustment
        scale = self.adjustment_interval_s / obs.window_s  # counts per adjustment interval
        observed = {
            "num_req": obs.requests * scale,
            "isl": obs.isl_sum / obs.requests,
            "cached": obs.cached_sum / obs.requests,
            "osl": obs.osl_sum / obs.osl_window_s,
        }
        for key, value in observed.items():
            self._predictors[key].add(value)
        pred = {key: p.predict_next() for key, p in self._predictors.items()}
        n_prefill, n_decode = self.size(pred["num_req"], pred["isl"], pred["cached"], pred["osl"])
        target = fit_budget(n_prefill, n_decode, len(view.engines))
        self.last_sizing = {**pred, "prefill": n_prefill, "decode": n_decode}
        self.last_sizing.update(target_prefill=target.prefill, target_decode=target.decode)
        moves = moves_for_split(view, target)
        if not moves:
            return None
        reason = (
            f"dynamo: predicted {pred['num_req']:.0f} req/interval, ISL {pred['isl']:.0f}, OSL {pred['osl']:.0f} "
            f"-> needs P{n_prefill}/D{n_decode}, budget gives {target}"
        )
        return Plan(roles=moves, reason=reason)

    def size(self, num_req: float, isl: float, cached: float, osl: float) -> tuple[int, int]:
        """(prefill engines, decode engines) Dynamo asks for, at least 1 each, before the budget."""
        interval = self.adjustment_interval_s
        prefill_rate = self.capacity.modelled_prefill_tokens_per_s(max(isl, 1.0), cached)
        n_prefill = math.ceil(num_req * isl / interval / prefill_rate) if isl > 0 else 0
        decode_rate = self.decode_rate_at_itl(cached + isl + osl / 2)
        n_decode = math.ceil(num_req * osl / interval / decode_rate) if osl > 0 else 0
        return max(1, n_prefill), max(1, n_decode)

    def decode_rate_at_itl(self, context_per_seq_tokens: float) -> float:
        """Best decode tokens/s of one engine whose step time stays within `itl_s` (uncorrected model)."""
        return self.capacity.modelled_decode_tokens_per_s_within(self.itl_s, context_per_seq_tokens)

    # --- fast loop ------------------------------------------------------------------------------------------
    def _fast(self, view: ClusterView) -> Plan | None:
        groups = engines_by_role(view)
        n_prefill = len(groups["prefill"]) + len(groups["mixed"])
        n_decode = len(groups["decode"]) + len(groups["mixed"])
        isl, cached, _ = request_means(view)
        queued_s = (
            view.prefill_queue_tokens / max(1, n_prefill) / self.capacity.prefill_tokens_per_s(isl, cached)
        )
        prefill_hot = queued_s > self.fast_prefill_queue_s
        decode_hot = view.decode_queue_len / max(1, n_decode) > self.fast_decode_queue_per_engine
        if prefill_hot == decode_hot:
            return None  # neither, or both queues long: moving an engine would only shift the problem
        to, donor = ("prefill", "decode") if prefill_hot else ("decode", "prefill")
        prefill_demand, decode_demand = role_demand(view)
        donor_demand = decode_demand if donor == "decode" else prefill_demand
        if not groups[donor] or (donor_demand and len(groups[donor]) + len(groups["mixed"]) <= 1):
            return None
        engine = groups[donor][0]
        return Plan(roles={engine.engine_id: to}, reason=f"dynamo fast loop: {to} queue above threshold")


def fit_budget(n_prefill: int, n_decode: int, n_engines: int) -> Split:
    """Fit Dynamo's (P, D) to exactly `n_engines`: proportional, ≥ 1 per role; one engine alone is mixed."""
    if n_engines == 1:
        return Split(0, 0, 1)
    total = n_prefill + n_decode
    if total == n_engines:
        return Split(n_prefill, n_decode)
    prefill = min(n_engines - 1, max(1, round(n_engines * n_prefill / total)))
    return Split(prefill, n_engines - prefill)


def make_dynamo(args: Sequence[str], n_engines: int, profile: object | None = None) -> DynamoPolicy:
    """`dynamo[:key=value...]`, keys: interval_s, adjustment_interval_s, predictor (constant|arima), window, itl_s,
    fast_prefill_queue_s, fast_decode_queue_per_engine, prefill_fraction. Raises PolicyError on bad arguments."""
    defaults: dict[str, float | int | str] = {
        "interval_s": 5.0,
        "adjustment_interval_s": 60.0,
        "predictor": "arima",
        "window": 20,
        "itl_s": 0.05,
        "fast_prefill_queue_s": 5.0,
        "fast_decode_queue_per_engine": 8.0,
        "prefill_fraction": 0.5,
    }
    opts = parse_options("dynamo", args, defaults)
    return DynamoPolicy(capacity=make_capacity(profile), **opts)  # type: ignore[arg-type]
