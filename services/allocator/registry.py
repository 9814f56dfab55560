"""The allocator's policy registry: a spec's name → the factory that builds the policy, every built-in listed here.

`make_policy("name:arg:arg", n_engines, profile=...)` builds a policy; `register_policy` adds one (a plugin).
`profile` (a `perf_model.ModelProfile`, a built-in profile name, or None for the default) reaches only the
factories that take it. The built-ins are registered explicitly, in the table below, and the imports go one way:
this module imports the policy seam (`policy.py`, which holds the fixed-role policies) and the adaptive policies
(`policies/`), which import only the seam.

| spec        | factory                       | takes the profile |
|-------------|-------------------------------|-------------------|
| `colocated` | `policy.make_colocated`       | no                |
| `static`    | `policy.make_static`          | no                |
| `reactive`  | `policies.reactive`           | yes               |
| `dynamo`    | `policies.dynamo`             | yes               |
| `prorsa`    | `policies.prorsa`             | yes               |
| `oracle`    | `policies.prorsa` (simulator) | yes               |
"""

from __future__ import annotations

from collections.abc import Callable

from services.allocator.policies.dynamo import make_dynamo
from services.allocator.policies.prorsa import make_oracle, make_prorsa
from services.allocator.policies.reactive import make_reactive
from services.allocator.policy import AllocatorPolicy, PolicyError, make_colocated, make_static

# `factory(args, n_engines)`, or `factory(args, n_engines, profile)` for a factory that takes the profile.
PolicyFactory = Callable[..., AllocatorPolicy]

# name → (factory, whether it takes the engines' profile)
_REGISTRY: dict[str, tuple[PolicyFactory, bool]] = {
    "colocated": (make_colocated, False),
    "static": (make_static, False),
    "reactive": (make_reactive, True),
    "dynamo": (make_dynamo, True),
    "prorsa": (make_prorsa, True),
    "oracle": (make_oracle, True),
}


def register_policy(name: str, factory: PolicyFactory, *, uses_profile: bool = False) -> None:
    """Add a policy factory for spec `name:arg:...`: `factory(args, n_engines)`, or
    `factory(args, n_engines, profile)` when `uses_profile`. Raises PolicyError on a clash."""
    if name in _REGISTRY:
        raise PolicyError(f"policy {name!r} is already registered")
    _REGISTRY[name] = (factory, uses_profile)


def policy_names() -> list[str]:
    return sorted(_REGISTRY)


def make_policy(spec: str, n_engines: int, *, profile: object | None = None) -> AllocatorPolicy:
    """Build a policy from `name[:arg...]` for a cluster of `n_engines`, with the engines' performance profile
    (None = the default profile). Raises PolicyError if unknown/invalid."""
    if n_engines < 1:
        raise PolicyError(f"need at least one engine, got {n_engines}")
    name, *args = spec.strip().split(":")
    entry = _REGISTRY.get(name)
    if entry is None:
        raise PolicyError(f"unknown policy {name!r}; known: {', '.join(policy_names())}")
    factory, uses_profile = entry
    if uses_profile:
        return factory(args, n_engines, profile)
    return factory(args, n_engines)
