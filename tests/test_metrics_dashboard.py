"""Every series the Grafana dashboard (docker/grafana/dashboards/prorsa.json) queries exists on a live service's
/metrics: the four services on a real nats-server, each serving its registry over HTTP, while a trajectory runs."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from prorsa.client import RolloutClient
from prorsa.rollout.live_driver import RolloutConfig, RolloutDriver
from prorsa.sim.fixed_workload import FixedWorkload
from prorsa.workload.types import TrajectorySpec, Turn
from services.allocator.service import AllocatorService
from services.forecaster.service import ForecasterService
from services.trajectory_tracker.service import TrackerService
from tests.engine_agent_support import make_agent

pytestmark = pytest.mark.timeout(120)

DASHBOARD = Path(__file__).resolve().parents[1] / "docker" / "grafana" / "dashboards" / "prorsa.json"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[str, list[tuple[dict[str, str], float]]]:
    """sample name → [(labels, value)] from http://127.0.0.1:port/metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def dashboard_series() -> set[str]:
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
    return {name for e in exprs for name in re.findall(r"\bprorsa_[a-z0-9_]+", e)}


def value(samples: dict, name: str, **labels: str) -> float:
    return sum(v for lab, v in samples.get(name, []) if all(lab.get(k) == x for k, x in labels.items()))


async def test_every_dashboard_series_is_exported(nats_server, monkeypatch) -> None:
    monkeypatch.setenv("PRORSA_TIME_SCALE", "20")
    url = nats_server.url
    ports = {name: free_port() for name in ("trajectory_tracker", "forecaster", "allocator", "engine_agent")}
    agent = make_agent(url, "e0", "mixed", speedup=None)
    agent.metrics_port = ports["engine_agent"]
    services = [
        TrackerService(url, metrics_port=ports["trajectory_tracker"]),
        ForecasterService(url, metrics_port=ports["forecaster"]),
        AllocatorService(url, metrics_port=ports["allocator"], policy="prorsa", interval_s=5.0),
        agent,
    ]
    for s in services:
        await s.start()
    client = await RolloutClient.connect(url)
    try:
        spec = TrajectorySpec("t0", "coding", (Turn(2000, 60, 1.0), Turn(300, 60, 0.0)))
        await RolloutDriver(client, RolloutConfig(steps=1, training_s=0.0)).run(
            [FixedWorkload([spec]).step(0)]
        )
        for _ in range(100):  # the tracker's next snapshot counts the trajectory as finished
            if value(
                scrape(ports["trajectory_tracker"]), "prorsa_trajectories_ended_total", status="finished"
            ):
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)  # one more allocator decision and forecast
        scraped = {name: scrape(port) for name, port in ports.items()}
    finally:
        await client.close()
        for s in reversed(services):
            await s.stop()
    exported = {name for samples in scraped.values() for name in samples}
    missing = dashboard_series() - exported
    assert not missing, f"the dashboard queries series no service exports: {sorted(missing)}"
    # And they carry what happened: one trajectory of two turns through one mixed engine.
    tracker, engine = scraped["trajectory_tracker"], scraped["engine_agent"]
    assert value(tracker, "prorsa_trajectories_ended_total", status="finished") == 1
    assert value(tracker, "prorsa_trajectories", phase="decode") == 0
    assert value(engine, "prorsa_engine_role", engine="e0", role="mixed") == 1
    assert value(engine, "prorsa_ttft_seconds_count") == 2 and value(engine, "prorsa_tpot_seconds_count") == 2
    assert value(engine, "prorsa_engine_decode_tokens_total") == 120
    assert value(scraped["forecaster"], "prorsa_demand_tokens_total", role="decode") > 0
    assert value(scraped["allocator"], "prorsa_allocator_decisions_total") >= 1
    assert ("prorsa_plan_engines", "mixed") in {
        (n, lab.get("role")) for n, rows in scraped["allocator"].items() for lab, _ in rows
    }
    # Conventions: the prefix, counters ending in _total, every series labelled with its service.
    for service, samples in scraped.items():
        for name, rows in samples.items():
            assert name.startswith("prorsa_"), name
            assert all(lab["service"] == service for lab, _ in rows), name


def test_the_metrics_port_is_freed_when_a_service_stops() -> None:
    """`ServiceMetrics.close` ends the HTTP server: nothing answers there, and the next instance can serve on the
    same port (in-process services, as in the test above, come and go in one test session)."""
    import urllib.error

    from services.runtime.metrics import ServiceMetrics

    port = free_port()
    first = ServiceMetrics("trajectory_tracker", "t-1")
    first.serve(port)
    assert "t-1" in urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    first.close()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)
    second = ServiceMetrics("trajectory_tracker", "t-2")
    second.serve(port)
    try:
        assert "t-2" in urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        second.close()
