"""Issue 14, finding 2: `prorsa up` restarts a child that dies (same engine id, backoff, crash loops reported) and
never stops the cluster because one child died."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from prorsa.health import gather_health
from prorsa.supervisor import Supervisor

pytestmark = pytest.mark.timeout(150)


def test_backoff_doubles_resets_after_a_stable_run_and_reports_crash_loops() -> None:
    sup = Supervisor(
        base_backoff_s=0.5, max_backoff_s=8.0, stable_after_s=30.0, loop_window_s=60.0, loop_exits=4
    )
    sup.started("engine-1", 0.0)
    sup.started("tracker", 0.0)
    now, delays = 100.0, []
    for _ in range(5):  # dies at once after each restart
        ev = sup.exited("engine-1", -9, now)
        delays.append((ev.delay_s, ev.crash_loop))
        assert sup.due(now) == [] and sup.due(now + ev.delay_s) == ["engine-1"]
        now += ev.delay_s
        sup.started("engine-1", now)
        now += 0.1
    assert delays == [(0.5, False), (1.0, False), (2.0, False), (8.0, True), (8.0, True)]
    assert sup.crash_looping(now) == ["engine-1"] and sup.restarts() == {"engine-1": 5}
    # The other child is untouched; a stable run clears the loop and the backoff.
    assert "tracker" not in sup.due(now) and sup.restarts().get("tracker") is None
    assert sup.crash_looping(now + 31.0) == []
    ev = sup.exited("engine-1", 1, now + 200.0)
    assert (ev.delay_s, ev.crash_loop) == (0.5, False)


def _reader(proc: subprocess.Popen[str], lines: list[str]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)


def _wait_line(lines: list[str], pattern: str, timeout_s: float) -> re.Match[str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in list(lines):
            if m := re.search(pattern, line):
                return m
        time.sleep(0.1)
    raise AssertionError(f"no line matching {pattern!r} in:\n{''.join(lines)}")


def _pids(namespace: str) -> dict[str, int]:
    """pid of each child of `prorsa up` in `namespace`, keyed by its --engine-id or its service module."""
    out = subprocess.run(["ps", "-eww", "-o", "pid,args"], capture_output=True, text=True).stdout
    pids = {}
    for line in out.splitlines():
        if f"--namespace {namespace}" not in line:
            continue
        pid, args = line.strip().split(" ", 1)
        if (m := re.search(r"--engine-id (\S+)", args)) or (m := re.search(r"-m services\.(\w+)", args)):
            pids[m.group(1)] = int(pid)
    return pids


def test_up_restarts_dead_children_and_keeps_the_cluster(tmp_path) -> None:
    ns = f"sup{os.getpid()}"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "prorsa",
            "up",
            "--engines",
            "2",
            "--namespace",
            ns,
            "--log-dir",
            str(tmp_path),
            "--no-auth",  # supervision, not credentials (tests/test_bus_security*.py)
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        start_new_session=True,
    )
    lines: list[str] = []
    threading.Thread(target=_reader, args=(proc, lines), daemon=True).start()
    try:
        url = _wait_line(lines, r"nats: (\S+)", 30).group(1)
        _wait_line(lines, r"up: 5/5 services healthy", 90)
        mine = _pids(ns)
        for key in ("trajectory_tracker", "allocator", "forecaster", "engine-1"):
            os.kill(mine[key], signal.SIGKILL)
        for key in ("trajectory_tracker", "allocator", "forecaster", "engine-1"):
            _wait_line(lines, rf"up: {key} restarted", 30)
        assert proc.poll() is None, "".join(lines)

        async def all_ok() -> list:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                replies = await gather_health(url, ns, wait_s=0.5)
                if sorted((r.service, r.status) for r in replies) == sorted(
                    [("allocator", "ok"), ("forecaster", "ok"), ("trajectory_tracker", "ok")]
                    + [("engine_agent", "ok")] * 2
                ):
                    return replies
            raise AssertionError(f"not every service is healthy again: {replies}")

        replies = asyncio.run(all_ok())
        engines = sorted(r.details["engine_id"] for r in replies if r.service == "engine_agent")
        assert engines == ["engine-0", "engine-1"]  # the restarted engine has its old id
        assert proc.poll() is None
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
    out = "".join(lines)
    assert proc.returncode == 0, out
    assert "children exited" not in out and "up: stopped" in out
    assert re.search(r"up: restarts \{.*'engine-1': 1", out), out
