"""`prorsa up` starts embedded NATS and every service; `prorsa status` sees each of them healthy."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prorsa.system import CONTROL_SERVICES, service_exists

pytestmark = pytest.mark.timeout(120)


def test_up_then_status_sees_every_service(tmp_path) -> None:
    engines = 2 if service_exists("engine_agent") else 0
    expected = [s for s in CONTROL_SERVICES if service_exists(s)] + ["engine_agent"] * engines
    assert expected, "no service exists yet"
    proc = subprocess.Popen(
        [sys.executable, "-m", "prorsa", "up", "--engines", str(engines), "--log-dir", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        start_new_session=True,  # its own process group, so the test can press "Ctrl-C" on all of it
    )
    try:
        url, secrets, lines = None, None, []
        deadline = time.monotonic() + 90
        assert proc.stdout is not None
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if m := re.match(r"nats: (\S+)", line):
                url = m.group(1)
            if m := re.match(r"credentials: (\S+)", line):
                secrets = m.group(1)
            if line.startswith("up:"):
                break
        assert url and secrets, "".join(lines)
        assert f"up: {len(expected)}/{len(expected)} services healthy" in lines[-1], "".join(lines)
        # The path is printed, never a secret: the seeds stay in the private directory.
        seeds = {p.read_text().strip() for p in Path(secrets).glob("*.nk")}
        assert seeds and not any(seed in "".join(lines) for seed in seeds)
        assert Path(secrets).stat().st_mode & 0o077 == 0
        anonymous = subprocess.run(
            [sys.executable, "-m", "prorsa", "status", "--nats", url],
            capture_output=True,
            text=True,
            timeout=30,
            env={k: v for k, v in os.environ.items() if not k.startswith("PRORSA_NATS_")},
        )
        assert anonymous.returncode == 1 and "Authorization Violation" in anonymous.stdout, anonymous.stdout
        operator = [f"--nkey={secrets}/operator.nk", "--inbox-prefix=_INBOX.operator"]
        out = subprocess.run(
            [sys.executable, "-m", "prorsa", "status", "--nats", url, *operator],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode == 0, out.stdout + out.stderr
        rows = [ln.split()[0] for ln in out.stdout.splitlines()[1:]]
        assert sorted(rows) == sorted(expected)
        assert all(" ok " in ln for ln in out.stdout.splitlines()[1:])
    finally:
        # As a terminal's Ctrl-C does: SIGINT to every process of the group (the children too).
        os.killpg(proc.pid, signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, rest
    assert "up: stopped" in rest
    assert not Path(secrets).exists()  # its temporary credentials go with it


def test_status_without_a_server_says_so() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "prorsa", "status", "--nats", "nats://127.0.0.1:1"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 1 and "cannot reach NATS" in out.stdout


def test_up_with_vllm_needs_a_model() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "prorsa", "up", "--backend", "vllm", "--engines", "2"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2 and "needs --model" in out.stdout
