"""The allocator's domain metrics: the plan it holds and how it gets there.

prorsa_plan_epoch                      epoch of the last published plan (grows with every switch command)
prorsa_plan_engines{role}              engines the last plan gives each role
prorsa_role_switches_total             role-switch commands sent
prorsa_role_switch_timeouts_total      commands whose ack did not come in time (never re-sent as such)
prorsa_allocator_decisions_total       policy decisions taken
prorsa_allocator_decision_seconds      time the policy took to decide (histogram)
"""

from __future__ import annotations

from proto import ROLES, AllocationPlan
from services.runtime.metrics import ServiceMetrics

DECISION_BUCKETS_S = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0)


class AllocatorMetrics:
    def __init__(self, m: ServiceMetrics) -> None:
        self._epoch = m.gauge("prorsa_plan_epoch", "Epoch of the last published allocation plan")
        engines = m.gauge("prorsa_plan_engines", "Engines the last plan gives each role", ["role"])
        self._engines = {r: engines.labels(role=r) for r in ROLES}
        self._switches = m.counter("prorsa_role_switches", "Role-switch commands sent")
        self._timeouts = m.counter("prorsa_role_switch_timeouts", "Role-switch commands whose ack timed out")
        self._decisions = m.counter("prorsa_allocator_decisions", "Policy decisions taken")
        self._decision_s = m.histogram(
            "prorsa_allocator_decision_seconds", "Time the policy took to decide", DECISION_BUCKETS_S
        )

    def on_plan(self, plan: AllocationPlan) -> None:
        self._epoch.set(plan.epoch)
        for role, gauge in self._engines.items():
            gauge.set(sum(1 for r in plan.roles.values() if r == role))

    def on_switches(self, n: int) -> None:
        self._switches.inc(n)

    def on_timeout(self) -> None:
        self._timeouts.inc()

    def on_decision(self, seconds: float) -> None:
        self._decisions.inc()
        self._decision_s.observe(seconds)
