"""What a rollout measured: per-trajectory completion times and per-step rollout times, summarised."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class TrajectoryRecord:
    traj_id: str
    step: int
    task: str
    turns_expected: int
    turns_done: int = 0
    start_s: float = 0.0
    end_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    restarts: int = 0  # restarted under newer weights (async staleness) or after engine loss
    completed: bool = False
    truncated: bool = False  # ended early: its context outgrew the model (the engine rejected the prompt)
    # Where the time went, summed over the turns of the attempt that completed: submit -> first token as the
    # engine measured it, submit -> last token as the driver saw it, and the tool calls as the clock slept them.
    ttft_s: float = 0.0
    generate_s: float = 0.0
    tool_s: float = 0.0
    tool_calls: int = 0

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass
class RolloutMetrics:
    """Times are in workload seconds (wall seconds × speedup for the simulated backend)."""

    records: dict[str, TrajectoryRecord] = field(default_factory=dict)
    step_rollout_s: list[float] = field(default_factory=list)
    total_s: float = 0.0
    role_switches: int = 0

    def summary(self) -> dict[str, float | int]:
        done = [r for r in self.records.values() if r.completed]
        durations = np.array([r.duration_s for r in done]) if done else np.zeros(1)
        prompt = sum(r.prompt_tokens for r in done)
        out = sum(r.output_tokens for r in done)
        turns = sum(r.turns_done for r in done)
        tools = sum(r.tool_calls for r in done)
        return {
            "trajectories_expected": len(self.records),
            "trajectories_completed": len(done),
            "turns_completed": turns,
            "avg_trajectory_s": float(durations.mean()),
            "p50_trajectory_s": float(np.percentile(durations, 50)),
            "p99_trajectory_s": float(np.percentile(durations, 99)),
            "rollout_s": float(self.total_s),
            "rollout_s_per_step": float(np.mean(self.step_rollout_s)) if self.step_rollout_s else 0.0,
            "tokens_per_s": float(out / self.total_s) if self.total_s > 0 else 0.0,
            "output_tokens": int(out),
            "prompt_tokens": int(prompt),
            "prefix_cache_hit_rate": float(sum(r.cached_tokens for r in done) / prompt) if prompt else 0.0,
            "role_switches": int(self.role_switches),
            "restarts": int(sum(r.restarts for r in self.records.values())),
            "trajectories_truncated": int(sum(r.truncated for r in self.records.values())),
            # Per-turn breakdown (compare with the simulator's turn_* keys to see where a gap comes from).
            "turn_ttft_s": float(sum(r.ttft_s for r in done) / turns) if turns else 0.0,
            "turn_generate_s": float(sum(r.generate_s for r in done) / turns) if turns else 0.0,
            "tool_call_s": float(sum(r.tool_s for r in done) / tools) if tools else 0.0,
        }
