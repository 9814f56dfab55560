"""How much work an engine may pull now (pure: no I/O, no clock). Which decodes a drain lets finish is
`switch_rule.py`'s.

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
from dataclasses import dataclass, field
from typing import Any, Literal

from mypy_extensions import mypyc_attr

WorkKind = Literal["prefill", "decode"]  # the queue family: GenerateRequests or DecodeHandoffs


@dataclass(frozen=True, slots=True)
class PullConfig:
    """How an engine agent pulls (`services.engine_agent.puller`); the simulator's placement reads the same values."""

    # All wall seconds: fetch timeouts and poll cadences pace I/O, not the (possibly time-scaled) engine. The
    # simulator reads them as modelled seconds: what they are at a time scale of 1, i.e. in production.
    ack_wait_s: float = 3.0
    own_poll_s: float = 0.02  # mixed role: the short poll of the decode queue
    any_poll_s: float = 0.25  # long poll of every queue (a fetch returns as soon as a message arrives)
    room_wait_s: float = 0.25  # a loop without room rechecks at least this often (estimates move)
    decode_check_s: float = 0.5  # mixed role: how often to look at decode handoffs when idle
    max_fetch: int = 16
    prefill_budget_tokens: int = 32_768
    max_ack_pending: int = 100_000

    def __deepcopy__(self, memo: dict[int, Any]) -> PullConfig:
        # Immutable: a fork of the simulator shares it (compiled, a frozen copy could not be filled in).
        return self


@dataclass(frozen=True, slots=True)
class EngineLimits:
    max_batch: int  # sequences decoding at once
    kv_capacity_tokens: int
    prefill_budget_tokens: int  # prompt tokens held for prefill at most
    max_fetch: int = 16  # messages per fetch at most

    def __deepcopy__(self, memo: dict[int, Any]) -> EngineLimits:
        return self  # immutable: shared by a fork (as `PullConfig`)


@dataclass(frozen=True, slots=True)
class HeldWork:
    prefill_jobs: int = 0  # held requests whose prompt is still to prefill here
    prefill_tokens: int = 0  # their context tokens
    decode_jobs: int = 0  # held requests that decode here
    kv_reserved_tokens: int = 0  # KV those decodes will hold at most


@mypyc_attr(allow_interpreted_subclasses=True)  # deep-copied by `Simulation.fork` (see `prorsa.native`)
@dataclass(slots=True)
class Ewma:
    """Exponentially weighted mean of observed sizes, starting from a prior."""

    value: float
    alpha: float = 0.2

    def observe(self, x: float) -> float:
        self.value += self.alpha * (x - self.value)
        return self.value


@dataclass(slots=True)
class PullEstimates:
    """What an engine expects the next message to hold, learnt from what it pulled: it fetches before it can see
    a message's size. The priors are a mid-sized agent turn (2 k prompt tokens, 4 k KV with its output) — the first
    pulls size the estimates, so they matter for the first few messages only."""

    prompt_tokens: Ewma = field(default_factory=lambda: Ewma(2048.0))
    kv_tokens: Ewma = field(default_factory=lambda: Ewma(4096.0))

    def observe(self, context_tokens: int, expected_output_tokens: int) -> None:
        # `Ewma.observe` twice, inlined: the simulator calls this once per prompt and once per handoff.
        p, kv = self.prompt_tokens, self.kv_tokens
        p.value += p.alpha * (context_tokens - p.value)
        kv.value += kv.alpha * (context_tokens + expected_output_tokens - kv.value)


def kv_reservation_tokens(context_tokens: int, expected_output_tokens: int) -> int:
    """KV a decoding sequence holds at its end: its context plus what it will still generate."""
    return max(0, context_tokens) + max(0, expected_output_tokens)


def prefill_pull_size(limits: EngineLimits, held: HeldWork, est_prompt_tokens: float) -> int:
    """Requests to fetch for prefill: enough to fill the token budget (at least one while under it)."""
    return prefill_fetch(limits, held.prefill_jobs, held.prefill_tokens, est_prompt_tokens)


def prefill_fetch(limits: EngineLimits, jobs: int, tokens: int, est_prompt_tokens: float) -> int:
    """`prefill_pull_size` on the two counts it reads (the simulator's router calls it once per prompt)."""
    room = limits.prefill_budget_tokens - tokens
    if room <= 0 or jobs >= limits.max_batch:
        return 0
    n = max(1, math.floor(room / max(1.0, est_prompt_tokens)))
    return min(n, limits.max_fetch, limits.max_batch - jobs)


def decode_pull_size(limits: EngineLimits, held: HeldWork, est_kv_tokens: float) -> int:
    """Sequences to fetch for decode: free batch slots, as many as the free KV is expected to hold."""
    return decode_fetch(limits, held.decode_jobs, held.kv_reserved_tokens, est_kv_tokens)


def decode_fetch(limits: EngineLimits, jobs: int, kv_reserved_tokens: int, est_kv_tokens: float) -> int:
    """`decode_pull_size` on the two counts it reads (the simulator's router calls it once per handoff)."""
    slots = limits.max_batch - jobs
    room = limits.kv_capacity_tokens - kv_reserved_tokens
    if slots <= 0 or room <= 0:
        return 0
    fit = math.floor(room / max(1.0, est_kv_tokens))
    if fit == 0 and jobs == 0:
        fit = 1  # an empty engine always takes one: it may be larger than the estimate, never than the engine
    return max(0, min(slots, fit, limits.max_fetch))


def takes(role: str, kind: WorkKind) -> bool:
    """Whether an engine in `role` runs work of `kind` at all (a mixed engine runs both)."""
    return role == "mixed" or (role == "prefill") == (kind == "prefill")


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
