"""`prorsa.bench.service_cpu`: per-service CPU of a live rollout, read from /proc, and the forecaster's phases."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from prorsa.bench.service_cpu import main, read_children, service_of


def test_a_service_is_named_by_its_module() -> None:
    assert service_of(["/x/python", "-m", "services.forecaster", "--nats", "u"]) == "forecaster"
    assert service_of(["/usr/bin/nats-server", "-c", "f"]) == "nats-server"
    assert service_of([]) == "?"


def test_children_are_found_with_their_cpu() -> None:
    busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.2: pass\ntime.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", busy])
    try:
        deadline = time.monotonic() + 10.0
        while True:
            found = read_children(os.getpid()).get(child.pid)
            if found is not None and found.cpu_s >= 0.15 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert found is not None and found.cpu_s >= 0.15
    finally:
        child.kill()
        child.wait()


def test_a_small_live_run_reports_every_service(tmp_path: Path) -> None:
    out = tmp_path / "cpu.json"
    args = [
        "--engines",
        "2",
        "--batch-size",
        "4",
        "--steps",
        "1",
        "--policies",
        "colocated",
        "--json",
        str(out),
    ]
    assert main(args) == 0
    (run,) = json.loads(out.read_text())["runs"]
    assert {"forecaster", "allocator", "trajectory_tracker", "engine_agent", "nats-server"} <= set(
        run["services"]
    )
    assert run["services"]["engine_agent"]["processes"] == 2
    assert run["wall_s"] > 0 and run["forecasts"] > 0
    assert run["forecaster_cpu_s_by_phase"].get("snapshot", 0.0) > 0.0
