"""`reactive`: flip one engine at a time toward the role that is visibly overloaded now (no forecast).

In the spirit of Arrow (adaptive instance scheduling for disaggregated serving: instances change role when the
observed load of one side crosses a threshold). Every decision:
1. a role with demand and no engine gets one at once (cooldown ignored);
2. inside the cooldown after a flip, nothing else happens (a flip takes time to show in the queues);
3. prefill pressure = queued prefill work per prefill-capable engine, in seconds at the modelled rate, over
   `prefill_queue_s`; decode pressure = the larger of the decode engines' KV use over `decode_kv_high` and, while
   the decode queue grows, its length per decode engine over `decode_queue_per_engine`;
4. the larger pressure above 1 takes the other role's least-loaded engine, unless that would empty a role with
   demand. `mixed` engines are left alone (they already serve both).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from services.allocator.capacity import CapacityModel, request_means
from services.allocator.policies.common import (
    engines_by_role,
    floor_fix,
    initial_roles,
    make_capacity,
    parse_options,
    role_demand,
)
from services.allocator.policy import AllocatorPolicy, ClusterView, Plan


@dataclass
class ReactivePolicy(AllocatorPolicy):
    name: str = "reactive"
    interval_s: float = 5.0
    capacity: CapacityModel = field(default_factory=lambda: make_capacity(None))
    prefill_queue_s: float = 2.0  # seconds of queued prefill work per prefill engine that call for one more
    decode_kv_high: float = 0.85  # decode engines' KV use (fraction) that calls for one more decode engine
    decode_queue_per_engine: float = 4.0  # growing decode queue per decode engine that calls for one more
    cooldown_s: float = 15.0  # no flip within this long after the last one
    prefill_fraction: float = 0.5  # start-up share of prefill engines
    _last_flip_s: float = field(default=-math.inf, repr=False)
    _last_decode_queue: int = field(default=0, repr=False)

    def initial_plan(self, engine_ids: Sequence[str]) -> Plan:
        return Plan(roles=initial_roles(engine_ids, self.prefill_fraction), reason="reactive: initial roles")

    def plan(self, view: ClusterView) -> Plan | None:
        self.capacity.observe(view)
        growing = view.decode_queue_len > self._last_decode_queue
        self._last_decode_queue = view.decode_queue_len
        fix = floor_fix(view, "reactive")
        if fix is not None:
            self._last_flip_s = view.now
            return fix
        if view.now - self._last_flip_s < self.cooldown_s:
            return None
        p_pressure, d_pressure = self.pressures(view, growing)
        if max(p_pressure, d_pressure) <= 1.0:
            return None
        to_prefill = p_pressure >= d_pressure
        plan = self._flip(view, "prefill" if to_prefill else "decode", p_pressure, d_pressure)
        if plan is not None:
            self._last_flip_s = view.now
        return plan

    def pressures(self, view: ClusterView, decode_queue_growing: bool) -> tuple[float, float]:
        """(prefill pressure, decode pressure); above 1 calls for one more engine in that role."""
        groups = engines_by_role(view)
        n_prefill = len(groups["prefill"]) + len(groups["mixed"])
        n_decode = len(groups["decode"]) + len(groups["mixed"])
        isl, cached, _ = request_means(view)
        rate = self.capacity.prefill_tokens_per_s(isl, cached)
        queued_s = view.prefill_queue_tokens / max(1, n_prefill) / rate
        p_pressure = queued_s / self.prefill_queue_s if self.prefill_queue_s > 0 else 0.0
        decoders = groups["decode"] + groups["mixed"]
        kv_cap = sum(e.kv_capacity_tokens for e in decoders)
        kv_use = sum(e.kv_used_tokens for e in decoders) / kv_cap if kv_cap > 0 else 0.0
        d_pressure = kv_use / self.decode_kv_high if self.decode_kv_high > 0 else 0.0
        if decode_queue_growing and self.decode_queue_per_engine > 0:
            d_pressure = max(
                d_pressure, view.decode_queue_len / max(1, n_decode) / self.decode_queue_per_engine
            )
        return p_pressure, d_pressure

    def _flip(self, view: ClusterView, to: str, p_pressure: float, d_pressure: float) -> Plan | None:
        donor = "decode" if to == "prefill" else "prefill"
        groups = engines_by_role(view)
        prefill_demand, decode_demand = role_demand(view)
        donor_demand = decode_demand if donor == "decode" else prefill_demand
        # The donor must keep an engine able to serve it while it has demand (mixed engines count).
        if donor_demand and len(groups[donor]) + len(groups["mixed"]) <= 1:
            return None
        if not groups[donor]:
            return None
        engine = groups[donor][0]
        reason = (
            f"reactive: prefill pressure {p_pressure:.2f}, decode pressure {d_pressure:.2f} -> one more {to}"
        )
        return Plan(roles={engine.engine_id: to}, reason=reason)


def make_reactive(args: Sequence[str], n_engines: int, profile: object | None = None) -> ReactivePolicy:
    """`reactive[:key=value...]` with keys interval_s, prefill_queue_s, decode_kv_high, decode_queue_per_engine,
    cooldown_s, prefill_fraction. Raises PolicyError on a bad argument or profile."""
    defaults = {
        "interval_s": 5.0,
        "prefill_queue_s": 2.0,
        "decode_kv_high": 0.85,
        "decode_queue_per_engine": 4.0,
        "cooldown_s": 15.0,
        "prefill_fraction": 0.5,
    }
    opts = parse_options("reactive", args, defaults)
    return ReactivePolicy(capacity=make_capacity(profile), **opts)  # type: ignore[arg-type]
