"""Issue 14, finding 4 (end): a fixed-roles policy copes with the engine count changing under it (an engine died,
or a new one joined) instead of failing every decision with "covers 3 engines, the cluster has 2"."""

from __future__ import annotations

import pytest

from services.allocator.registry import make_policy
from tests.test_allocator_policy import _view


@pytest.mark.parametrize(
    ("spec", "built_for", "fleet", "expected"),
    [
        ("colocated", 3, {"e0": "mixed", "e2": "mixed"}, None),  # nothing to change: all mixed
        ("colocated", 3, {"e0": "decode", "e1": "mixed"}, {"e0": "mixed"}),
        ("static:1:2", 3, {"e1": "decode", "e2": "decode"}, {"e1": "prefill"}),  # the prefill engine died
        ("static:1:2", 3, {"e2": "decode"}, {"e2": "mixed"}),  # one engine left: it must do both
        (
            "static:1:1",
            2,
            {"e0": "prefill", "e1": "decode", "e2": "mixed", "e3": "mixed"},
            {"e1": "prefill", "e2": "decode", "e3": "decode"},
        ),
    ],
)
def test_fixed_roles_follow_the_fleet(
    spec: str, built_for: int, fleet: dict[str, str], expected: object
) -> None:
    policy = make_policy(spec, built_for)
    plan = policy.decide(_view(fleet))
    assert (None if plan is None else dict(plan.roles)) == expected
    assert dict(policy.initial_plan(sorted(fleet)).roles).keys() == fleet.keys()
