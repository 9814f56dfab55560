"""No Docker engine runs here: check the compose file's shape instead (services, commands, NATS cluster routes)."""

from __future__ import annotations

import importlib.util
import json
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


SERVICES = ("trajectory_tracker", "forecaster", "allocator", "engine_agent")


def test_prometheus_scrapes_every_service_on_its_metrics_port() -> None:
    compose = load()
    services = compose["services"]
    prom = services["prometheus"]
    mount = next(v for v in prom["volumes"] if v.endswith(":/etc/prometheus/prometheus.yml:ro"))
    config = yaml.safe_load((ROOT / "docker" / mount.split(":")[0]).read_text())
    targets = {}
    for job in config["scrape_configs"]:
        (sd,) = job["dns_sd_configs"]  # the compose service name resolves to every replica (scaling works)
        targets[job["job_name"]] = (sd["names"], sd["port"])
    for name in SERVICES:
        env = services[name]["environment"]
        assert env["PRORSA_METRICS_ADDR"] == "0.0.0.0"  # reachable from the Prometheus container
        assert targets[name] == ([name], int(env["PRORSA_METRICS_PORT"]))
    assert set(targets) == set(SERVICES)
    assert set(prom["depends_on"]) == set(SERVICES)


def test_grafana_is_provisioned_with_the_dashboard_and_its_datasource() -> None:
    grafana = load()["services"]["grafana"]
    mounts = dict(v.strip('"').split(":")[:2] for v in grafana["volumes"])
    provisioning = ROOT / "docker" / next(k for k, v in mounts.items() if v == "/etc/grafana/provisioning")
    dashboards = ROOT / "docker" / next(k for k, v in mounts.items() if v == "/var/lib/grafana/dashboards")
    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "prorsa.yaml").read_text())["providers"]
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"
    board = json.loads((dashboards / "prorsa.json").read_text())
    for panel in board["panels"]:
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == source["uid"] and target["expr"]
