"""The adaptive allocator policies (reactive, dynamo, prorsa, oracle) on hand-built views, plus their invariants."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proto import DemandForecast, HorizonForecast, Quantiles
from services.allocator.capacity import CapacityModel, resolve_profile
from services.allocator.policies.common import Split, initial_roles, moves_for_split
from services.allocator.policies.dynamo import DynamoPolicy, fit_budget
from services.allocator.policies.load_predictors import ArimaPredictor, ConstantPredictor
from services.allocator.policy import ClusterView, EngineView, Plan, PolicyError
from services.allocator.registry import make_policy, policy_names
from services.runtime.model_profiles import BUILTIN_PROFILES

PROFILE = resolve_profile(None)
CAP = CapacityModel(PROFILE)
CTX = 8192


def q(x: float, spread: float = 0.2) -> Quantiles:
    return Quantiles(q10=x * (1 - spread), q50=x, q90=x * (1 + spread))


def forecast(prefill_tok_s: float, decode_tok_s: float, seqs: float, ctx: float = CTX) -> DemandForecast:
    """Constant-rate demand over 5, 10 and 30 s."""
    return DemandForecast(
        ts_s=0.0,
        predictor="test",
        horizons=[
            HorizonForecast(
                horizon_s=h,
                prefill_tokens=q(prefill_tok_s * h),
                decode_tokens=q(decode_tok_s * h),
                decode_concurrency=q(seqs),
                kv_tokens=q(seqs * ctx),
            )
            for h in (5.0, 10.0, 30.0)
        ],
    )


def engine(i: int, role: str, batch: int = 0, queued: int = 0, work: int | None = None, **kw) -> EngineView:
    return EngineView(
        engine_id=f"e{i}",
        role=role,
        running=batch,
        waiting=0,
        queued_prefill_tokens=queued,
        decode_batch=batch,
        kv_used_tokens=kw.pop("kv", batch * CTX),
        kv_capacity_tokens=PROFILE.kv_capacity_tokens,
        in_flight_tokens=queued + batch * 100 if work is None else work,
        switching=False,
        **kw,
    )


def split_view(n_prefill: int, n_decode: int, now: float = 0.0, batch: int = 64, **kw) -> ClusterView:
    engines = [engine(i, "prefill") for i in range(n_prefill)]
    engines += [engine(i, "decode", batch=batch) for i in range(n_prefill, n_prefill + n_decode)]
    defaults = dict(
        prefill_queue_tokens=0, decode_queue_len=0, prefill_tokens_per_s=0.0, decode_tokens_per_s=0.0
    )
    return ClusterView(now=now, engines=tuple(engines), **{**defaults, **kw})


def applied(view: ClusterView, plan: Plan | None) -> dict[str, str]:
    roles = view.roles()
    if plan is not None:
        roles.update(plan.roles)
    return roles


def count(roles: dict[str, str], role: str) -> int:
    return sum(1 for r in roles.values() if r == role)


# --- registry ---------------------------------------------------------------------------------------------------


def test_registry_builds_every_policy_with_or_without_a_profile() -> None:
    assert {"reactive", "dynamo", "prorsa", "oracle", "colocated", "static"} <= set(policy_names())
    assert make_policy("oracle", 4).name == "oracle"
    for name in ("reactive", "dynamo", "prorsa"):
        assert make_policy(name, 4).name == name
        assert make_policy(name, 4, profile="deepseek-v3.2").capacity.profile.name == "deepseek-v3.2"
        assert make_policy(name, 4, profile=BUILTIN_PROFILES["cpu-tiny"]).capacity.profile.name == "cpu-tiny"
    assert make_policy("static:1:3", 4, profile="cpu-tiny").name == "static:1:3"  # old factories ignore it
    policy = make_policy("prorsa:margin=0.3:max_horizon_s=60", 4)
    assert (policy.margin, policy.max_horizon_s) == (0.3, 60.0)


@pytest.mark.parametrize(
    "spec,profile",
    [
        ("prorsa:margin", None),
        ("prorsa:nope=1", None),
        ("prorsa:margin=abc", None),
        ("prorsa:persist=2", None),
        ("dynamo:predictor=prophet", None),
        ("reactive:cooldown_s=-1", None),
        ("prorsa", "no-such-profile"),
        ("reactive", 42),
    ],
)
def test_bad_specs_and_profiles_raise_policy_error(spec: str, profile: object) -> None:
    with pytest.raises(PolicyError):
        make_policy(spec, 4, profile=profile)


def test_initial_roles_split_and_single_engine_is_mixed() -> None:
    assert initial_roles(["b", "a", "c", "d"], 0.5) == {
        "a": "prefill",
        "b": "prefill",
        "c": "decode",
        "d": "decode",
    }
    assert initial_roles(["x"], 0.5) == {"x": "mixed"}
    assert count(initial_roles([f"e{i}" for i in range(5)], 0.99), "decode") == 1


# --- reactive ---------------------------------------------------------------------------------------------------


def test_reactive_moves_the_least_loaded_decode_engine_to_an_overloaded_prefill() -> None:
    policy = make_policy("reactive", 8)
    queue = int(4 * CAP.prefill_tokens_per_s(2048) * 10)  # 10 s of work per prefill engine
    engines = [engine(i, "prefill", queued=1000) for i in range(4)]
    engines += [engine(4, "decode", batch=90), engine(5, "decode", batch=3), engine(6, "decode", batch=50)]
    engines += [engine(7, "decode", batch=40)]
    view = ClusterView(0.0, tuple(engines), queue, 0, 0.0, 0.0)
    plan = policy.decide(view)
    assert plan is not None and dict(plan.roles) == {"e5": "prefill"}


def test_reactive_moves_a_prefill_engine_when_decode_kv_runs_out_and_respects_cooldown() -> None:
    policy = make_policy("reactive:cooldown_s=15", 8)
    kv = int(0.95 * PROFILE.kv_capacity_tokens)
    engines = [engine(i, "prefill", queued=100 * (4 - i)) for i in range(4)]
    engines += [engine(i, "decode", batch=200, kv=kv) for i in range(4, 8)]
    view = ClusterView(0.0, tuple(engines), 400, 0, 1000.0, 5000.0)
    plan = policy.decide(view)
    assert plan is not None and dict(plan.roles) == {"e3": "decode"}  # the least queued prefill engine
    same = ClusterView(5.0, tuple(engines), 400, 0, 1000.0, 5000.0)
    assert policy.decide(same) is None  # within the cooldown
    later = ClusterView(20.0, tuple(engines), 400, 0, 1000.0, 5000.0)
    assert policy.decide(later) is not None


def test_reactive_stays_put_under_moderate_load_and_never_takes_the_last_engine() -> None:
    policy = make_policy("reactive", 4)
    calm = split_view(2, 2, prefill_queue_tokens=1000, batch=10)
    assert policy.decide(calm) is None
    # Decode overloaded, but the only prefill engine still has work: it stays.
    kv = int(0.99 * PROFILE.kv_capacity_tokens)
    engines = (engine(0, "prefill", queued=10), *(engine(i, "decode", batch=100, kv=kv) for i in range(1, 4)))
    assert make_policy("reactive", 4).decide(ClusterView(0.0, engines, 10, 0, 0.0, 0.0)) is None


# --- dynamo -----------------------------------------------------------------------------------------------------


def dynamo_views(
    policy: DynamoPolicy, n_prefill: int, n_decode: int, req_per_s: float, isl: float, osl: float
):
    """Drive the fast loop for one adjustment interval of steady load, then return the slow decision."""
    plan = None
    steps = int(policy.adjustment_interval_s / policy.interval_s)
    for k in range(steps + 1):
        view = split_view(
            n_prefill,
            n_decode,
            now=k * policy.interval_s,
            recent_window_s=policy.interval_s,
            recent_requests=round(req_per_s * policy.interval_s),
            recent_mean_isl_tokens=isl,
            recent_mean_osl_tokens=osl,
        )
        plan = policy.decide(view)
    return plan


def test_dynamo_sizes_prefill_and_decode_as_demand_over_throughput() -> None:
    policy = make_policy("dynamo:predictor=constant", 10)
    req_s, isl, osl = 20.0, 4000.0, 600.0
    prefill_rate = CAP.modelled_prefill_tokens_per_s(isl)
    decode_rate = CAP.modelled_decode_tokens_per_s_within(0.05, isl + osl / 2)
    want_p = math.ceil(req_s * isl / prefill_rate)
    want_d = math.ceil(req_s * osl / decode_rate)
    plan = dynamo_views(policy, 5, 5, req_s, isl, osl)
    assert (policy.last_sizing["prefill"], policy.last_sizing["decode"]) == (want_p, want_d)
    roles = applied(split_view(5, 5), plan)
    target = fit_budget(want_p, want_d, 10)
    assert (count(roles, "prefill"), count(roles, "decode")) == (target.prefill, target.decode)
    assert target.prefill >= want_p and target.decode >= want_d  # under budget: nobody gets less than asked


def test_dynamo_scales_down_proportionally_over_budget_and_skips_without_traffic() -> None:
    assert fit_budget(12, 20, 8) == Split(3, 5)  # Dynamo: round(P · budget / total)
    assert fit_budget(30, 1, 8) == Split(7, 1)  # ≥ 1 per role
    assert fit_budget(2, 3, 5) == Split(2, 3)
    assert fit_budget(1, 1, 6) == Split(3, 3)
    assert fit_budget(4, 4, 1) == Split(0, 0, 1)
    policy = make_policy("dynamo:predictor=constant", 6)
    assert dynamo_views(policy, 3, 3, 0.0, 1000.0, 100.0) is None
    assert policy.last_sizing == {}


def test_dynamo_fast_loop_adds_a_prefill_engine_on_a_long_queue() -> None:
    policy = make_policy("dynamo", 6)
    queue = int(3 * CAP.prefill_tokens_per_s(2048) * 20)  # 20 s of work per prefill engine
    plan = policy.decide(split_view(3, 3, prefill_queue_tokens=queue))
    assert plan is not None and list(plan.roles.values()) == ["prefill"]


def test_arima_predictor_falls_back_then_follows_a_trend() -> None:
    p = ArimaPredictor(window=20, min_points=5)
    for v in (10.0, 12.0, 14.0):
        p.add(v)
    assert p.predict_next() == 14.0 and p.fits == 0  # too few points: last value
    for v in (16.0, 18.0, 20.0, 22.0, 24.0):
        p.add(v)
    assert p.predict_next() == 26.0 and p.fits == 0  # exactly linear: the step, no fit
    noisy = ArimaPredictor(window=20, min_points=5)
    rng = np.random.default_rng(0)
    for k in range(12):
        noisy.add(100.0 + 10.0 * k + float(rng.normal(0.0, 2.0)))
    assert noisy.predict_next() > noisy.last() and noisy.fits == 1
    c = ConstantPredictor()
    c.add(float("nan"))
    assert c.predict_next() == 0.0


# --- prorsa -----------------------------------------------------------------------------------------------------


def test_moves_for_split_reaches_the_target_counts() -> None:
    view = split_view(2, 4)
    moves = moves_for_split(view, Split(1, 2, 3))
    roles = applied(view, Plan(roles=moves))
    assert (count(roles, "prefill"), count(roles, "decode"), count(roles, "mixed")) == (1, 2, 3)
    with pytest.raises(PolicyError):
        moves_for_split(view, Split(1, 1))


# --- invariants -------------------------------------------------------------------------------------------------

ROLES = ("prefill", "decode", "mixed")


@st.composite
def views(draw: st.DrawFn) -> list[ClusterView]:
    """A short sequence of random views of one cluster (so stateful policies see history)."""
    n = draw(st.integers(1, 10))
    roles = draw(st.lists(st.sampled_from(ROLES), min_size=n, max_size=n))
    out = []
    for k in range(draw(st.integers(1, 3))):
        engines = []
        for i, role in enumerate(roles):
            batch = draw(st.integers(0, 300)) if role != "prefill" else 0
            queued = draw(st.integers(0, 200_000)) if role != "decode" else 0
            switching = draw(st.booleans())
            target = draw(st.sampled_from([r for r in ROLES if r != role])) if switching else ""
            engines.append(
                EngineView(
                    engine_id=f"e{i}",
                    role=role,
                    running=batch,
                    waiting=0,
                    queued_prefill_tokens=queued,
                    decode_batch=batch,
                    kv_used_tokens=min(batch * draw(st.integers(1, 30_000)), PROFILE.kv_capacity_tokens),
                    kv_capacity_tokens=PROFILE.kv_capacity_tokens,
                    in_flight_tokens=queued + batch * 50,
                    switching=switching,
                    target_role=target,
                    decode_tokens_per_s=float(batch * draw(st.integers(0, 40))),
                )
            )
        f = None
        if draw(st.booleans()):
            f = forecast(draw(st.floats(0, 1e6)), draw(st.floats(0, 1e5)), draw(st.floats(0, 3000)))
        out.append(
            ClusterView(
                now=120.0 * k,
                engines=tuple(engines),
                prefill_queue_tokens=draw(st.integers(0, 1_000_000)) * draw(st.integers(0, 1)),
                decode_queue_len=draw(st.integers(0, 100)) * draw(st.integers(0, 1)),
                prefill_tokens_per_s=0.0,
                decode_tokens_per_s=0.0,
                forecast=f,
                recent_window_s=120.0,
                recent_requests=draw(st.integers(0, 500)),
                recent_mean_isl_tokens=float(draw(st.integers(0, 8000))),
                recent_mean_osl_tokens=float(draw(st.integers(0, 2000))),
            )
        )
    return out


def demand_of(view: ClusterView) -> tuple[bool, bool]:
    prefill = view.prefill_queue_tokens > 0 or any(e.queued_prefill_tokens for e in view.engines)
    decode = view.decode_queue_len > 0 or any(e.decode_batch for e in view.engines)
    if isinstance(view.forecast, DemandForecast):
        prefill = prefill or any(h.prefill_tokens.q50 > 0 for h in view.forecast.horizons)
        decode = decode or any(
            h.decode_tokens.q50 > 0 or h.decode_concurrency.q50 > 0 for h in view.forecast.horizons
        )
    return prefill, decode


@settings(max_examples=60, deadline=None)
@given(
    seq=views(),
    name=st.sampled_from(["reactive", "dynamo:predictor=constant", "prorsa", "colocated"]),
)
def test_every_plan_keeps_engines_covers_demand_and_names_known_engines(
    seq: list[ClusterView], name: str
) -> None:
    policy = make_policy(name, len(seq[0].engines))
    for view in seq:
        plan = policy.decide(view)
        roles = applied(view, plan)
        ids = {e.engine_id for e in view.engines}
        assert plan is None or set(plan.roles) <= ids
        assert set(roles) == ids and len(roles) == len(view.engines)
        prefill, decode = demand_of(view)
        if prefill:
            assert any(r in ("prefill", "mixed") for r in roles.values()), (view, plan)
        if decode:
            assert any(r in ("decode", "mixed") for r in roles.values()), (view, plan)


def test_allocator_speed_benchmark_runs() -> None:
    from prorsa.bench.allocator_speed import bench

    t = bench("prorsa", engines=64, decisions=20)
    assert t.decisions == 20 and 0 < t.p50_ms <= t.p99_ms <= t.max_ms


def test_no_policy_module_reads_a_clock_or_does_io() -> None:
    import services.allocator.capacity as capacity
    import services.allocator.policies.common as common
    import services.allocator.policies.dynamo as dynamo
    import services.allocator.policies.load_predictors as lp
    import services.allocator.policies.outlook as outlook
    import services.allocator.policies.prorsa as prorsa
    import services.allocator.policies.reactive as reactive
    import services.allocator.policies.step_memory as step_memory
    import services.allocator.policies.turn_model as turn_model

    for module in (capacity, common, dynamo, lp, outlook, turn_model, prorsa, reactive, step_memory):
        source = open(module.__file__).read()  # noqa: SIM115
        for banned in (
            "import asyncio",
            "import nats",
            "import time",
            "import random",
            "from time",
            "from nats",
        ):
            assert banned not in source, (module.__name__, banned)
