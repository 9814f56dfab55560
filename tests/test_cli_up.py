"""`prorsa up` starts embedded NATS and every service; `prorsa status` sees each of them healthy."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from prorsa.system import CONTROL_SERVICES, service_exists
from tests.up_support import prorsa_up

pytestmark = pytest.mark.timeout(120)


def test_up_then_status_sees_every_service(tmp_path) -> None:
    engines = 2 if service_exists("engine_agent") else 0
    expected = [s for s in CONTROL_SERVICES if service_exists(s)] + ["engine_agent"] * engines
    assert expected, "no service exists yet"
    with prorsa_up(["--engines", str(engines), "--log-dir", str(tmp_path)], ready_s=90) as up:
        url, secrets = up.printed.get("nats"), up.printed.get("credentials")
        assert url and secrets, up.output
        assert f"up: {len(expected)}/{len(expected)} services healthy" in up.summary, up.output
        # The path is printed, never a secret: the seeds stay in the private directory.
        seeds = {p.read_text().strip() for p in Path(secrets).glob("*.nk")}
        assert seeds and not any(seed in up.output for seed in seeds)
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
    # Stopped as a terminal's Ctrl-C stops it: SIGINT to every process of the group (the children too).
    assert up.proc.returncode == 0, up.rest
    assert "up: stopped" in up.rest
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
