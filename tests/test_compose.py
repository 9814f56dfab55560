"""No Docker engine runs here: check the compose file's shape instead (services, commands, NATS cluster routes,
credentials), and run its NATS cluster config on three local nats-servers."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import subprocess
import time
import urllib.request
from pathlib import Path

import nats
import pytest
import yaml
from nats.errors import NoServersError

from prorsa.commands.secrets import COMPOSE_ROUTES
from services.runtime.bus import connect
from services.runtime.bus_secrets import generate
from services.runtime.nats_server import find_nats_server, free_port

ROOT = Path(__file__).resolve().parents[1]


def load() -> dict:
    return yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())


def test_three_node_nats_cluster_with_jetstream() -> None:
    compose = load()
    nats_nodes = [n for n in compose["services"] if n.startswith("nats-")]
    assert nats_nodes == ["nats-1", "nats-2", "nats-3"]
    conf = (ROOT / "docker" / "nats-cluster.conf").read_text()
    assert "jetstream" in conf
    # The routes carry the route password, so `prorsa secrets` writes them (to every node by default).
    assert "include ./cluster-auth.conf" in conf
    assert tuple(f"{node}:6222" for node in nats_nodes) == COMPOSE_ROUTES
    for node in nats_nodes:
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


# --- credentials (issue 14) -------------------------------------------------------------------------------------

ROLES = {
    "trajectory_tracker": "tracker",
    "forecaster": "forecaster",
    "allocator": "allocator",
    "engine_agent": "engine",
}


def test_every_service_connects_with_its_own_roles_nkey() -> None:
    compose = load()
    files = {name: spec["file"] for name, spec in compose["secrets"].items()}
    for service, role in ROLES.items():
        svc = compose["services"][service]
        (secret,) = svc["secrets"]
        assert files[secret["source"]] == f"./secrets/{role}.nk", service
        assert svc["environment"]["PRORSA_NATS_NKEY"] == f"/run/secrets/{secret['target']}"
        assert svc["environment"]["PRORSA_NATS_INBOX_PREFIX"] == f"_INBOX.{role}"
    # No service holds another's key, and the trainer's and operator's stay on the host.
    assert sorted(files.values()) == sorted(
        [f"./secrets/{r}.nk" for r in ROLES.values()] + ["./secrets/auth.conf", "./secrets/cluster-auth.conf"]
    )


def test_nats_nodes_load_the_generated_users_and_route_credentials() -> None:
    compose = load()
    conf = (ROOT / "docker" / "nats-cluster.conf").read_text()
    assert "include ./auth.conf" in conf and "include ./cluster-auth.conf" in conf
    for node in ("nats-1", "nats-2", "nats-3"):
        svc = compose["services"][node]
        targets = {s["source"]: s["target"] for s in svc["secrets"]}
        assert targets == {
            "nats_auth": "/etc/nats/auth.conf",
            "nats_cluster_auth": "/etc/nats/cluster-auth.conf",
        }
        assert "--cluster" not in svc["command"]  # it would replace the cluster block and its route password


def _node_config(tmp: Path, i: int, ports: dict[str, list[int]]) -> Path:
    """docker/nats-cluster.conf as node i would load it, on loopback ports and a local store."""
    text = (ROOT / "docker" / "nats-cluster.conf").read_text()
    text = text.replace("port: 4222", f"port: {ports['client'][i - 1]}")
    text = text.replace("port: 6222", f"port: {ports['route'][i - 1]}")
    text = text.replace("http: 8222", f"http: {ports['http'][i - 1]}")
    text = text.replace("/data/jetstream", str(tmp / f"js-{i}"))
    path = tmp / f"node-{i}.conf"  # beside auth.conf and cluster-auth.conf, as compose mounts them
    path.write_text(text)
    return path


def _routes(http_port: int) -> set[str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/routez", timeout=2) as r:
        return {route.get("remote_name", "") for route in json.load(r)["routes"]}


@pytest.mark.timeout(120)
async def test_the_cluster_config_runs_three_authenticated_nodes(tmp_path) -> None:
    """The compose layout on three local nats-servers: users and permissions hold on every node, the nodes route to
    each other with the generated password, and a node without it cannot join."""
    ports = {k: [free_port() for _ in range(4)] for k in ("client", "route", "http")}
    secrets = generate(tmp_path, routes=tuple(f"127.0.0.1:{p}" for p in ports["route"][:3]))
    procs = []
    try:
        for i in (1, 2, 3):
            conf = _node_config(tmp_path, i, ports)
            cmd = [find_nats_server(), "-c", str(conf), "--name", f"nats-{i}", "--cluster_name", "prorsa"]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        rogue = [
            find_nats_server(), "-p", str(ports["client"][3]), "--name", "rogue", "--cluster_name", "prorsa",
            "--cluster", f"nats://127.0.0.1:{ports['route'][3]}", "--routes", f"nats-route://127.0.0.1:{ports['route'][0]}",
            "-m", str(ports["http"][3]),
        ]  # fmt: skip
        procs.append(subprocess.Popen(rogue, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if all(
                    _routes(ports["http"][i]) >= {f"nats-{j}" for j in (1, 2, 3) if j != i + 1}
                    for i in range(3)
                ):
                    break
            except OSError:
                pass
            await asyncio.sleep(0.2)
        else:
            raise AssertionError("the three nodes did not route to each other")
        await asyncio.sleep(1.0)  # the rogue has tried by now
        assert all("rogue" not in _routes(ports["http"][i]) for i in range(3))
        assert _routes(ports["http"][3]) == set()  # it is up, and alone
        urls = [f"nats://127.0.0.1:{p}" for p in ports["client"][:3]]
        for url in urls:
            with pytest.raises((NoServersError, nats.errors.Error)):
                await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2)
        allocator = await connect(urls[2], "allocator", credentials=secrets.credentials("allocator"))
        got: list[bytes] = []

        async def on_lifecycle(msg) -> None:  # noqa: ANN001
            got.append(msg.data)

        await allocator.subscribe("prorsa.lifecycle", cb=on_lifecycle)
        await allocator.flush()
        denied: list[str] = []

        async def on_error(exc: Exception) -> None:
            denied.append(str(exc))

        trainer = await connect(
            urls[0], "trainer", credentials=secrets.credentials("trainer"), error_cb=on_error
        )
        await trainer.publish("prorsa.lifecycle", b"across the cluster")
        await trainer.publish("prorsa.cmd.engine-0", b"refused on any node")
        await trainer.flush()
        deadline = time.monotonic() + 10
        while not (got and denied) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert got == [b"across the cluster"]
        assert any("prorsa.cmd.engine-0" in d for d in denied)
        await trainer.close()
        await allocator.close()
    finally:
        for p in procs:
            p.terminate()
            p.wait(timeout=10)


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


def test_gpu_engines_each_get_their_own_devices_and_layout() -> None:
    from services.engine_agent.engine_args import load_engine_args, parallel_sizes

    gpu = yaml.safe_load((ROOT / "docker" / "compose.gpu.yaml").read_text())
    engines = {name: svc for name, svc in gpu["services"].items() if name.startswith("engine-gpu-")}
    assert len(engines) >= 2
    devices: list[str] = []
    ids = set()
    for svc in engines.values():
        command = svc["command"]
        assert command[0] == "services.engine_agent" and command[command.index("--backend") + 1] == "vllm"
        ids.add(command[command.index("--engine-id") + 1])
        (request,) = svc["deploy"]["resources"]["reservations"]["devices"]
        devices += request["device_ids"]
        assert svc["network_mode"] == "host"  # NIXL side channels reachable from other nodes
        args_file = command[command.index("--engine-args-file") + 1].replace(
            "/etc/prorsa/engine-args", "engine-args"
        )
        tp, pp, dp = parallel_sizes(load_engine_args(str(ROOT / "docker" / args_file), []))
        assert tp * pp * dp == len(request["device_ids"])  # the layout uses exactly its devices
    assert len(ids) == len(engines) and len(set(devices)) == len(devices)  # nothing shared
