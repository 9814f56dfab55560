"""The console the commands print their tables on."""

from __future__ import annotations

import sys
from typing import Any

# Piped into a file or a CI log, rich falls back to 80 columns and folds every label and policy name of a
# comparison table over several lines; 150 holds a demo's seven columns (three live runs, three simulated).
PIPED_WIDTH = 150


def table_console() -> Any:
    """A rich Console on stdout, as wide as the terminal, or `PIPED_WIDTH` when stdout is not one."""
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else PIPED_WIDTH)
