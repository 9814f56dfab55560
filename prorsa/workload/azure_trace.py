"""The Azure LLM inference traces (Splitwise, ISCA 2024): single-turn requests with arrival times.

Columns `TIMESTAMP,ContextTokens,GeneratedTokens`; each row becomes a one-turn trajectory whose whole context is new
prompt tokens and whose arrival_s is its timestamp minus the first one (rows are sorted by time if they are not).
A row with 0 generated tokens is counted as 1 (every turn decodes at least one token) and noted.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from prorsa.workload.errors import WorkloadError
from prorsa.workload.trace import (
    AZURE_CODE_FILE,
    AZURE_CONV_FILE,
    Trace,
    csv_rows,
    memoised,
    parse_int,
    shipped_path,
)
from prorsa.workload.types import TrajectorySpec, Turn

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_SHIPPED = {"azure-code": AZURE_CODE_FILE, "azure-conv": AZURE_CONV_FILE}


def load_azure_trace(kind: str = "azure-code", path: str | Path | None = None) -> Trace:
    """The shipped `azure-code` / `azure-conv` trace, or any CSV with the same columns (task = kind).

    Raises WorkloadError for an unknown kind without a path, or (file:line) for a malformed row or an empty file.
    """
    if path is None:
        if kind not in _SHIPPED:
            raise WorkloadError(f"unknown Azure trace {kind!r}; shipped: {', '.join(_SHIPPED)}")
        path = shipped_path(_SHIPPED[kind])
    return memoised(f"azure:{kind}", path, lambda p: _parse(p, kind))


def _parse(path: Path, task: str) -> Trace:
    rows: list[tuple[float, int, int, int]] = []  # (unix seconds, line, context, generated)
    for line, row in csv_rows(path, AZURE_COLUMNS):
        rows.append(
            (
                _timestamp_s(path, line, row["TIMESTAMP"]),
                line,
                parse_int(path, line, "ContextTokens", row["ContextTokens"]),
                parse_int(path, line, "GeneratedTokens", row["GeneratedTokens"]),
            )
        )
    if not rows:
        raise WorkloadError(f"{path}:2: no rows after the header")
    rows.sort()
    start_s = rows[0][0]
    zero_output = sum(generated < 1 for *_, generated in rows)
    trajectories = tuple(
        TrajectorySpec(
            traj_id=f"{task}:{line}",
            task=task,
            turns=(Turn(context, max(generated, 1), 0.0),),
            arrival_s=round(ts_s - start_s, 6),
        )
        for ts_s, line, context, generated in rows
    )
    span_s = trajectories[-1].arrival_s
    notes = [f"{path.name}: {len(trajectories)} single-turn requests over {span_s:.0f} s"]
    if zero_output:
        notes.append(f"{path.name}: {zero_output} requests with 0 generated tokens counted as 1")
    return Trace(path.name, task, trajectories, timed=True, notes=tuple(notes))


def _timestamp_s(path: Path, line: int, text: str) -> float:
    """Seconds since the epoch of `YYYY-MM-DD HH:MM:SS.fffffff` (7 fractional digits: more than datetime keeps)."""
    head, _, frac = text.strip().partition(".")
    try:
        moment = datetime.fromisoformat(head)
        # Naive times are read as UTC so that a local DST change cannot open a gap in the arrivals.
        whole = (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()
        if frac and not frac.isdigit():
            raise ValueError(frac)
    except ValueError:
        raise WorkloadError(f"{path}:{line}: TIMESTAMP is not 'YYYY-MM-DD HH:MM:SS[.f]': {text!r}") from None
    return whole + (float(f"0.{frac}") if frac else 0.0)
