"""The SWE coding-agent trace: one row per model call, grouped into one trajectory per (run, instance).

Turn k's new prompt tokens are what the append-only history gained since the previous call:

    new_k = prompt_k - prompt_{k-1} - completion_{k-1}        (turn 0: prompt_0)

which is what an engine that still holds the trajectory's KV must prefill. (The provider's own
`prompt_tokens - cached_tokens` is larger, p50 ≈ 190 vs 112, because its cache is block-granular and lossy.)
A negative delta (the agent truncated its history) is clamped to 0 and counted in the trace's notes. Output tokens
are `completion_tokens` (at least 1); `tool_latency_s` is the column (0 on the last turn or when empty).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from prorsa.workload.errors import WorkloadError
from prorsa.workload.trace import SWE_FILE, Trace, csv_rows, memoised, parse_float, parse_int, shipped_path
from prorsa.workload.types import TrajectorySpec, Turn

SWE_COLUMNS = ("run", "instance", "turn", "prompt_tokens", "completion_tokens", "tool_latency_s")
TASK = "coding"

# One parsed row: (line number, turn index, prompt tokens, completion tokens, tool latency or None when empty).
_Row = tuple[int, int, int, int, float | None]


def load_swe_trace(path: str | Path | None = None) -> Trace:
    """The shipped SWE trace, or any CSV with its columns (memoised per path).

    Raises WorkloadError (file:line) on a malformed row, a duplicate or missing turn, or a file with no rows.
    """
    return memoised("swe", path if path is not None else shipped_path(SWE_FILE), _parse)


def _parse(path: Path) -> Trace:
    calls: dict[tuple[str, str], list[_Row]] = defaultdict(list)  # insertion order = first appearance
    for line, row in csv_rows(path, SWE_COLUMNS):
        latency_text = row["tool_latency_s"].strip()
        calls[(row["run"], row["instance"])].append(
            (
                line,
                parse_int(path, line, "turn", row["turn"]),
                parse_int(path, line, "prompt_tokens", row["prompt_tokens"]),
                parse_int(path, line, "completion_tokens", row["completion_tokens"]),
                parse_float(path, line, "tool_latency_s", latency_text) if latency_text else None,
            )
        )
    if not calls:
        raise WorkloadError(f"{path}:2: no rows after the header")
    counts = {"clamped": 0, "zero_output": 0, "empty_latency": 0}
    trajectories = tuple(
        _trajectory(path, f"{run}/{instance}", rows, counts) for (run, instance), rows in calls.items()
    )
    return Trace(path.name, TASK, trajectories, timed=False, notes=_notes(path, trajectories, counts))


def _trajectory(path: Path, traj_id: str, rows: list[_Row], counts: dict[str, int]) -> TrajectorySpec:
    rows = sorted(rows, key=lambda r: (r[1], r[0]))
    for expected, (line, turn, *_rest) in enumerate(rows):
        if turn != expected:
            what = "duplicate" if turn < expected else f"missing turn {expected} before"
            raise WorkloadError(f"{path}:{line}: trajectory {traj_id}: {what} turn {turn}")
    turns = []
    for k, (_line, _turn, prompt, completion, latency) in enumerate(rows):
        new = prompt if k == 0 else prompt - rows[k - 1][2] - rows[k - 1][3]
        counts["clamped"] += new < 0
        counts["zero_output"] += completion < 1
        last = k == len(rows) - 1
        counts["empty_latency"] += latency is None and not last
        turns.append(Turn(max(new, 0), max(completion, 1), 0.0 if last or latency is None else latency))
    return TrajectorySpec(traj_id=traj_id, task=TASK, turns=tuple(turns))


def _notes(path: Path, trajectories: tuple[TrajectorySpec, ...], counts: dict[str, int]) -> tuple[str, ...]:
    n_turns = sum(len(t.turns) for t in trajectories)
    notes = [f"{path.name}: {len(trajectories)} trajectories, {n_turns} turns"]
    if counts["clamped"]:
        notes.append(
            f"{path.name}: {counts['clamped']} negative new-prompt deltas (history truncated) set to 0"
        )
    if counts["zero_output"]:
        notes.append(f"{path.name}: {counts['zero_output']} calls with 0 completion tokens counted as 1")
    if counts["empty_latency"]:
        notes.append(
            f"{path.name}: {counts['empty_latency']} non-final turns without tool latency set to 0 s"
        )
    return tuple(notes)
