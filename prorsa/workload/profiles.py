"""Task profiles: seeded generators of trajectories for the three task shapes of agentic RL.

A profile draws, per trajectory, a number of turns, a first-prompt length, and per later turn the new prompt tokens
(the tool's observation plus template), and per turn the output tokens and the tool latency after it, each from its
own `LogMixture`. Draws are independent (no correlation between a trajectory's turns, beyond sharing turn 0 within
a GRPO group).

* `coding` is *fitted* to the shipped SWE-agent trace at first use (memoised; EM on log-values, see `fit.py`). With
  the current trace the fit gives (`python -c "from prorsa.workload.profiles import coding_profile as c;
  print(*c().notes, sep='\\n')"`):
    turns         0.03·LN(median 10.6, σ 0.71) + 0.97·LN(median 78.4, σ 0.32) in [4, 189]
    first prompt  0.90·LN(median 1760, σ 0.13) + 0.10·LN(median 3396, σ 0.05) in [1492, 3399]
    new prompt    0.20·[30] + 0.80·(0.13·LN(40.5, σ 0.13) + 0.23·LN(85.8, σ 0.42) + 0.64·LN(269, σ 0.82)) in [22, 3333]
    output        0.63·LN(median 74.3, σ 0.28) + 0.37·LN(median 329, σ 0.77) in [44, 3504]
    tool latency  0.41·LN(0.225 s, σ 0.17) + 0.54·LN(0.273 s, σ 0.53) + 0.05·LN(2.45 s, σ 1.40) in [0.067, 60.1] s
  Two-sample KS on log-values against the trace: < 0.07 for each (tests/test_workload_profiles.py checks it).
* `general` is prefill-heavy (new-prefill : decode ≈ 12 : 1): a tool-using research / browsing agent with a large
  system prompt and long observations (search results, page extracts) answered by short tool calls, over many turns.
  Not fitted (no public trace of such agents' token counts was at hand); each parameter's reasoning is by its value.
* `math` is decode-heavy (new-prefill : decode ≈ 1 : 25): tool-integrated reasoning on competition problems — a
  short problem statement, a long chain of thought per turn, a few short interpreter results. Not fitted either.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from itertools import starmap

import numpy as np

from prorsa.workload.errors import WorkloadError
from prorsa.workload.fit import LogMixture, fit_log_mixture, lognormal
from prorsa.workload.swe_trace import load_swe_trace
from prorsa.workload.types import TrajectorySpec, Turn


@dataclass(frozen=True, slots=True)
class Profile:
    """The distributions of one task's trajectories."""

    name: str
    task: str
    turns: LogMixture  # model calls per trajectory (rounded, at least 1)
    first_prompt_tokens: LogMixture  # turn 0's whole prompt
    new_prompt_tokens: LogMixture  # each later turn's observation + template
    output_tokens: LogMixture  # every turn's generated tokens (at least 1)
    tool_latency_s: LogMixture  # seconds in the tool after every turn but the last
    notes: tuple[str, ...] = ()

    def sample_groups(
        self, rng: np.random.Generator, n_prompts: int, group_size: int
    ) -> list[list[TrajectorySpec]]:
        """`n_prompts` groups of `group_size` trajectories; members of a group share turn 0's prompt length.

        Trajectory ids are left empty: the workload names them.
        """
        n = n_prompts * group_size
        if n == 0:  # a mix can leave a part without prompts
            return []
        counts = np.maximum(self.turns.sample_int(rng, n), 1)
        total = int(counts.sum())
        first = np.repeat(self.first_prompt_tokens.sample_int(rng, n_prompts), group_size)
        new = self.new_prompt_tokens.sample_int(rng, total)
        starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
        new[starts] = first  # turn 0 of every trajectory: its group's first prompt
        output = np.maximum(self.output_tokens.sample_int(rng, total), 1)
        latency = self.tool_latency_s.sample(rng, total)
        latency[starts + counts - 1] = 0.0  # no tool call after the last turn
        # starmap: ~25 % faster than a comprehension for the ~300k turns of a 4,096-trajectory coding step.
        turns = list(starmap(Turn, zip(new.tolist(), output.tolist(), latency.tolist(), strict=True)))
        ends = (starts + counts).tolist()
        trajectories = [
            TrajectorySpec(traj_id="", task=self.task, turns=tuple(turns[s:e]))
            for s, e in zip(starts.tolist(), ends, strict=True)
        ]
        return [trajectories[p * group_size : (p + 1) * group_size] for p in range(n_prompts)]


