"""What the adaptive policies share: role demand, role counts, which engines move, start-up roles, spec arguments.

Pure. Rules every policy here keeps (the property tests check them):
* a role has *demand* when work for it is queued or running, was computed over the last interval, or the forecast's
  median says some will come; while it has demand at least one engine can serve it (`prefill`/`decode`, or `mixed`,
  which serves both);
* a plan names only engines of the view and keeps every engine (it moves engines, never adds or drops one);
* the engines that move are those with the least work in flight, engines already switching last.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from proto import DemandForecast
from services.allocator.capacity import CapacityModel, resolve_profile
from services.allocator.policy import ClusterView, EngineView, Plan, PolicyError

PREFILL_CAPABLE = frozenset({"prefill", "mixed"})
DECODE_CAPABLE = frozenset({"decode", "mixed"})


class Split(NamedTuple):
    """Engines per role (a tuple: policies build and hash hundreds per decision)."""

    prefill: int
    decode: int
    mixed: int = 0

    @property
    def total(self) -> int:
        return self.prefill + self.decode + self.mixed

    def of(self, role: str) -> int:
        """Engines in `role`."""
        return self.prefill if role == "prefill" else self.decode if role == "decode" else self.mixed

    def covers(self, prefill_demand: bool, decode_demand: bool) -> bool:
        """True if every role with demand has an engine that can serve it."""
        ok_p = not prefill_demand or self.prefill + self.mixed > 0
        ok_d = not decode_demand or self.decode + self.mixed > 0
        return ok_p and ok_d

    def __str__(self) -> str:
        return f"P{self.prefill}/D{self.decode}" + (f"/M{self.mixed}" if self.mixed else "")


def forecast_of(view: ClusterView) -> DemandForecast | None:
    """The view's forecast if it is a usable DemandForecast (at least one horizon), else None."""
    f = view.forecast
    if isinstance(f, DemandForecast) and f.horizons:
        return f
    return None


def role_demand(view: ClusterView) -> tuple[bool, bool]:
    """(prefill has demand, decode has demand) — see the module rules."""
    prefill = view.prefill_queue_tokens > 0 or view.prefill_tokens_per_s > 0
    prefill = prefill or any(e.queued_prefill_tokens > 0 for e in view.engines)
    decode = view.decode_queue_len > 0 or view.decode_tokens_per_s > 0
    decode = decode or any(e.decode_batch > 0 for e in view.engines)
    forecast = forecast_of(view)
    if forecast is not None:
        prefill = prefill or any(h.prefill_tokens.q50 > 0 for h in forecast.horizons)
        decode = decode or any(
            h.decode_tokens.q50 > 0 or h.decode_concurrency.q50 > 0 for h in forecast.horizons
        )
    return prefill, decode


def current_split(view: ClusterView) -> Split:
    """Engines per role, an engine that is switching counted at its target."""
    roles = list(view.roles().values())
    return Split(roles.count("prefill"), roles.count("decode"), roles.count("mixed"))


def move_order_key(e: EngineView) -> tuple[bool, int, int, str]:
    """Cheapest engine to move first: not already switching, least work in flight, fewest requests."""
    return (
        e.switching or bool(e.target_role),
        e.in_flight_tokens + e.queued_prefill_tokens,
        e.running + e.waiting,
        e.engine_id,
    )


def engines_by_role(view: ClusterView) -> dict[str, list[EngineView]]:
    """Engines of each role (target role when switching), cheapest to move first."""
    roles = view.roles()
    groups: dict[str, list[EngineView]] = {"prefill": [], "decode": [], "mixed": []}
    for e in view.engines:
        groups[roles[e.engine_id]].append(e)
    for members in groups.values():
        members.sort(key=move_order_key)
    return groups


def moves_for_split(view: ClusterView, target: Split) -> dict[str, str]:
    """engine_id → new role for the fewest moves that reach `target`. Raises PolicyError if the counts differ."""
    if target.total != len(view.engines):
        raise PolicyError(f"split {target} covers {target.total} engines, the view has {len(view.engines)}")
    groups = engines_by_role(view)
    movers: list[EngineView] = []
    for role, members in groups.items():
        movers.extend(members[: max(0, len(members) - target.of(role))])
    movers.sort(key=move_order_key)
    moves: dict[str, str] = {}
    queue = iter(movers)
    for role, members in groups.items():
        for _ in range(max(0, target.of(role) - len(members))):
            moves[next(queue).engine_id] = role
    return moves


def floor_fix(view: ClusterView, reason: str) -> Plan | None:
    """A one-engine plan when a role with demand has no engine that can serve it, else None.

    One engine alone becomes `mixed`; otherwise the cheapest engine of the other role moves (that role then still
    has an engine: it held them all).
    """
    prefill, decode = role_demand(view)
    split = current_split(view)
    if split.covers(prefill, decode):
        return None
    if len(view.engines) == 1:
        return Plan(
            roles={view.engines[0].engine_id: "mixed"}, reason=f"{reason}: one engine serves both roles"
        )
    missing = "prefill" if not split.covers(prefill, False) else "decode"
    donor = "decode" if missing == "prefill" else "prefill"
    candidates = engines_by_role(view)[donor]
    if not candidates:  # cannot happen when the view has engines; kept so a bad view fails soft
        return None
    return Plan(
        roles={candidates[0].engine_id: missing}, reason=f"{reason}: {missing} has demand and no engine"
    )


def initial_roles(engine_ids: Sequence[str], prefill_fraction: float) -> dict[str, str]:
    """Start-up roles: one engine is mixed; otherwise the first ⌈fraction·N⌉ ids (sorted) prefill, ≥ 1 per role."""
    ids = sorted(engine_ids)
    if len(ids) == 1:
        return {ids[0]: "mixed"}
    n_prefill = min(len(ids) - 1, max(1, math.ceil(prefill_fraction * len(ids))))
    return {e: ("prefill" if i < n_prefill else "decode") for i, e in enumerate(ids)}


def parse_options(
    policy: str, args: Sequence[str], defaults: Mapping[str, float | int | str]
) -> dict[str, object]:
    """`key=value` spec arguments over `defaults`, each converted to its default's type. Raises PolicyError."""
    out: dict[str, object] = dict(defaults)
    for arg in args:
        key, sep, raw = arg.partition("=")
        if not sep or key not in defaults:
            known = ", ".join(sorted(defaults))
            raise PolicyError(f"{policy}: bad argument {arg!r}; use key=value with key in: {known}")
        kind = type(defaults[key])
        try:
            value = kind(raw)
        except ValueError:
            raise PolicyError(f"{policy}: {key} must be {kind.__name__}, got {raw!r}") from None
        if isinstance(value, float | int) and (not math.isfinite(value) or value < 0):
            raise PolicyError(f"{policy}: {key} must be finite and >= 0, got {raw!r}")
        out[key] = value
    return out


def make_capacity(profile: object | None) -> CapacityModel:
    """A capacity model for `profile` (None = default). Raises PolicyError on an unknown or invalid profile."""
    try:
        return CapacityModel(resolve_profile(profile))
    except ValueError as exc:
        raise PolicyError(str(exc)) from exc
