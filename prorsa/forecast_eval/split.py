"""Held-out evaluation: a workload restricted to one half of its instances, so what is reported was never developed on.

Halves (`part`):
  all      the whole workload;
  dev      the first half of the instances: what forecaster changes are developed and tuned on;
  report   the second half: what docs/benchmarks.md reports.
An instance is what a trace's trajectories are replayed from:
  - the SWE trace (trajectory ids `run/instance`): a SWE-bench instance, sorted by name; every run of one instance
    goes to the same half (the same task solved twice is not held out from itself);
  - traces with arrival times (Mooncake, Azure): each trajectory, in arrival order; dev is the first half of the
    trace's time, report the second (so the arrival process reported on comes after the one developed on);
  - any other trace: each trajectory id, sorted;
  - a task profile (synthetic, seeded): its draws under a seed stream of the half's own, so the two halves share
    no trajectory.
A trace with fewer than two instances cannot be split (WorkloadError). The forecaster fits no prior offline, so
nothing else needs holding out; the split guards the choices made while developing it.
"""

from __future__ import annotations

import dataclasses

from prorsa.workload.errors import WorkloadError
from prorsa.workload.sources import Groups, ProfileSource, Source, TraceSource
from prorsa.workload.spec import Workload, load_workload
from prorsa.workload.types import TrajectorySpec

SPLITS: tuple[str, ...] = ("all", "dev", "report")
_SALT = {"dev": 0x0DE5, "report": 0x5E7}  # seed streams of a profile's halves


def _instance(traj: TrajectorySpec) -> str:
    return traj.traj_id.rpartition("/")[2] if "/" in traj.traj_id else traj.traj_id


def half(source: Source, part: str) -> Source:
    """`source` restricted to `part` (module header). Raises WorkloadError for a trace of one instance."""
    if part == "all":
        return source
    if part not in _SALT:
        raise ValueError(f"split must be one of {SPLITS}, got {part!r}")
    if isinstance(source, TraceSource):
        trace = source.trace
        keys = [_instance(t) for t in trace.trajectories]
        order = list(dict.fromkeys(keys)) if trace.timed else sorted(set(keys))
        if len(order) < 2:
            raise WorkloadError(f"{source.label}: one instance, nothing to split")
        mid = len(order) // 2
        chosen = set(order[:mid] if part == "dev" else order[mid:])
        kept = tuple(t for t, k in zip(trace.trajectories, keys, strict=True) if k in chosen)
        note = f"{part} half: {len(chosen)} of {len(order)} instances, {len(kept)} trajectories"
        new = dataclasses.replace(trace, trajectories=kept, notes=(*trace.notes, note))
        return TraceSource(f"{source.label}[{part}]", new)
    if isinstance(source, ProfileSource):
        return _Salted(f"{source.label}[{part}]", source, _SALT[part])
    raise ValueError(f"cannot split a {type(source).__name__}")


@dataclasses.dataclass(frozen=True, slots=True)
class _Salted:
    """A seeded source drawn under a seed stream of its own (a profile's half)."""

    label: str
    inner: Source
    salt: int

    def notes(self, n_prompts: int, group_size: int, seed: int) -> list[str]:
        return [*self.inner.notes(n_prompts, group_size, seed), f"{self.label}: seed stream {self.salt:#x}"]

    def draw(self, index: int, n_prompts: int, group_size: int, seed_key: tuple[int, ...]) -> Groups:
        return self.inner.draw(index, n_prompts, group_size, (*seed_key, self.salt))


def split_workload(spec: str, part: str, *, batch_size: int, group_size: int, seed: int) -> Workload:
    """The workload `spec` restricted to `part` of its instances. Raises WorkloadError / ValueError."""
    if part not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {part!r}")
    workload = load_workload(
        spec,
        batch_size=batch_size,
        group_size=group_size,
        seed=seed,
        source_filter=lambda s: half(s, part),
    )
    if part != "all":
        workload.name = f"{spec}[{part}]"
    return workload