# Mixture sizes for the coding fit: enough components for the trace's modes, few enough for 99 trajectories
# (turns, first prompt) — a 4-component fit of 99 points chases single instances.
_CODING_COMPONENTS = {"turns": 2, "first_prompt": 2, "new_prompt": 3, "output": 2, "tool_latency": 3}


@cache
def coding_profile() -> Profile:
    """Fitted to the shipped SWE trace (first call ≈ 0.2 s: parse + fit; later calls free)."""
    trajectories = load_swe_trace().trajectories
    later = [t for traj in trajectories for t in traj.turns[1:]]
    c = _CODING_COMPONENTS
    fits = {
        "turns": fit_log_mixture([len(t.turns) for t in trajectories], c["turns"]),
        "first prompt": fit_log_mixture(
            [t.turns[0].new_prompt_tokens for t in trajectories], c["first_prompt"]
        ),
        # The atom is the agent's fixed 30-token "empty output" observation: 20 % of later turns.
        "new prompt": fit_log_mixture(
            [max(t.new_prompt_tokens, 1) for t in later], c["new_prompt"], atom=True
        ),
        "output": fit_log_mixture(
            [t.output_tokens for traj in trajectories for t in traj.turns], c["output"]
        ),
        "tool latency": fit_log_mixture(
            [max(t.tool_latency_s, 1e-3) for traj in trajectories for t in traj.turns[:-1]], c["tool_latency"]
        ),
    }
    notes = ("profile:coding is fitted to the SWE trace (log-normal mixtures by EM):",) + tuple(
        f"  {name}: {fit.describe()}" for name, fit in fits.items()
    )
    return Profile(
        "coding",
        "coding",
        fits["turns"],
        fits["first prompt"],
        fits["new prompt"],
        fits["output"],
        fits["tool latency"],
        notes,
    )


@cache
def general_profile() -> Profile:
    """Prefill-heavy: many turns, long observations, short replies (see the module docstring)."""
    return Profile(
        name="general",
        task="general",
        # ~25 tool calls per task: deep-research / browsing agents typically run tens of steps, capped at 100.
        turns=lognormal(median=25, sigma=0.5, low=3, high=100),
        # System prompt with tool schemas plus the task: a few thousand tokens.
        first_prompt_tokens=lognormal(median=4000, sigma=0.3, low=1000, high=16000),
        # Search results and page extracts: ~1.5k tokens, up to a 32k-token document.
        new_prompt_tokens=lognormal(median=1500, sigma=0.9, low=20, high=32000),
        # A short thought plus one tool call.
        output_tokens=lognormal(median=150, sigma=0.7, low=8, high=4096),
        # HTTP fetches and searches: about a second and a half, with a long tail of slow sites.
        tool_latency_s=lognormal(median=1.5, sigma=0.9, low=0.05, high=60),
        notes=(
            "profile:general is a prefill-heavy synthetic agent (not fitted; see prorsa/workload/profiles.py)",
        ),
    )


@cache
def math_profile() -> Profile:
    """Decode-heavy: few turns, long reasoning outputs, short tool results (see the module docstring)."""
    return Profile(
        name="math",
        task="math",
        # Tool-integrated reasoning uses the interpreter a couple of times per problem.
        turns=lognormal(median=3, sigma=0.5, low=1, high=8),
        # A competition problem plus instructions.
        first_prompt_tokens=lognormal(median=250, sigma=0.4, low=60, high=1500),
        # Interpreter stdout plus the template around it.
        new_prompt_tokens=lognormal(median=60, sigma=0.8, low=5, high=1000),
        # Thousands of reasoning tokens per turn, capped at a 16k response budget.
        output_tokens=lognormal(median=2500, sigma=0.8, low=64, high=16384),
        # Running a short Python snippet in a sandbox.
        tool_latency_s=lognormal(median=1.0, sigma=0.8, low=0.05, high=30),
        notes=(
            "profile:math is a decode-heavy synthetic reasoner (not fitted; see prorsa/workload/profiles.py)",
        ),
    )


PROFILES: dict[str, Callable[[], Profile]] = {
    "general": general_profile,
    "coding": coding_profile,
    "math": math_profile,
}


def get_profile(name: str) -> Profile:
    """The named profile; raises WorkloadError listing the known names."""
    factory = PROFILES.get(name)
    if factory is None:
        raise WorkloadError(f"unknown profile {name!r}; known: {', '.join(PROFILES)}")
    return factory()
