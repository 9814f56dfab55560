"""`prorsa up` as the system tests start it: a child in its own process group whose stdout is read until its
"up:" line, and stopped as a terminal's Ctrl-C stops it (SIGINT to the whole group). One place for the start-up
protocol the tests rely on: the lines `up` prints before it reports its services healthy."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

# What `up` prints before its "up:" line, by the word it starts with: "nats: URL", "openai: URL", "credentials: DIR".
_PRINTED = re.compile(r"(nats|openai|credentials): (\S+)")


@dataclass
class Started:
    """A running `prorsa up`: its process, the lines it printed up to and including "up: ...", and the values of
    the lines `_PRINTED` names (absent where it did not print them); once stopped, the rest of its output."""

    proc: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)
    printed: dict[str, str] = field(default_factory=dict)
    rest: str = ""  # what it printed after the "up:" line, through its stop

    @property
    def output(self) -> str:
        return "".join(self.lines)

    @property
    def summary(self) -> str:
        """The "up: ..." line ("" if it never came)."""
        return self.lines[-1] if self.lines and self.lines[-1].startswith("up:") else ""


@contextmanager
def prorsa_up(
    args: Sequence[str],
    ready_s: float,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    stop_s: float = 60.0,
) -> Iterator[Started]:
    """Start `python -m prorsa up ARGS`, read its output until the "up:" line (at most `ready_s`), yield it, and
    stop it on the way out. The caller asserts on `summary` (a child may stop early: `up` then prints why)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "prorsa", "up", *args],
        cwd=cwd,
        env=dict(env if env is not None else os.environ, PYTHONUNBUFFERED="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, so the test can press "Ctrl-C" on all of it
    )
    started = Started(proc)
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + ready_s
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            started.lines.append(line)
            if m := _PRINTED.match(line):
                started.printed[m.group(1)] = m.group(2)
            if line.startswith("up:"):
                break
        yield started
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        started.rest, _ = proc.communicate(timeout=stop_s)
