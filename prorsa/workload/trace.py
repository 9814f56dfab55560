"""A parsed trace, where the shipped traces live, and the plumbing every loader shares.

Loaders return a `Trace`: the file's trajectories plus notes about what parsing had to adjust. Parsed traces are
memoised per (format, path) so that building a workload a second time costs nothing; the trajectories are frozen
values, so sharing them is safe.
"""

from __future__ import annotations

import csv
import gzip
import io
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import IO

from prorsa.workload.errors import WorkloadError
from prorsa.workload.types import TrajectorySpec

# File names inside the `prorsa/data` folder shipped with the package (see its README.md for sources and licences).
SWE_FILE = "swe_agent_turns.csv.gz"
MOONCAKE_FILE = "mooncake_conversation_trace.jsonl.gz"
AZURE_CODE_FILE = "azure_llm_2023_code.csv.gz"
AZURE_CONV_FILE = "azure_llm_2023_conv.csv.gz"


@dataclass(frozen=True, slots=True)
class Trace:
    """The trajectories of one trace file."""

    name: str  # file name, for notes and errors
    task: str  # task label of every trajectory
    trajectories: tuple[TrajectorySpec, ...]  # in arrival order when `timed`
    timed: bool  # True when arrival_s (seconds from the trace start) is meaningful
    notes: tuple[str, ...] = ()  # what parsing adjusted, e.g. negative deltas clamped to 0


_MEMO: dict[tuple[str, str], Trace] = {}


def shipped_path(file_name: str) -> Path:
    """Path of a trace shipped in `prorsa/data` (the package is installed from a directory, not a zip)."""
    return Path(str(resources.files("prorsa").joinpath("data", file_name)))


def memoised(kind: str, path: str | Path, parse: Callable[[Path], Trace]) -> Trace:
    """Parse `path` with `parse` once per process; later calls return the same Trace."""
    resolved = Path(path).expanduser().resolve()
    key = (kind, str(resolved))
    trace = _MEMO.get(key)
    if trace is None:
        trace = parse(resolved)
        _MEMO[key] = trace
    return trace


def open_text(path: Path) -> IO[str]:
    """Open a trace as text, transparently gunzipping `*.gz`; a missing file is a WorkloadError."""
    try:
        if path.suffix == ".gz":
            return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8", newline="")
        return open(path, encoding="utf-8", newline="")
    except OSError as exc:
        raise WorkloadError(f"{path}: cannot open trace file: {exc.strerror or exc}") from exc


def csv_rows(path: Path, required: tuple[str, ...]) -> Iterator[tuple[int, dict[str, str]]]:
    """Yield (line number, row) of a CSV file whose header holds at least `required` columns.

    Raises WorkloadError naming the file and line for a missing header column, a row with too few or too many
    fields, or undecodable bytes.
    """
    with open_text(path) as handle:
        reader = csv.DictReader(handle)
        try:
            header = reader.fieldnames or []
            missing = [c for c in required if c not in header]
            if missing:
                raise WorkloadError(f"{path}:1: header lacks column(s) {', '.join(missing)} (has {header})")
            for row in reader:
                if None in row or None in row.values():
                    raise WorkloadError(
                        f"{path}:{reader.line_num}: row has a different number of fields than the header "
                        f"({len(header)})"
                    )
                yield reader.line_num, row
        except (UnicodeDecodeError, csv.Error, EOFError, gzip.BadGzipFile) as exc:
            raise WorkloadError(f"{path}:{reader.line_num}: unreadable: {exc}") from exc


def parse_int(path: Path, line: int, name: str, text: object, minimum: int = 0) -> int:
    """An integer field ≥ minimum, or a WorkloadError naming file, line and field."""
    try:
        value = int(text)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        raise WorkloadError(f"{path}:{line}: {name} is not an integer: {text!r}") from None
    if isinstance(text, float | bool) or value < minimum:
        raise WorkloadError(f"{path}:{line}: {name} must be an integer ≥ {minimum}, got {text!r}")
    return value


def parse_float(path: Path, line: int, name: str, text: str, minimum: float = 0.0) -> float:
    """A finite float field ≥ minimum, or a WorkloadError naming file, line and field."""
    try:
        value = float(text)
    except ValueError:
        raise WorkloadError(f"{path}:{line}: {name} is not a number: {text!r}") from None
    if not math.isfinite(value) or value < minimum:
        raise WorkloadError(f"{path}:{line}: {name} must be a finite number ≥ {minimum}, got {text!r}")
    return value
