"""The allocator's policy seam: what a policy sees (`ClusterView`), what it returns (`Plan`); fixed-role policies.

Pure: a policy takes a view of the cluster at `view.now` and returns a plan or None (keep the current roles). The
same policy objects run in the allocator service (views built from engine stats, request events and forecasts)
and in the simulator (`prorsa.sim`, views built from its engine models), so a comparison between policies is a
comparison of decisions, never of plumbing.

Rules:
* `AllocatorPolicy.decide` sanitises once (the view names every engine once, roles are known) and then calls the
  subclass's `plan`; it drops assignments that change nothing and returns None when nothing is left, so
  `Plan.roles` holds only engines that must switch.
* `initial_plan(engine_ids)` gives the roles to start with (no switching cost at start-up).
* The caller runs `decide` every `interval_s` seconds (wall clock live, virtual clock in the simulator).
* Policies are built by name from `services.allocator.registry` (`make_policy("name:arg:arg", n_engines,
  profile=...)`); this module holds the seam and the fixed-role policies (`make_colocated`, `make_static`), and
  imports no policy module: the adaptive policies (`services.allocator.policies`) import it, the registry imports
  both.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar

from proto.messages import ROLES


class PolicyError(ValueError):
    """A policy spec or a view the policy cannot work with (caller's mistake)."""


@dataclass(frozen=True, slots=True)
class EngineView:
    """One engine as a policy sees it."""

    engine_id: str
    role: str  # "prefill" | "decode" | "mixed" (the role it serves, or is leaving while switching)
    running: int  # requests in its running batch (decodes + prefills in progress)
    waiting: int  # requests queued on it, not yet running
    queued_prefill_tokens: int  # uncached prompt tokens waiting to be prefilled on it
    decode_batch: int  # sequences decoding
    kv_used_tokens: int  # KV reserved by running work
    kv_capacity_tokens: int
    in_flight_tokens: int  # tokens still to compute for the work it holds (prefill + decode)
    switching: bool  # draining or reconfiguring towards `target_role`
    target_role: str = ""  # the role it is switching to ("" when not switching)
    # Optional (0 = not measured): what it computed over the last stats interval. Policies that correct their
    # performance model online compare these with the model (e.g. prorsa's EWMA of observed / modelled rate).
    prefill_tokens_per_s: float = 0.0  # prompt tokens it prefilled per second
    decode_tokens_per_s: float = 0.0  # output tokens it generated per second
    prefix_cache_tokens: int = 0  # prompt tokens its prefix cache holds for later turns (0 = not measured)
    # Roles a switch to which restarts it (another engine layout; EngineStats.restart_roles): priced as an engine
    # start with a drain, where any other switch is in place (services/engine_agent/switch_rule.py).
    restart_roles: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise PolicyError(f"engine {self.engine_id}: unknown role {self.role!r}")
        if self.target_role and self.target_role not in ROLES:
            raise PolicyError(f"engine {self.engine_id}: unknown target role {self.target_role!r}")
        unknown = [r for r in self.restart_roles if r not in ROLES]
        if unknown:
            raise PolicyError(f"engine {self.engine_id}: unknown restart role(s) {unknown}")


@dataclass(frozen=True, slots=True)
class ClusterView:
    """The cluster at `now`, as one policy decision sees it."""

    now: float  # seconds (virtual in the simulator)
    engines: tuple[EngineView, ...]
    prefill_queue_tokens: int  # uncached prompt tokens waiting anywhere (router + engine queues)
    decode_queue_len: int  # prefilled requests waiting for a decode slot
    prefill_tokens_per_s: float  # prompt tokens computed per second over the last interval
    decode_tokens_per_s: float  # output tokens generated per second over the last interval
    # The latest fresh DemandForecast (None: none yet, or stale): demand over the next horizons and its outlook, the
    # live trajectories and the turns ahead per task — the one road demand takes to a policy (the tracker's
    # snapshots are the forecaster's input, not a policy's).
    forecast: object | None = None
    # Optional request-level load since the previous decision (0 = not measured), as Dynamo's planner observes it:
    # the window they cover, requests submitted in it (turns sent for prefill), their mean uncached prompt tokens
    # (ISL), mean prefix tokens served from cache, and the mean output tokens (OSL) of requests finished in it.
    recent_window_s: float = 0.0
    recent_requests: int = 0
    recent_mean_isl_tokens: float = 0.0
    recent_mean_cached_tokens: float = 0.0
    recent_mean_osl_tokens: float = 0.0
    # New prompt tokens per turn submitted in the window (the observation the client appended; 0 = not measured):
    # unlike the ISL it does not depend on where the turn was placed.
    recent_mean_new_tokens: float = 0.0
    # Prompts waiting for prefill anywhere — not pulled yet, or pulled and queued on an engine — whose uncached
    # tokens `prefill_queue_tokens` counts (0 = not measured). At high concurrency most of a backlog waits in the
    # shared queue, not on the engines: the engines' `waiting` alone saw none of 8M queued tokens.
    prefill_queue_len: int = 0
    # Of the window's prefills, those of turns placement sent away from the engine holding their prefix, and the
    # prompt tokens each computed (0 = none or not measured): what a miss costs, as the engines measured it — the
    # turns sent away are the shorter ones, and the engine that takes one holds part of it (its group's prompt).
    recent_away_prefills: int = 0
    recent_mean_away_new_tokens: float = 0.0
    # Answers that ended in the window (0 = none, or not measured), of which `recent_mean_osl_tokens` is the mean.
    recent_finished: int = 0

    def roles(self) -> dict[str, str]:
        """engine_id → the role it will serve (its target when switching)."""
        return {e.engine_id: (e.target_role or e.role) for e in self.engines}


@dataclass(frozen=True, slots=True)
class Plan:
    """Roles to move engines to (engine_id → role), with the reason a human reads in logs."""

    roles: Mapping[str, str]
    reason: str = ""

    def __post_init__(self) -> None:
        for engine_id, role in self.roles.items():
            if role not in ROLES:
                raise PolicyError(f"plan moves {engine_id} to unknown role {role!r}")
        object.__setattr__(self, "roles", MappingProxyType(dict(self.roles)))


@dataclass
class AllocatorPolicy(ABC):
    """Base class: sanitise the view once, ask the subclass for target roles, keep only real changes."""

    name: str = "base"
    interval_s: float = 5.0  # seconds between decisions
    # Whether `plan` reads `ClusterView.forecast`: the simulator builds its forecaster feed only for such policies,
    # so a policy that ignores the forecast runs without the feed's cost.
    uses_forecast: ClassVar[bool] = False

    @abstractmethod
    def initial_plan(self, engine_ids: Sequence[str]) -> Plan:
        """Roles for every engine at start-up."""

    @abstractmethod
    def plan(self, view: ClusterView) -> Plan | None:
        """Target roles for (some) engines, given a sanitised view; None = keep."""

    def decide(self, view: ClusterView) -> Plan | None:
        """The switches this policy wants now, or None. Raises PolicyError on a malformed view or plan."""
        ids = [e.engine_id for e in view.engines]
        if len(set(ids)) != len(ids):
            raise PolicyError("view lists an engine twice")
        proposed = self.plan(view)
        if proposed is None:
            return None
        current = view.roles()
        unknown = sorted(set(proposed.roles) - set(current))
        if unknown:
            raise PolicyError(f"policy {self.name} planned unknown engine(s): {', '.join(unknown)}")
        changes = {eid: role for eid, role in proposed.roles.items() if current[eid] != role}
        if not changes:
            return None
        return Plan(roles=changes, reason=proposed.reason)


@dataclass
class FixedRolesPolicy(AllocatorPolicy):
    """Keeps a fixed assignment: the first engines (in sorted id order) by count per role.

    The counts are for the fleet the policy was built for. When engines die or join, the fleet it sees differs:
    the counts are then scaled to it (largest remainders, every role of the split kept while there are engines
    for it), so `colocated` stays all-mixed and `static:P:D` keeps its proportions instead of deciding nothing.
    """

    counts: tuple[tuple[str, int], ...] = ()

    def _assign(self, engine_ids: Sequence[str]) -> dict[str, str]:
        counts = _scaled_counts(self.counts, len(engine_ids))
        roles = [role for role, n in counts for _ in range(n)]
        return dict(zip(sorted(engine_ids), roles, strict=True))

    def initial_plan(self, engine_ids: Sequence[str]) -> Plan:
        return Plan(roles=self._assign(engine_ids), reason=f"{self.name}: initial roles")

    def plan(self, view: ClusterView) -> Plan | None:
        # Idempotent: re-asserts the fixed roles if an engine drifted (e.g. the initial plan was never applied).
        return Plan(
            roles=self._assign([e.engine_id for e in view.engines]), reason=f"{self.name}: fixed roles"
        )


def _scaled_counts(counts: tuple[tuple[str, int], ...], n: int) -> list[tuple[str, int]]:
    """`counts` (role, engines) rescaled to `n` engines in all: proportional, largest remainders first, each role
    at least one engine (a split without a decode engine would strand every handoff), all mixed when `n` is
    smaller than the number of roles."""
    total = sum(k for _, k in counts)
    if total == n or total == 0:
        return list(counts)
    if n < len(counts):  # too few engines for every role of the split: colocate them (mixed serves both)
        return [("mixed", n)]
    shares = [(role, k * n / total) for role, k in counts]
    out = {role: max(1, int(share)) for role, share in shares}
    by_remainder = sorted(shares, key=lambda rs: rs[1] - int(rs[1]), reverse=True)
    while sum(out.values()) < n:
        for role, _ in by_remainder:
            if sum(out.values()) < n:
                out[role] += 1
    while sum(out.values()) > n:  # the floor of one per role overshot: take from the largest
        role = max(out, key=lambda r: out[r])
        out[role] -= 1
    return [(role, out[role]) for role, _ in counts]


def make_colocated(args: Sequence[str], n_engines: int) -> AllocatorPolicy:
    """`colocated`: every engine mixed (the baseline)."""
    if args:
        raise PolicyError(f"colocated takes no arguments, got {':'.join(args)}")
    return FixedRolesPolicy(name="colocated", interval_s=30.0, counts=(("mixed", n_engines),))


def make_static(args: Sequence[str], n_engines: int) -> AllocatorPolicy:
    """`static:P:D` (P prefill + D decode engines) or `static:P:D:M` (plus M mixed: a hybrid split)."""
    if len(args) not in (2, 3) or not all(a.isdigit() for a in args):
        raise PolicyError(
            f"static needs static:P:D or static:P:D:M with integers, got static:{':'.join(args)}"
        )
    n_prefill, n_decode, n_mixed = int(args[0]), int(args[1]), int(args[2]) if len(args) == 3 else 0
    spec = ":".join(args)
    if n_prefill + n_decode + n_mixed != n_engines:
        raise PolicyError(f"static:{spec} must split all {n_engines} engines")
    # Every role's work needs an engine that can do it: prefill (prefill or mixed), decode (decode or mixed).
    if n_prefill + n_mixed < 1 or n_decode + n_mixed < 1:
        raise PolicyError(f"static:{spec} leaves prefill or decode without an engine")
    counts = tuple((r, n) for r, n in (("prefill", n_prefill), ("decode", n_decode), ("mixed", n_mixed)) if n)
    return FixedRolesPolicy(name=f"static:{spec}", interval_s=30.0, counts=counts)
