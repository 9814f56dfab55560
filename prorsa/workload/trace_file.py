"""`trace:PATH`: load any file shaped like one of the shipped traces, recognised by extension and header.

* `*.jsonl` / `*.json` (optionally `.gz`) → Mooncake format (task "conversation").
* `*.csv` (optionally `.gz`) whose header holds the SWE columns → SWE format (task "coding").
* `*.csv` whose header holds `TIMESTAMP,ContextTokens,GeneratedTokens` → Azure format (task "azure-code" or
  "azure-conv" when the file name says "code" or "conv", else "azure").
"""

from __future__ import annotations

import csv
from pathlib import Path

from prorsa.workload.azure_trace import AZURE_COLUMNS, load_azure_trace
from prorsa.workload.errors import WorkloadError
from prorsa.workload.mooncake_trace import load_mooncake_trace
from prorsa.workload.swe_trace import SWE_COLUMNS, load_swe_trace
from prorsa.workload.trace import Trace, open_text


def load_trace_file(path: str | Path) -> Trace:
    """Parse a trace file of any supported format (memoised per path).

    Raises WorkloadError if the file is missing, its format is not recognised, or a row is malformed (file:line).
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise WorkloadError(f"{path}: no such trace file")
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] == ".gz":
        suffixes.pop()
    ext = suffixes[-1] if suffixes else ""
    if ext in (".jsonl", ".json"):
        return load_mooncake_trace(path)
    if ext == ".csv":
        header = _csv_header(path)
        if all(c in header for c in SWE_COLUMNS):
            return load_swe_trace(path)
        if all(c in header for c in AZURE_COLUMNS):
            return load_azure_trace(_azure_task(path), path)
        raise WorkloadError(
            f"{path}:1: CSV header {header} matches neither the SWE trace ({', '.join(SWE_COLUMNS)}) "
            f"nor the Azure trace ({', '.join(AZURE_COLUMNS)})"
        )
    raise WorkloadError(
        f"{path}: unknown trace format {ext or '(no extension)'!r}; expected .csv, .jsonl or .json"
    )


def _csv_header(path: Path) -> list[str]:
    with open_text(path) as handle:
        try:
            return next(csv.reader(handle), [])
        except (UnicodeDecodeError, csv.Error, EOFError, OSError) as exc:
            raise WorkloadError(f"{path}:1: unreadable header: {exc}") from exc


def _azure_task(path: Path) -> str:
    name = path.name.lower()
    if "code" in name:
        return "azure-code"
    if "conv" in name:
        return "azure-conv"
    return "azure"
