"""The core of `prorsa top`: real proto messages (through the codec, as on the wire) in, the view model out."""

from __future__ import annotations

import json

import pytest

import proto
from prorsa.top.state import TopState
from proto import (
    AllocationPlan,
    DemandForecast,
    EngineStats,
    HealthReply,
    HorizonForecast,
    LifecycleSnapshot,
    ProtoError,
    Quantiles,
    RoleSwitchAck,
    TurnSubmitted,
)

T0 = 1_780_000_000.0
OTHER_VERSION = proto.SCHEMA_VERSION + 1  # a peer of a newer contract


def wire(msg: proto.Message) -> proto.Message:
    """What a subscriber gets: the message encoded and decoded again."""
    return proto.decode(proto.encode(msg))


def stats(engine: str, ts: float, role: str = "mixed", decode: float = 100.0, **kw) -> proto.Message:  # noqa: ANN003
    return wire(
        EngineStats(
            engine_id=engine, ts_s=ts, role=role, epoch=kw.pop("epoch", 0), decode_tokens_per_s=decode, **kw
        )
    )


def forecast(ts: float, prefill: float, decode: float, horizon: float = 5.0) -> proto.Message:
    def q(x: float) -> Quantiles:
        return Quantiles(q10=0.5 * x, q50=x, q90=1.5 * x)

    h = HorizonForecast(
        horizon_s=horizon,
        prefill_tokens=q(prefill),
        decode_tokens=q(decode),
        decode_concurrency=q(1),
        kv_tokens=q(1),
    )
    return wire(DemandForecast(ts_s=ts, predictor="prorsa", horizons=[h]))


def test_engine_rows_from_their_newest_stats_and_stale_ones_marked() -> None:
    s = TopState(stale_after_s=5.0)
    s.apply(stats("engine-1", T0, running=3, waiting=2, kv_used_tokens=500, kv_capacity_tokens=1000), now=0.0)
    s.apply(stats("engine-0", T0, role="prefill", prefix_cache_tokens=9000, prefix_hit_rate=0.9), now=0.0)
    s.apply(stats("engine-1", T0 + 1, role="decode", epoch=3, switching=True, running=4), now=4.0)
    v = s.view(now=6.0)
    assert [(r.engine_id, r.role, r.epoch, r.running, r.stale) for r in v.engines] == [
        ("engine-0", "prefill", 0, 0, True),
        ("engine-1", "decode", 3, 4, False),
    ]
    e1 = v.engines[1]
    assert e1.switching and e1.kv_fraction is None  # the newest report replaced the older one whole
    assert v.engines[0].prefix_cache_tokens == 9000
    assert v.decode_tokens_per_s == 100.0  # fresh engines only


def test_demand_realised_over_the_bus_clock_against_the_forecast_made_then() -> None:
    s = TopState()
    s.apply(forecast(T0, prefill=2000, decode=500), now=0.0)  # for (T0, T0 + 5]: 400 and 100 tokens/s
    for k in range(11):  # 100 new tokens every 0.5 s from T0 to T0 + 5: 200 tokens/s realised
        s.apply(
            wire(
                TurnSubmitted(
                    traj_id="t",
                    ts_s=T0 + 0.5 * k,
                    turn=k,
                    request_id=f"t:{k}",
                    prompt_tokens=9,
                    new_tokens=100,
                )
            ),
            now=0.0,
        )
    s.apply(stats("engine-0", T0 + 3, decode=80.0), now=0.0)
    s.apply(stats("engine-0", T0 + 5, decode=120.0), now=0.0)
    s.apply(stats("engine-1", T0 + 5, decode=50.0), now=0.0)
    s.apply(forecast(T0 + 5, prefill=1000, decode=1000), now=0.0)
    prefill, decode = s.view(now=0.0).demand
    assert (prefill.role, prefill.horizon_s) == ("prefill", 5.0)
    assert prefill.next_q == pytest.approx((100.0, 200.0, 300.0))
    assert prefill.predicted == pytest.approx(400.0)  # the forecast of T0, for the window that just ended
    assert prefill.realised == pytest.approx(200.0)  # turns stamped in (T0, T0 + 5]
    assert decode.predicted == pytest.approx(100.0)
    assert decode.realised == pytest.approx(100.0 + 50.0)  # per-engine mean over the window, summed


