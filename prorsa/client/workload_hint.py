"""The rollout driver's workload path: what only a simulated engine needs, kept out of the trainer's SDK.

A trainer's turn is tokens and sampling: `Trajectory.generate(prompt_token_ids, sampling)`; a real engine computes
everything else itself. A simulated engine playing a recorded workload (a trace, a task profile) has no model to
decide how long the output is, and the rollout driver may not send token ids at all (only their count). Those
prescriptions travel here, beside the SDK: the driver (or a test) builds a `WorkloadHint` per turn and calls
`generate_hinted(traj, ids, sampling, hint)`, which runs exactly `Trajectory.generate`'s turn with the hint copied
into the request. On the wire the hint fills `GenerateRequest.prompt_len`, `sim_output_tokens` and
`sim_cacheable_tokens` (proto/README.md); real engines ignore the two `sim_*` fields.

This module is deliberately not exported from `prorsa.client`: a trainer never needs it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from proto import SamplingParams

if TYPE_CHECKING:
    from prorsa.client.client import Trajectory
    from prorsa.client.stream import GenerateResult


@dataclass(frozen=True, slots=True)
class WorkloadHint:
    """One turn as the workload prescribes it, for a simulated engine. Token counts, all >= 0."""

    prompt_len: (
        int  # the whole context in tokens; equals len(prompt ids) when ids are sent, else only counted
    )
    output_tokens: int = 0  # output length the workload prescribes (0: the engine decides, up to max_tokens)
    cacheable_tokens: int = 0  # prompt tokens an engine holding this trajectory's prefix may serve from cache

    def __post_init__(self) -> None:
        for name in ("prompt_len", "output_tokens", "cacheable_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"WorkloadHint.{name} must be >= 0, got {getattr(self, name)}")


async def generate_hinted(
    traj: Trajectory,
    prompt_token_ids: list[int],
    sampling: SamplingParams | dict,
    hint: WorkloadHint,
    *,
    on_tokens: Callable[[list[int]], None] | None = None,
    timeout_s: float | None = None,
) -> GenerateResult:
    """`traj.generate(prompt_token_ids, sampling, ...)` with `hint` attached to the request.

    `prompt_token_ids` may be empty (the simulated engine then counts `hint.prompt_len` tokens); when ids are given
    their length must equal `hint.prompt_len`. Raises ValueError on that mismatch, else what `generate` raises.
    """
    if prompt_token_ids and len(prompt_token_ids) != hint.prompt_len:
        raise ValueError(
            f"WorkloadHint.prompt_len {hint.prompt_len} != {len(prompt_token_ids)} prompt ids sent for "
            f"trajectory {traj.traj_id}"
        )
    return await traj._run_turn(prompt_token_ids, sampling, hint, on_tokens, timeout_s)
