"""Where a step's trajectories come from: a parsed trace or a task profile.

A source hands the workload `n_prompts` groups of `group_size` trajectories for one step; the workload names them.
Every draw is a pure function of (seed key, step index), so a step can be rebuilt in any order.

Traces without arrival times (the SWE trace) stand for an RL step that starts every trajectory at once: each step
draws its trajectories at random (without replacement while the trace has enough; with replacement otherwise).
Traces with arrival times (Mooncake, Azure) keep their arrival process: each step takes the next window of
consecutive trajectories (the first window at a seed-chosen offset) with arrival_s relative to the window start;
a trace shorter than one window is bootstrapped, trajectories and inter-arrival gaps drawn with replacement.
In a group of g > 1 the first trajectory is the prompt's head and the other g - 1 are drawn at random and take the
head's turn-0 prompt length, prefix blocks and arrival: the group shares its first prompt; later turns differ.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np

from prorsa.workload.profiles import Profile
from prorsa.workload.trace import Trace
from prorsa.workload.types import TrajectorySpec, Turn

Groups = list[list[TrajectorySpec]]


class Source(Protocol):
    label: str  # the spec that named it, for notes

    def notes(self, n_prompts: int, group_size: int, seed: int) -> list[str]: ...

    def draw(self, index: int, n_prompts: int, group_size: int, seed_key: tuple[int, ...]) -> Groups: ...


def _step_rng(seed_key: tuple[int, ...], index: int) -> np.random.Generator:
    # The trailing 1 keeps step streams apart from the window-offset stream, keyed by seed_key alone.
    return np.random.default_rng([*seed_key, index, 1])


@dataclasses.dataclass(frozen=True, slots=True)
class ProfileSource:
    label: str
    profile: Profile

    def notes(self, n_prompts: int, group_size: int, seed: int) -> list[str]:
        return list(self.profile.notes)

    def draw(self, index: int, n_prompts: int, group_size: int, seed_key: tuple[int, ...]) -> Groups:
        return self.profile.sample_groups(_step_rng(seed_key, index), n_prompts, group_size)


@dataclasses.dataclass(frozen=True, slots=True)
class TraceSource:
    label: str
    trace: Trace

    def notes(self, n_prompts: int, group_size: int, seed: int) -> list[str]:
        n = len(self.trace.trajectories)
        batch = n_prompts * group_size
        notes = [f"{self.label}: {note}" for note in self.trace.notes]
        if not self.trace.timed:
            how = (
                f"draws {batch} of them without replacement"
                if n >= batch
                else "resamples them with replacement (fresh traj_ids)"
            )
            notes.append(f"{self.label} has {n} trajectories; a step of {batch} {how} with seed {seed}")
        elif n >= n_prompts:
            notes.append(
                f"{self.label} has {n} trajectories; a step takes the next window of {n_prompts} consecutive "
                f"ones (first window chosen by seed {seed}), arrival_s relative to the window start"
            )
        else:
            notes.append(
                f"{self.label} has {n} trajectories, fewer than a step's {n_prompts}: each step resamples "
                f"trajectories and inter-arrival gaps with replacement with seed {seed} (fresh traj_ids)"
            )
        if group_size > 1:
            notes.append(
                f"{self.label}: groups of {group_size}: {group_size - 1} extra trajectories per prompt are drawn "
                "from the trace and take the head's first-prompt length"
            )
        return notes

    def draw(self, index: int, n_prompts: int, group_size: int, seed_key: tuple[int, ...]) -> Groups:
        if n_prompts == 0:
            return []
        rng = _step_rng(seed_key, index)
        if self.trace.timed:
            heads = self._window(index, n_prompts, seed_key, rng)
            members = rng.integers(len(self.trace.trajectories), size=n_prompts * (group_size - 1))
        else:
            chosen = self._sample(rng, n_prompts * group_size)
            heads = [self.trace.trajectories[i] for i in chosen[:n_prompts].tolist()]
            members = chosen[n_prompts:]
        pool = self.trace.trajectories
        per = group_size - 1
        return [
            [head] + [_join(pool[m], head) for m in members[p * per : (p + 1) * per].tolist()]
            for p, head in enumerate(heads)
        ]

    def _sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        n = len(self.trace.trajectories)
        return rng.choice(n, size=size, replace=False) if n >= size else rng.integers(n, size=size)

    def _window(
        self, index: int, n_prompts: int, seed_key: tuple[int, ...], rng: np.random.Generator
    ) -> list[TrajectorySpec]:
        pool = self.trace.trajectories
        n = len(pool)
        if n < n_prompts:
            return _bootstrap(pool, n_prompts, rng)
        starts = n - n_prompts + 1
        offset = int(np.random.default_rng(list(seed_key)).integers(starts))
        start = (offset + index * n_prompts) % starts
        window = pool[start : start + n_prompts]
        origin_s = window[0].arrival_s
        return [dataclasses.replace(t, arrival_s=t.arrival_s - origin_s) for t in window]


def _bootstrap(pool: tuple[TrajectorySpec, ...], size: int, rng: np.random.Generator) -> list[TrajectorySpec]:
    """`size` trajectories drawn with replacement, arriving after inter-arrival gaps drawn from the trace's."""
    picks = rng.integers(len(pool), size=size)
    gaps_s = np.diff([t.arrival_s for t in pool])
    drawn = rng.choice(gaps_s, size=size - 1) if gaps_s.size else np.zeros(size - 1)
    arrivals_s = np.concatenate(([0.0], np.cumsum(drawn)))
    return [
        dataclasses.replace(pool[i], arrival_s=float(a))
        for i, a in zip(picks.tolist(), arrivals_s.tolist(), strict=True)
    ]


def _join(member: TrajectorySpec, head: TrajectorySpec) -> TrajectorySpec:
    """`member` made part of `head`'s group: same first prompt, prefix blocks and arrival; its own later turns."""
    first = member.turns[0]
    turns = (
        Turn(head.turns[0].new_prompt_tokens, first.output_tokens, first.tool_latency_s),
    ) + member.turns[1:]
    return dataclasses.replace(
        member, turns=turns, arrival_s=head.arrival_s, prefix_blocks=head.prefix_blocks
    )
