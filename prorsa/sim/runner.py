"""Public entry point of the simulator: `run_simulation(SimConfig) -> SimResult`."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from prorsa.sim.core import Simulation
from prorsa.sim.events import SimObserver
from prorsa.sim.metrics import ROLE_NAMES
from prorsa.sim.sim_driver import MODES, StepSource
from prorsa.sim.views import DemandFeed
from proto import ROLES
from services.allocator.policy import AllocatorPolicy
from services.allocator.registry import make_policy
from services.allocator.switch_coordinator import DRAIN_TIMEOUT_S
from services.engine_agent.engine_core import DEFAULT_MAX_MODEL_LEN
from services.runtime import perf_model as pm
from services.runtime.host_kv import with_host_kv
from services.runtime.model_profiles import load_profile


@dataclass
class SimConfig:
    """Everything one simulation run depends on (with the seed, a run is a pure function of it)."""

    workload: str | StepSource = (
        "profile:coding"  # a workload spec string, or an object with .name and .step(i)
    )
    profile: str = "qwen3-235b"  # built-in model profile name or a profile JSON path
    engines: int = 8
    mode: str = "sync"  # "sync" | "async"
    staleness: int = 1  # async: abort trajectories started more than this many versions ago
    training_s: float = 60.0  # trainer time per batch (s)
    policy: str = "colocated"  # allocator policy spec (services.allocator.registry.make_policy)
    seed: int = 0
    steps: int | None = None  # batches to train; None with no duration → 1
    duration_s: float | None = None  # cap on virtual time
    batch_size: int = 64  # trajectories per step (spec-string workloads)
    group_size: int = 1  # trajectories per GRPO group (spec-string workloads)
    window_s: float = 10.0  # width of the time-series windows
    drain_bound_s: float = (
        DRAIN_TIMEOUT_S  # a switching engine keeps decodes ending within this, migrates others
    )
    # Demand predictor of the live forecast feed (services.forecaster: naive, ewma, ets, arima, lifecycle, ensemble);
    # used only by policies that read forecasts (`AllocatorPolicy.uses_forecast`).
    forecaster: str = "ensemble"
    # Prompts longer than this end their trajectory (the engines reject them; the live driver does the same).
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    # Roles whose engine layout differs from the engines' own (live: `--role-engine-arg`): a switch to one restarts
    # the engine (drain, the profile's `engine_start_s`, an empty cache); every other switch is in place
    # (`services.engine_agent.switch_rule`). None by default, as with kv_both engines of one layout.
    restart_roles: tuple[str, ...] = ()
    # The engines' host-memory KV tier as a multiple of their device KV (SGLang's `--hicache-ratio`; 0 = none, the
    # default: `services.runtime.host_kv`).
    host_kv_ratio: float = 0.0
    observer: SimObserver | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.engines < 1:
            raise ValueError(f"engines must be >= 1, got {self.engines}")
        if self.staleness < 0 or self.training_s < 0 or self.window_s <= 0:
            raise ValueError("staleness and training_s must be >= 0, window_s > 0")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ValueError(f"duration_s must be > 0, got {self.duration_s}")
        if not self.forecaster:
            raise ValueError("forecaster must name a predictor")
        unknown = sorted(set(self.restart_roles) - set(ROLES))
        if unknown:
            raise ValueError(f"restart_roles: unknown role(s) {', '.join(unknown)}; expected some of {ROLES}")
        self.restart_roles = tuple(self.restart_roles)
        if self.host_kv_ratio != 0 and not self.host_kv_ratio > 1:
            raise ValueError(f"host_kv_ratio must be 0 (no host tier) or > 1, got {self.host_kv_ratio}")
        if self.steps is None and self.duration_s is None:
            self.steps = 1

    def model_profile(self) -> pm.ModelProfile:
        """The engines' profile: `profile` loaded, with the host KV tier `host_kv_ratio` asks for. Raises ValueError
        for an unknown profile or one that cannot have the tier."""
        return with_host_kv(load_profile(self.profile), self.host_kv_ratio)

    def echo(self) -> dict[str, Any]:
        """The configuration as JSON-ready values (the workload by name when it is an object)."""
        workload = (
            self.workload if isinstance(self.workload, str) else getattr(self.workload, "name", "custom")
        )
        return {
            "workload": workload,
            "profile": self.profile,
            "engines": self.engines,
            "mode": self.mode,
            "staleness": self.staleness,
            "training_s": self.training_s,
            "policy": self.policy,
            "seed": self.seed,
            "steps": self.steps,
            "duration_s": self.duration_s,
            "batch_size": self.batch_size,
            "group_size": self.group_size,
            "window_s": self.window_s,
            "drain_bound_s": self.drain_bound_s,
            "forecaster": self.forecaster,
            # Only when set: a plain run's JSON keeps its shape.
            **({"restart_roles": list(self.restart_roles)} if self.restart_roles else {}),
            **({"host_kv_ratio": self.host_kv_ratio} if self.host_kv_ratio else {}),
        }


@dataclass
class SimResult:
    """The outcome of one run: headline figures, token accounting and windowed series (see `to_json`)."""

    config: SimConfig
    sim: Simulation = field(repr=False)
    end_s: float
    wall_s: float  # wall-clock seconds of the event loop (not in to_json: the JSON is deterministic)
    extra: dict[str, Any] = field(default_factory=dict)  # extra JSON sections (the oracle's passes)

    def windows(self) -> dict[str, Any]:
        m, p = self.sim.metrics, self.sim.profile
        w = m.windows.window_s
        n = max(1, math.ceil(self.end_s / w))
        # Seconds each window covers (the last one may be cut short by the end of the run).
        span = [max(min(w, self.end_s - i * w), 1e-9) for i in range(n)]

        def rate(name: str) -> list[float]:
            return [x / s for x, s in zip(m.windows.get(name, n), span, strict=True)]

        demand = rate("prefill_demand")
        decode = rate("decode_tokens")
        engines = {r: rate(f"engine_s_{r}") for r in (*ROLE_NAMES, "switching")}
        decode_rate = pm.decode_tokens_per_s_nominal(p)
        return {
            "window_s": w,
            "t_s": [i * w for i in range(n)],
            "prefill_demand_tokens_per_s": demand,  # new prompt tokens of turns submitted in the window
            "prefill_computed_tokens_per_s": rate("prefill_computed"),
            "decode_tokens_per_s": decode,  # output tokens generated in the window
            "prefill_decode_ratio": [(d / o if o > 0 else None) for d, o in zip(demand, decode, strict=True)],
            "engines": engines,  # time-averaged engine count per role
            "capacity_prefill_tokens_per_s": [x * p.prefill_tokens_per_s for x in engines["prefill"]],
            "capacity_decode_tokens_per_s": [x * decode_rate for x in engines["decode"]],
            "capacity_mixed_prefill_tokens_per_s": [x * p.prefill_tokens_per_s for x in engines["mixed"]],
            "capacity_mixed_decode_tokens_per_s": [x * decode_rate for x in engines["mixed"]],
        }

    def timelines(self) -> dict[str, Any]:
        """What the HTML report plots beyond the windows (`prorsa.report`): every engine's role at each change
        ([virtual s, role or "switching"]), the forecasts the policy read (first horizon: q10/q50/q90 tokens
        over the next `horizon_s`), and the trajectory completion times as (seconds, count) buckets."""
        m = self.sim.metrics
        roles: dict[str, list[list[Any]]] = {}
        for t, engine_id, role in m.role_log:
            roles.setdefault(engine_id, []).append([t, role])
        forecasts = []
        for f in self.sim._views.forecasts:
            if not f.horizons:
                continue
            h = f.horizons[0]
            p, d = h.prefill_tokens, h.decode_tokens
            forecasts.append([f.ts_s, h.horizon_s, p.q10, p.q50, p.q90, d.q10, d.q50, d.q90])
        return {
            "end_s": self.end_s,
            "engine_roles": roles,
            "forecast_columns": [
                "ts_s",
                "horizon_s",
                "prefill_q10",
                "prefill_q50",
                "prefill_q90",
                "decode_q10",
                "decode_q50",
                "decode_q90",
            ],
            "forecasts": forecasts,
            "trajectory_s_buckets": [list(b) for b in m.completion.buckets()],
        }

    def _host_tier(self) -> dict[str, Any]:
        """The hit rate by tier, with a host KV tier only (a plain run's JSON keeps its shape): prompt tokens found
        on the GPUs and reloaded from host memory, over all prompt tokens."""
        m = self.sim.metrics
        if not self.sim.profile.host_kv_tokens:
            return {}
        prompt = m.prompt_tokens or 1
        device = m.prefix_hit_tokens - m.host_hit_tokens
        return {
            "prefix_cache_hit_rate_by_tier": {"device": device / prompt, "host": m.host_hit_tokens / prompt}
        }

    def to_json(self, timelines: bool = False) -> dict[str, Any]:
        """The result as JSON-ready values; `timelines=True` adds the report's `timelines` section (off by
        default: the simulator's JSON stays what `prorsa.bench.sim_identity` compares)."""
        m, d = self.sim.metrics, self.sim.driver
        rollout_s = self.end_s
        return {
            "avg_trajectory_s": m.completion.mean(),
            "p50_trajectory_s": m.completion.quantile(0.5),
            "p99_trajectory_s": m.completion.quantile(0.99),
            "max_trajectory_s": m.completion.max if m.completion.count else 0.0,
            "rollout_s": rollout_s,
            "tokens_per_s": m.decoded_tokens / rollout_s if rollout_s > 0 else 0.0,
            "utilisation": m.utilisation(),
            "role_switches": m.role_switches,
            "prefix_cache_hit_rate": m.prefix_hit_tokens / m.prompt_tokens if m.prompt_tokens else 0.0,
            **self._host_tier(),
            "trajectories_completed": m.trajectories_completed,
            "trajectories_expected": d.expected,
            "trajectories_aborted": m.trajectories_aborted,
            "trajectories_truncated": m.trajectories_truncated,
            "steps_trained": d.trained,
            "tokens": {
                "prompt": m.prompt_tokens,
                "prefill_computed": m.prefill_computed_tokens,
                "prefix_hit": m.prefix_hit_tokens,
                "migration_recompute": m.migration_recompute_tokens,
                "migration_hit": m.migration_hit_tokens,
                "wasted_prefill": m.wasted_prefill_tokens,
                "decoded": m.decoded_tokens,
                "wasted_decoded": m.wasted_decoded_tokens,
                "new_prompt_submitted": m.new_prompt_tokens,
            },
            "migrations": m.migrations,
            "handoffs": m.handoffs,
            "plans_applied": self.sim.plans_applied,
            "affinity": {"hits": self.sim.router.affinity_hits, "misses": self.sim.router.affinity_misses},
            "windows": self.windows(),
            "config": self.config.echo(),
            "workload": getattr(self.sim.driver.workload, "name", "custom"),
            "profile": self.sim.profile.name,
            **self.extra,
            **({"timelines": self.timelines()} if timelines else {}),
        }


def _load_workload(config: SimConfig) -> StepSource:
    if not isinstance(config.workload, str):
        return config.workload
    from prorsa.workload.spec import load_workload  # imported late: trace loading is heavy

    return load_workload(
        config.workload, batch_size=config.batch_size, group_size=config.group_size, seed=config.seed
    )


def run_simulation(config: SimConfig) -> SimResult:
    """Run one simulation. Raises ValueError (or WorkloadError / PolicyError) on a bad configuration.

    A policy that reads forecasts gets the live forecast feed (`prorsa.sim.forecast_feed`, predictor
    `config.forecaster`; `truth`: the true future demand, `prorsa.sim.truth_feed`); `oracle` is the hindsight search
    (`prorsa.sim.hindsight`)."""
    profile = config.model_profile()
    policy = make_policy(config.policy, config.engines, profile=profile)
    if policy.name == "oracle":
        from prorsa.sim.hindsight import run_hindsight  # imported late: it imports this module

        return run_hindsight(config)
    if config.forecaster == "truth" and policy.uses_forecast:
        from prorsa.sim.truth_feed import run_truth_fed  # imported late: it imports this module

        return run_truth_fed(config)
    return simulate(config, policy, profile, _load_workload(config))


def simulate(
    config: SimConfig,
    policy: AllocatorPolicy,
    profile: pm.ModelProfile,
    workload: StepSource,
    feed: DemandFeed | None = None,
) -> SimResult:
    """One run of `policy` (built by the caller). Without a `feed`, a policy that reads forecasts gets the live
    forecast feed. Every event goes to the feed (if it observes), then to `config.observer`."""
    if feed is None and policy.uses_forecast:
        from prorsa.sim.forecast_feed import live_feed  # imported late: the forecaster is heavy

        workload, feed = live_feed(config, workload)
    chain = [o for o in (feed, config.observer) if o is not None and hasattr(o, "on_event")]
    observer: SimObserver | None = None
    if len(chain) == 1:
        observer = chain[0]  # type: ignore[assignment]
    elif chain:
        from prorsa.sim.forecast_feed import Tee

        observer = Tee(*chain)  # type: ignore[arg-type]
    sim = Simulation(config, workload, profile, policy, observer=observer, feed=feed)
    t0 = time.perf_counter()
    end = sim.run()
    return SimResult(config=config, sim=sim, end_s=end, wall_s=time.perf_counter() - t0)
