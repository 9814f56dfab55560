"""How many prompts a trajectory's turn waits behind for the engine that holds its prefix: placement's patience.

One rule in one place: the client's engine directory applies it to every turn it addresses
(`prorsa.client.directory`, which the simulator's router calls), and the allocator's turn model prices the turns it
sends away (`services.allocator.policies.turn_model`). A turn sent away recomputes its whole context on whichever
engine takes it from the shared queue; waiting costs the queue ahead of it. So a turn waits behind as many prompts as
the recompute is worth — its context over its own new tokens, the prompts of its size that the recompute would
cost — and never fewer than `MAX_WAITING`, the queue depth below which staying is cheap whatever the context (a
prefill engine pulls a 32k-token budget of prompts at a time, several short prompts a step).
"""

from __future__ import annotations

MAX_WAITING = 8


def worth_prompts(context_tokens: float, new_tokens: float) -> float:
    """Recomputing a turn's whole context elsewhere, in prompts of its own new tokens (0 = unknown)."""
    return context_tokens / new_tokens if new_tokens > 0 else 0.0


def patience(worth: float, max_waiting: float = MAX_WAITING) -> float:
    """The most prompts queued at its engine (pulled or only addressed) a turn still waits behind."""
    return max(float(max_waiting), worth)


def stays(waiting: float, worth: float, max_waiting: float = MAX_WAITING) -> bool:
    """Whether a turn worth `worth` prompts waits behind `waiting` at its engine rather than go to the shared queue."""
    return waiting <= patience(worth, max_waiting)