def test_demand_not_realised_before_the_window_is_covered() -> None:
    s = TopState()
    s.apply(forecast(T0, prefill=100, decode=100), now=0.0)
    s.apply(stats("engine-0", T0 + 2), now=0.0)
    prefill, decode = s.view(now=0.0).demand
    assert prefill.realised is None and decode.realised is None and prefill.predicted is None


def test_plan_phases_switches_and_services() -> None:
    s = TopState()
    s.apply(
        wire(
            AllocationPlan(
                epoch=7,
                policy="prorsa",
                roles={"e0": "prefill", "e1": "decode", "e2": "decode"},
                ts_s=T0,
                reason="decode-heavy tail",
            )
        ),
        now=10.0,
    )
    snap = LifecycleSnapshot(
        ts_s=T0,
        seq=3,
        counts={"decode": 4, "tool_call": 2},
        counts_by_task={},
        context_tokens_by_state={},
        trajectories=[],
        finished_total=9,
    )
    s.apply(wire(snap), now=10.0)
    s.apply(wire(RoleSwitchAck(engine_id="e0", epoch=7, role="prefill", ok=True)), now=10.0)
    s.apply(wire(RoleSwitchAck(engine_id="e1", epoch=7, role="decode", ok=False, error="busy")), now=10.0)
    for inst in ("a", "b"):
        s.apply(
            wire(HealthReply(service="engine_agent", instance_id=inst, status="ok", uptime_s=1, ts_s=T0)),
            now=10.0,
        )
    v = s.view(now=12.0)
    assert v.plan is not None and (v.plan.epoch, v.plan.reason, v.plan.age_s) == (7, "decode-heavy tail", 2.0)
    assert v.plan.roles == {"prefill": 1, "decode": 2}
    assert v.phases == {"decode": 4, "tool_call": 2} and v.finished_total == 9
    assert v.switches_acked == 1 and v.services == {"engine_agent": 2}
    assert s.view(now=100.0).services == {}  # no answer for a while: no longer counted
    assert s.startup_problem() is None


def test_bad_input_is_counted_and_named_never_raised() -> None:
    s = TopState()
    other = json.loads(proto.encode(EngineStats(engine_id="e0", ts_s=T0, role="mixed", epoch=0)))
    other["schema_version"] = OTHER_VERSION
    for _ in range(3):
        with pytest.raises(ProtoError) as err:
            proto.decode(json.dumps(other).encode(), "prorsa.stats.e0", EngineStats)
        s.reject("prorsa.stats.e0", err.value)
    with pytest.raises(ProtoError) as err:
        proto.decode(b"{not json", "prorsa.allocator.plan", AllocationPlan)
    s.reject("prorsa.allocator.plan", err.value)
    v = s.view(now=0.0)
    assert len(v.problems) == 2 and v.problems[0].startswith(
        "3 × prorsa.stats: a peer speaks another schema version"
    )
    assert f"schema version {OTHER_VERSION}" in v.problems[0] and v.problems[1].startswith(
        "1 × prorsa.allocator: decode"
    )
    assert not v.heard and v.engines == []


def test_startup_problem_names_what_is_wrong() -> None:
    s = TopState()
    assert s.startup_problem() == "no Prorsa service answered on the bus"
    reply = json.loads(
        proto.encode(HealthReply(service="allocator", instance_id="a", status="ok", uptime_s=1, ts_s=T0))
    )
    reply["schema_version"] = OTHER_VERSION
    with pytest.raises(ProtoError) as err:
        proto.decode(json.dumps(reply).encode(), "_INBOX.x", HealthReply)
    s.reject("_INBOX.x", err.value)
    problem = s.startup_problem()
    assert (
        problem is not None
        and "another wire format" in problem
        and f"schema version {OTHER_VERSION}" in problem
    )


@pytest.mark.parametrize("path", ["prorsa/top/state.py", "prorsa/top/render.py"])
def test_the_core_and_its_renderer_do_no_io(path: str) -> None:
    import ast
    from pathlib import Path

    tree = ast.parse((Path(__file__).resolve().parents[1] / path).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert not imported & {"asyncio", "nats", "time", "random"}, imported
