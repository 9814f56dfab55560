"""No Docker engine runs here: check the compose file's shape instead (services, commands, NATS cluster routes)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def load() -> dict:
    return yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())


def test_three_node_nats_cluster_with_jetstream() -> None:
    compose = load()
    nats_nodes = [n for n in compose["services"] if n.startswith("nats-")]
    assert nats_nodes == ["nats-1", "nats-2", "nats-3"]
    conf = (ROOT / "docker" / "nats-cluster.conf").read_text()
    assert "jetstream" in conf
    for node in nats_nodes:
        assert f"nats-route://{node}:6222" in conf
        assert "--name" in compose["services"][node]["command"]


def test_every_service_runs_its_module_and_knows_every_nats_node() -> None:
    services = load()["services"]
    for name in ("trajectory_tracker", "forecaster", "allocator", "engine_agent"):
        svc = services[name]
        module = svc["command"][0]
        assert module == f"services.{name}"
        assert (ROOT / module.replace(".", "/")).is_dir(), module
        url = svc["environment"]["PRORSA_NATS_URL"]
        assert all(f"nats://nats-{i}:4222" in url for i in (1, 2, 3))
        assert svc["build"]["dockerfile"] == "docker/Dockerfile"


def test_engine_agent_is_scalable() -> None:
    engine = load()["services"]["engine_agent"]
    # A fixed container_name or host port would make `--scale engine_agent=N` fail.
    assert "container_name" not in engine and "ports" not in engine
    assert "--engine-id" not in engine["command"]


def test_dockerfile_installs_the_project_and_runs_modules() -> None:
    text = (ROOT / "docker" / "Dockerfile").read_text()
    assert 'pip install ".' in text and 'ENTRYPOINT ["python", "-m"]' in text
    assert importlib.util.find_spec("services.runtime.main") is not None
