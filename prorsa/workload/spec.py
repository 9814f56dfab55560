"""The workload spec every command takes: a string naming where a step's trajectories come from.

    swe                      the shipped SWE coding-agent trace (task "coding", all trajectories start at 0)
    mooncake                 the shipped Mooncake conversation trace (task "conversation", arrival times kept)
    azure-code, azure-conv   the shipped Azure LLM traces (single-turn, arrival times kept)
    trace:PATH               any file shaped like one of the above (.csv / .jsonl / .json, optionally .gz)
    profile:NAME             a seeded task profile: general, coding, math
    mix:A+B[+C...]           every step mixes the parts, its prompts split equally (or by weights: mix:A*3+B*1)
    mix:A/B[/C...]           steps alternate between the parts: step i comes from part i mod k

A `Workload` turns (spec, batch_size, group_size, seed) into the trajectories of RL step `index`, a pure function
of those five values. Trajectory ids are `s{index}-{n}` and group ids `s{index}-g{p}`, so they are unique across
steps and across the parts of a mix.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np

from prorsa.workload.azure_trace import load_azure_trace
from prorsa.workload.errors import WorkloadError
from prorsa.workload.mooncake_trace import load_mooncake_trace
from prorsa.workload.profiles import PROFILES, get_profile
from prorsa.workload.sources import Groups, ProfileSource, Source, TraceSource
from prorsa.workload.swe_trace import load_swe_trace
from prorsa.workload.trace_file import load_trace_file
from prorsa.workload.types import TrajectorySpec

VALID_FORMS = (
    "swe",
    "mooncake",
    "azure-code",
    "azure-conv",
    "trace:PATH",
    *(f"profile:{name}" for name in PROFILES),
    "mix:A+B (mixed within a step; weights as mix:A*3+B)",
    "mix:A/B (alternating steps)",
)

_NAMED: dict[str, Callable[[], Source]] = {
    "swe": lambda: TraceSource("swe", load_swe_trace()),
    "mooncake": lambda: TraceSource("mooncake", load_mooncake_trace()),
    "azure-code": lambda: TraceSource("azure-code", load_azure_trace("azure-code")),
    "azure-conv": lambda: TraceSource("azure-conv", load_azure_trace("azure-conv")),
}
# A mix splits at "+" or "/" only where a part's spec begins, so a trace path may hold "/" (but not "/trace:").
_PART_START = r"(?=(?:swe|mooncake|azure-code|azure-conv)(?:\*[0-9.]+)?(?:[+/]|$)|profile:|trace:)"
_SPLIT = re.compile(rf"([+/]){_PART_START}")
_WEIGHT = re.compile(r"^(.*)\*([0-9]+(?:\.[0-9]+)?)$")

DrawStep = Callable[[int], Groups]


class Workload:
    """The trajectories of every RL step of one workload spec."""

    def __init__(self, name: str, notes: list[str], draw: DrawStep, batch_size: int, group_size: int) -> None:
        self.name = name
        self.notes = notes  # human-readable: sizes, resampling, fits
        self.batch_size = batch_size
        self.group_size = group_size
        self._draw = draw

    def step(self, index: int) -> list[TrajectorySpec]:
        """The `batch_size` trajectories of step `index` ≥ 0 (a WorkloadError otherwise), in group order."""
        if index < 0:
            raise WorkloadError(f"step index must be ≥ 0, got {index}")
        out = []
        for p, members in enumerate(self._draw(index)):
            group = f"s{index}-g{p}"
            for traj in members:
                out.append(_renamed(traj, f"s{index}-{len(out)}", group))
        return out

    def __repr__(self) -> str:
        return f"Workload({self.name!r}, batch_size={self.batch_size}, group_size={self.group_size})"


def load_workload(
    spec: str,
    *,
    batch_size: int = 64,
    group_size: int = 1,
    seed: int = 0,
    source_filter: Callable[[Source], Source] | None = None,
) -> Workload:
    """Build the workload a spec names (forms in the module docstring). `source_filter` replaces each source
    (every part of a mix) before it is drawn from: e.g. half of a trace's trajectories (prorsa.forecast_eval.split).

    Raises WorkloadError for an unknown spec (listing the valid forms), a trace file that cannot be parsed, a
    batch_size that group_size does not divide, or a negative seed.
    """
    if batch_size < 1 or group_size < 1 or batch_size % group_size:
        raise WorkloadError(
            f"batch_size ({batch_size}) must be a positive multiple of group_size ({group_size})"
        )
    if seed < 0:
        raise WorkloadError(f"seed must be ≥ 0, got {seed}")
    n_prompts = batch_size // group_size
    spec = spec.strip()
    keep = source_filter or (lambda s: s)
    if spec.startswith("mix:"):
        draw, notes = _mix(spec, n_prompts, group_size, seed, keep)
    else:
        source = keep(_source(spec))
        notes = source.notes(n_prompts, group_size, seed)

        def draw(index: int) -> Groups:
            return source.draw(index, n_prompts, group_size, (seed,))

    return Workload(spec, notes, draw, batch_size, group_size)


def _source(spec: str) -> Source:
    if spec in _NAMED:
        return _NAMED[spec]()
    if spec.startswith("profile:"):
        name = spec.removeprefix("profile:")
        if name not in PROFILES:
            raise WorkloadError(
                f"unknown profile {name!r} in {spec!r}; valid forms: {', '.join(VALID_FORMS)}"
            )
        return ProfileSource(spec, get_profile(name))
    if spec.startswith("trace:") and spec.removeprefix("trace:"):
        return TraceSource(spec, load_trace_file(spec.removeprefix("trace:")))
    raise WorkloadError(f"unknown workload spec {spec!r}; valid forms: {', '.join(VALID_FORMS)}")


def _mix(
    spec: str, n_prompts: int, group_size: int, seed: int, keep: Callable[[Source], Source]
) -> tuple[DrawStep, list[str]]:
    pieces = _SPLIT.split(spec.removeprefix("mix:"))
    texts, operators = pieces[::2], set(pieces[1::2])
    if len(texts) < 2 or len(operators) != 1:
        raise WorkloadError(
            f"{spec!r}: a mix needs two or more parts joined all by '+' (mixed) or all by '/' (alternating); "
            f"valid forms: {', '.join(VALID_FORMS)}"
        )
    parts, weights = zip(*(_weighted(text, spec) for text in texts), strict=True)
    sources = [keep(_source(part)) for part in parts]
    if operators == {"/"}:
        if any(w != 1.0 for w in weights):
            raise WorkloadError(f"{spec!r}: weights apply to mixed parts (+), not alternating ones (/)")
        return _alternating(sources, n_prompts, group_size, seed)
    return _mixed(sources, list(weights), n_prompts, group_size, seed)


def _weighted(text: str, spec: str) -> tuple[str, float]:
    match = _WEIGHT.match(text)
    if match is None:
        return text, 1.0
    weight = float(match.group(2))
    if weight <= 0:
        raise WorkloadError(f"{spec!r}: weight of {match.group(1)!r} must be > 0")
    return match.group(1), weight


def _alternating(
    sources: list[Source], n_prompts: int, group_size: int, seed: int
) -> tuple[DrawStep, list[str]]:
    k = len(sources)
    notes = [f"steps alternate between {k} parts: step i comes from part i mod {k}"]
    for source in sources:
        notes += source.notes(n_prompts, group_size, seed)

    def draw(index: int) -> Groups:
        part = index % k
        # Each part counts its own steps, so a trace part's windows advance without gaps.
        return sources[part].draw(index // k, n_prompts, group_size, (seed, part))

    return draw, notes


def _mixed(
    sources: list[Source], weights: list[float], n_prompts: int, group_size: int, seed: int
) -> tuple[DrawStep, list[str]]:
    shares = _split_prompts(n_prompts, weights)
    notes = [
        "each step mixes "
        + " + ".join(f"{share * group_size} {s.label}" for share, s in zip(shares, sources, strict=True))
    ]
    for source, share in zip(sources, shares, strict=True):
        notes += source.notes(share, group_size, seed)

    def draw(index: int) -> Groups:
        groups: Groups = []
        for part, (source, share) in enumerate(zip(sources, shares, strict=True)):
            groups += source.draw(index, share, group_size, (seed, part))
        return groups

    return draw, notes


def _split_prompts(n_prompts: int, weights: list[float]) -> list[int]:
    """Largest-remainder split of n_prompts by weights (ties to the earlier part)."""
    exact = np.asarray(weights) / sum(weights) * n_prompts
    shares = np.floor(exact).astype(int)
    order = np.argsort(-(exact - shares), kind="stable")
    shares[order[: n_prompts - int(shares.sum())]] += 1
    return shares.tolist()


def _renamed(traj: TrajectorySpec, traj_id: str, group: str) -> TrajectorySpec:
    # Built directly rather than with dataclasses.replace: this runs once per trajectory of every step.
    return TrajectorySpec(traj_id, traj.task, traj.turns, traj.arrival_s, group, traj.prefix_blocks)
