"""The shape of a workload: trajectories of turns, as every generator and loader produces them.

A trajectory alternates model turns and tool calls. Turn k's prompt is the whole history so far:

    context_k = sum(new_prompt_tokens[0..k]) + sum(output_tokens[0..k-1])

so `new_prompt_tokens` is what an engine holding the trajectory's prefix must still prefill (turn 0: the
initial prompt; later turns: the tool observation plus template tokens), and everything else is cacheable.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Turn:
    """One model call of a trajectory."""

    new_prompt_tokens: int  # tokens appended to the history before this call (turn 0: whole first prompt)
    output_tokens: int  # tokens the model generates in this call
    tool_latency_s: float  # seconds spent in the tool after this call; 0.0 on the last turn

    def __post_init__(self) -> None:
        if self.new_prompt_tokens < 0 or self.output_tokens < 1 or self.tool_latency_s < 0:
            raise ValueError(f"invalid turn: {self}")


@dataclass(frozen=True, slots=True)
class TrajectorySpec:
    """A whole trajectory as the workload prescribes it (the driver replays it; engines never see it)."""

    traj_id: str
    task: str  # e.g. "coding", "math", "general", "conversation"
    turns: tuple[Turn, ...]
    arrival_s: float = 0.0  # offset from the start of its RL step (0 = submitted at step start)
    group: str = ""  # GRPO-style group id: trajectories of one prompt share turn 0's prefix
    prefix_blocks: tuple[int, ...] = field(default=())  # optional shared-prefix block ids (Mooncake hash_ids)

    def __post_init__(self) -> None:
        if not self.turns:
            raise ValueError(f"trajectory {self.traj_id} has no turns")

    def context_before(self, k: int) -> int:
        """Prompt length of turn k (tokens), i.e. the whole history it is sent with."""
        return sum(t.new_prompt_tokens for t in self.turns[: k + 1]) + sum(
            t.output_tokens for t in self.turns[:k]
        )

    @property
    def total_new_prompt_tokens(self) -> int:
        return sum(t.new_prompt_tokens for t in self.turns)

    @property
    def total_output_tokens(self) -> int:
        return sum(t.output_tokens for t in self.turns)
