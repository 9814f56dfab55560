"""The allocator policy seam: views, plans, the base class's sanitising, and the registry."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

import pytest

from services.allocator.policy import (
    AllocatorPolicy,
    ClusterView,
    EngineView,
    Plan,
    PolicyError,
)
from services.allocator.registry import make_policy, policy_names, register_policy


def _view(roles: dict[str, str], now: float = 10.0) -> ClusterView:
    engines = tuple(
        EngineView(
            engine_id=e,
            role=r,
            running=0,
            waiting=0,
            queued_prefill_tokens=0,
            decode_batch=0,
            kv_used_tokens=0,
            kv_capacity_tokens=1_000,
            in_flight_tokens=0,
            switching=False,
        )
        for e, r in roles.items()
    )
    return ClusterView(
        now=now,
        engines=engines,
        prefill_queue_tokens=0,
        decode_queue_len=0,
        prefill_tokens_per_s=0.0,
        decode_tokens_per_s=0.0,
    )


IDS = ["engine-0", "engine-1", "engine-2", "engine-3"]


def test_colocated_puts_every_engine_in_mixed_and_then_keeps():
    policy = make_policy("colocated", 4)
    roles = dict(policy.initial_plan(IDS).roles)
    assert roles == dict.fromkeys(IDS, "mixed")
    assert policy.decide(_view(roles)) is None


def test_static_splits_in_id_order_and_restores_drift():
    policy = make_policy("static:3:1", 4)
    roles = dict(policy.initial_plan(list(reversed(IDS))).roles)
    assert roles == {
        "engine-0": "prefill",
        "engine-1": "prefill",
        "engine-2": "prefill",
        "engine-3": "decode",
    }
    drifted = roles | {"engine-1": "decode"}
    plan = policy.decide(_view(drifted))
    assert plan is not None and dict(plan.roles) == {"engine-1": "prefill"}


def test_static_hybrid_split_counts_mixed_engines():
    roles = make_policy("static:1:0:3", 4).initial_plan([f"engine-{i}" for i in range(4)]).roles
    assert sorted(roles.values()) == ["mixed", "mixed", "mixed", "prefill"]
    assert make_policy("static:0:2:2", 4).name == "static:0:2:2"


@pytest.mark.parametrize(
    ("spec", "n"),
    [
        ("static:3:2", 4),
        ("static:0:4", 4),
        ("static:0:4:0", 4),
        ("static:1:1:1", 4),
        ("static:1:2:1:0", 4),
        ("static:a:b", 4),
        ("static:2", 4),
        ("nope", 4),
        ("colocated:1", 4),
        ("colocated", 0),
    ],
)
def test_bad_specs_are_rejected(spec, n):
    with pytest.raises(PolicyError):
        make_policy(spec, n)


def test_views_and_plans_validate_roles():
    with pytest.raises(PolicyError):
        _view({"e": "both"})
    with pytest.raises(PolicyError):
        Plan(roles={"e": "sleep"})
    plan = Plan(roles={"e": "decode"}, reason="why")
    with pytest.raises(TypeError):
        plan.roles["e"] = "prefill"  # type: ignore[index]


@dataclass
class _Swap(AllocatorPolicy):
    target: dict | None = None

    def initial_plan(self, engine_ids):
        return Plan(dict.fromkeys(engine_ids, "mixed"))

    def plan(self, view):
        return Plan(self.target or {}, reason="test")


def test_decide_keeps_only_real_changes_and_rejects_unknown_engines():
    roles = {"a": "prefill", "b": "decode"}
    assert _Swap(target={"a": "prefill"}).decide(_view(roles)) is None
    plan = _Swap(target={"a": "prefill", "b": "prefill"}).decide(_view(roles))
    assert plan is not None and dict(plan.roles) == {"b": "prefill"} and plan.reason == "test"
    with pytest.raises(PolicyError, match="ghost"):
        _Swap(target={"ghost": "decode"}).decide(_view(roles))


def test_switching_engines_count_with_their_target_role():
    switching = EngineView(
        engine_id="a",
        role="prefill",
        running=0,
        waiting=0,
        queued_prefill_tokens=0,
        decode_batch=0,
        kv_used_tokens=0,
        kv_capacity_tokens=1,
        in_flight_tokens=0,
        switching=True,
        target_role="decode",
    )
    view = ClusterView(
        now=0.0,
        engines=(switching,),
        prefill_queue_tokens=0,
        decode_queue_len=0,
        prefill_tokens_per_s=0.0,
        decode_tokens_per_s=0.0,
    )
    assert view.roles() == {"a": "decode"}
    assert _Swap(target={"a": "decode"}).decide(view) is None


def test_registry_accepts_new_policies_once():
    name = "test-swap-policy"
    if name not in policy_names():
        register_policy(name, lambda args, n: _Swap(name=name))
    assert make_policy(name, 2).name == name
    with pytest.raises(PolicyError):
        register_policy(name, lambda args, n: _Swap(name=name))


def test_the_seam_imports_no_policy_and_the_registry_lists_every_builtin():
    # The imports go one way (registry → policies → seam): importing the seam loads no policy module.
    code = (
        "import sys, services.allocator.policy\n"
        "assert not [m for m in sys.modules if m.startswith('services.allocator.policies')], sys.modules\n"
        "from services.allocator.registry import policy_names\n"
        "print(','.join(policy_names()))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert {"colocated", "static", "reactive", "dynamo", "prorsa", "oracle"} <= set(out.strip().split(","))
