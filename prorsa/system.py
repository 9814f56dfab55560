"""Run the whole system as one process tree: a nats-server (embedded unless a URL is given), every service that
exists, and N engine agents, each as its own `python -m services.<name>` child, as a user would run them alone.

Used by `prorsa up`, `prorsa demo` and the end-to-end tests. Stopping sends SIGTERM to every child (each stops
gracefully, draining its connection), then stops the embedded server.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from services.runtime.nats_server import EmbeddedNatsServer

# Order matters only for start-up logs: the pipeline runs tracker → forecaster → allocator.
CONTROL_SERVICES = ("trajectory_tracker", "forecaster", "allocator")


def service_exists(name: str) -> bool:
    return importlib.util.find_spec(f"services.{name}.__main__") is not None


@dataclass
class SystemConfig:
    nats_url: str | None = None
    namespace: str = "prorsa"
    engines: int = 0
    backend: str = "sim"
    model: str | None = None
    extra_engine_args: list[str] = field(default_factory=list)
    engine_roles: list[str] = field(default_factory=list)  # start-up role per engine (default: mixed)
    extra_service_args: dict[str, list[str]] = field(default_factory=dict)
    log_dir: str | None = None


class System:
    def __init__(self, config: SystemConfig) -> None:
        self.config = config
        self.embedded: EmbeddedNatsServer | None = None
        self.children: dict[str, subprocess.Popen[bytes]] = {}
        self.url = config.nats_url or ""

    def start(self) -> System:
        if not self.url:
            self.embedded = EmbeddedNatsServer().start()
            self.url = self.embedded.url
        for name in CONTROL_SERVICES:
            if service_exists(name):
                self._spawn(name, name, self.config.extra_service_args.get(name, []))
        if self.config.engines and service_exists("engine_agent"):
            for i in range(self.config.engines):
                args = [
                    "--engine-id",
                    f"engine-{i}",
                    "--backend",
                    self.config.backend,
                    *self.config.extra_engine_args,
                ]
                if self.config.model:
                    args += ["--model", self.config.model]
                if i < len(self.config.engine_roles):
                    args += ["--role", self.config.engine_roles[i]]
                self._spawn(f"engine-{i}", "engine_agent", args)
        return self

    def expected_services(self) -> list[str]:
        names = [n for n in CONTROL_SERVICES if service_exists(n)]
        if self.config.engines and service_exists("engine_agent"):
            names += ["engine_agent"] * self.config.engines
        return names

    def _spawn(self, key: str, module: str, args: list[str]) -> None:
        cmd = [
            sys.executable,
            "-m",
            f"services.{module}",
            "--nats",
            self.url,
            "--namespace",
            self.config.namespace,
            *args,
        ]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if self.config.log_dir:
            os.makedirs(self.config.log_dir, exist_ok=True)
            out = open(os.path.join(self.config.log_dir, f"{key}.log"), "ab")  # noqa: SIM115 - owned by Popen
        else:
            out = subprocess.DEVNULL
        self.children[key] = subprocess.Popen(cmd, stdout=out, stderr=out, env=env)

    def dead_children(self) -> dict[str, int]:
        return {k: p.returncode for k, p in self.children.items() if p.poll() is not None}

    def stop(self, timeout_s: float = 15.0) -> None:
        for p in self.children.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for p in self.children.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.children.clear()
        if self.embedded is not None:
            self.embedded.stop(remove_store=True)
            self.embedded = None
