"""Decode admission for engines that measure their own KV (vLLM: `BackendStats.kv_measured`); pure, no clock.

`pull_capacity` admits a decode by reserving its context plus its expected output. A real model's output length is
unknown (the bound is max_tokens), so that reservation admits a fraction of what the engine holds, while vLLM itself
admits by the blocks in use and preempts a sequence when they run out. For such engines the puller therefore counts
the KV held as the engine's measured use (every data-parallel rank; blocks pinned for handoffs no decode engine has
claimed yet included, as vLLM keeps them allocated) plus the contexts of held decodes it has not started yet
(`measured_held`), sizes a sequence by its context alone, and stops pulling decode work for a while after a
preemption (`PreemptionGate`): the engine has overcommitted, so more work would only be preempted too.
The simulator's engines keep `pull_capacity`'s reservations (their outputs are modelled, not measured).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.engine_agent.pull_capacity import HeldWork


def measured_held(held: HeldWork, kv_used_tokens: int, pending_context_tokens: int) -> HeldWork:
    """`held` with its KV replaced by what the engine uses now plus `pending_context_tokens` (held decodes it has
    not started)."""
    return HeldWork(
        held.prefill_jobs,
        held.prefill_tokens,
        held.decode_jobs,
        max(0, kv_used_tokens) + max(0, pending_context_tokens),
    )


@dataclass(slots=True)
class PreemptionGate:
    """Closes decode admission for `hold_s` after the engine preempted a sequence (its cumulative count rose)."""

    hold_s: float = 2.0
    seen: int = 0  # the last cumulative count looked at
    closed_until_s: float = -math.inf

    def open(self, preemptions: int, now_s: float) -> bool:
        """Whether decode work may be pulled at `now_s` (seconds of any monotonic clock)."""
        if preemptions > self.seen:
            self.closed_until_s = now_s + self.hold_s
        self.seen = max(self.seen, preemptions)
        return now_s >= self.closed_until_s
