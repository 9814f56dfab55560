"""How much work an engine may pull now, and which decodes a drain lets finish (pure: no I/O, no clock).

(Not the allocator's capacity model, `services/allocator/capacity.py`: that one is the rates a policy plans with.)

Capacity-driven pulling: an engine takes work from the JetStream queues only when it can start it soon, so work
it cannot run stays in the shared queue where an idle engine takes it.
- prefill work (prefill role): a token budget of prompt tokens held but not yet prefilled, so the next prefill
  batch is always queued locally and no more;
- decode work (decode role): free batch slots and KV room for the prompt plus the expected output;
- mixed role: a request both prefills and decodes here, so both limits apply.
Sizes of work not yet seen are estimated from what was pulled before (`Ewma`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

WorkKind = Literal["prefill", "decode"]  # the queue family: GenerateRequests or DecodeHandoffs


@dataclass(frozen=True, slots=True)
class EngineLimits:
    max_batch: int  # sequences decoding at once
    kv_capacity_tokens: int
    prefill_budget_tokens: int  # prompt tokens held for prefill at most
    max_fetch: int = 16  # messages per fetch at most


@dataclass(frozen=True, slots=True)
class HeldWork:
    prefill_jobs: int = 0  # held requests whose prompt is still to prefill here
    prefill_tokens: int = 0  # their context tokens
    decode_jobs: int = 0  # held requests that decode here
    kv_reserved_tokens: int = 0  # KV those decodes will hold at most


@dataclass(slots=True)
class Ewma:
    """Exponentially weighted mean of observed sizes, starting from a prior."""

    value: float
    alpha: float = 0.2

    def observe(self, x: float) -> float:
        self.value += self.alpha * (x - self.value)
        return self.value


def kv_reservation_tokens(context_tokens: int, expected_output_tokens: int) -> int:
    """KV a decoding sequence holds at its end: its context plus what it will still generate."""
    return max(0, context_tokens) + max(0, expected_output_tokens)


def prefill_pull_size(limits: EngineLimits, held: HeldWork, est_prompt_tokens: float) -> int:
    """Requests to fetch for prefill: enough to fill the token budget (at least one while under it)."""
    room = limits.prefill_budget_tokens - held.prefill_tokens
    if room <= 0 or held.prefill_jobs >= limits.max_batch:
        return 0
    n = max(1, math.floor(room / max(1.0, est_prompt_tokens)))
    return min(n, limits.max_fetch, limits.max_batch - held.prefill_jobs)


def decode_pull_size(limits: EngineLimits, held: HeldWork, est_kv_tokens: float) -> int:
    """Sequences to fetch for decode: free batch slots, as many as the free KV is expected to hold."""
    slots = limits.max_batch - held.decode_jobs
    room = limits.kv_capacity_tokens - held.kv_reserved_tokens
    if slots <= 0 or room <= 0:
        return 0
    fit = math.floor(room / max(1.0, est_kv_tokens))
    if fit == 0 and held.decode_jobs == 0:
        fit = 1  # an empty engine always takes one: it may be larger than the estimate, never than the engine
    return max(0, min(slots, fit, limits.max_fetch))


def pull_size(
    role: str,
    kind: WorkKind,
    limits: EngineLimits,
    held: HeldWork,
    est_prompt_tokens: float,
    est_kv_tokens: float,
) -> int:
    """Messages of `kind` the engine may fetch now in `role` (0 = not now, or not this role's work)."""
    if kind == "prefill":
        if role == "prefill":
            return prefill_pull_size(limits, held, est_prompt_tokens)
        if role == "mixed":
            return min(
                prefill_pull_size(limits, held, est_prompt_tokens),
                decode_pull_size(limits, held, est_kv_tokens),
            )
        return 0
    if role in ("decode", "mixed"):
        return decode_pull_size(limits, held, est_kv_tokens)
    return 0


@dataclass(frozen=True, slots=True)
class DrainItem:
    request_id: str
    remaining_tokens: int  # output tokens it is still expected to generate
    s_per_token: float  # its observed inter-token time (scaled seconds, like the drain timeout)


def plan_drain(items: list[DrainItem], drain_timeout_s: float) -> tuple[list[str], list[str]]:
    """Split decodes into (finish here, migrate): those expected to end within `drain_timeout_s` finish."""
    finish: list[str] = []
    migrate: list[str] = []
    for it in items:
        expected_s = max(0, it.remaining_tokens) * max(0.0, it.s_per_token)
        (finish if expected_s <= drain_timeout_s else migrate).append(it.request_id)
    return finish, migrate
