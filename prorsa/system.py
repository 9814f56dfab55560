"""Run the whole system as one process tree: a nats-server (embedded unless a URL is given), every service that
exists, and N engine agents, each as its own `python -m services.<name>` child, as a user would run them alone.

Used by `prorsa up`, `prorsa demo`, `prorsa rollout`, the fault campaign and the end-to-end tests. Stopping sends
SIGTERM to every child (each stops gracefully, draining its connection), then stops the embedded server.

Supervision. `supervise()` (called every few hundred milliseconds by whoever runs the system) restarts a child that
died, with the same arguments (an engine keeps its id), after the delay `prorsa.supervisor.Supervisor` decides
(exponential backoff, crash loops reported); an embedded nats-server that died is started again on the same port
and store, so JetStream's streams and consumers survive it. One child's death never stops the others.

Security: an embedded server gets credentials by default (`auth`): a private directory of nkeys and permissions
(`services.runtime.bus_secrets`: a fresh temporary one removed on stop, or `secrets_dir`), loaded by the server,
and every child starts with its own role's credentials in its environment (each engine its own, scoped to its
id). `credentials(user)` gives the in-process callers theirs (`operator` for health, `trainer` for the client).
With a server URL given, children inherit this process's PRORSA_NATS_* credentials.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from prorsa.supervisor import Exit, Supervisor
from services.runtime.auth import SERVICE_ROLES
from services.runtime.bus_secrets import BusSecrets, TlsFiles, generate, load
from services.runtime.credentials import ENV as CREDENTIAL_ENV
from services.runtime.credentials import BusCredentials
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
    # CUDA_VISIBLE_DEVICES per engine ("" or missing: inherited), from `prorsa.engine_layout.device_groups`
    engine_devices: list[str] = field(default_factory=list)
    extra_service_args: dict[str, list[str]] = field(default_factory=dict)
    log_dir: str | None = None
    auth: bool = True  # embedded server: credentials and permissions for every role (see the module doc)
    secrets_dir: str | None = (
        None  # keep them here (reused if it holds some) instead of a temporary directory
    )
    tls: TlsFiles | None = None  # embedded server: serve TLS with this certificate
    # The HTTP gateway (`python -m prorsa.gateway`, as the trainer on the bus) on this loopback port (None: none),
    # with these extra arguments; see `gateway_url` and `prorsa.gateway.launch`.
    gateway_port: int | None = None
    gateway_args: list[str] = field(default_factory=list)


NATS_KEY = "nats-server"  # the embedded server's key in supervision events


@dataclass(frozen=True, slots=True)
class Restarted:
    key: str
    restarts: int


class System:
    def __init__(self, config: SystemConfig, supervisor: Supervisor | None = None) -> None:
        self.config = config
        self.embedded: EmbeddedNatsServer | None = None
        self.secrets: BusSecrets | None = None
        self._own_secrets = False
        self.children: dict[str, subprocess.Popen[bytes]] = {}
        # key -> (module, args, bus user, extra environment): what a restart runs, with the same credentials
        # and devices
        self.commands: dict[str, tuple[str, list[str], str, dict[str, str]]] = {}
        self.supervisor = supervisor or Supervisor()
        self.url = config.nats_url or ""
        self._dead: set[str] = set()  # exits already reported to the supervisor, restart pending
        self.held: set[str] = set()  # children not restarted for now (the fault campaign's "no replacement")
        self._stopping = False
        self.api_key = ""  # the gateway's API key (with credentials only): in trainer.env as PRORSA_API_KEY
        self._child_env: dict[str, dict[str, str]] = {}  # key -> extra environment of that child

    @property
    def gateway_url(self) -> str:
        """The gateway's OpenAI base URL ("" without a gateway)."""
        port = self.config.gateway_port
        return f"http://127.0.0.1:{port}/v1" if port is not None else ""

    def engine_ids(self) -> list[str]:
        return [f"engine-{i}" for i in range(self.config.engines)]

    def start(self) -> System:
        if not self.url:
            if self.config.auth:
                self.secrets = self._make_secrets()
            config_file = str(self.secrets.server_config) if self.secrets is not None else None
            log = os.path.join(self.config.log_dir, "nats-server.log") if self.config.log_dir else None
            if self.config.log_dir:
                os.makedirs(self.config.log_dir, exist_ok=True)
            self.embedded = EmbeddedNatsServer(config_file=config_file, log_file=log).start()
            self.url = self.embedded.url
            if self.secrets is not None:
                self.secrets.write_env_files(self.url)  # they name the server now that its port is known
            self.supervisor.started(NATS_KEY, time.monotonic())
        for name in CONTROL_SERVICES:
            if service_exists(name):
                self._spawn(name, name, self.config.extra_service_args.get(name, []), SERVICE_ROLES[name])
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
                user = self.secrets.engine_user(f"engine-{i}") if self.secrets is not None else ""
                devices = self.config.engine_devices[i] if i < len(self.config.engine_devices) else ""
                env = {"CUDA_VISIBLE_DEVICES": devices} if devices else {}
                self._spawn(f"engine-{i}", "engine_agent", args, user, env)
        if self.config.gateway_port is not None:
            self._start_gateway()
        return self

    def _start_gateway(self) -> None:
        from prorsa.gateway.launch import api_key, write_trainer_env

        env: dict[str, str] = {}
        if self.secrets is not None:
            self.api_key = api_key(self.secrets.path)
            write_trainer_env(self.secrets.path, self.api_key, self.gateway_url)
            env["PRORSA_API_KEY"] = self.api_key
        self._child_env["gateway"] = env
        args = ["--port", str(self.config.gateway_port), *self.config.gateway_args]
        self._spawn("gateway", "prorsa.gateway", args, "trainer")

    def _make_secrets(self) -> BusSecrets:
        tls = self.config.tls
        if self.config.secrets_dir and (Path(self.config.secrets_dir) / "users.json").is_file():
            return load(self.config.secrets_dir, tls.trust if tls is not None else "")
        if self.config.secrets_dir:
            path = self.config.secrets_dir
        else:
            path = tempfile.mkdtemp(prefix="prorsa-secrets-")  # 0700
            self._own_secrets = True
        return generate(path, self.config.namespace, tuple(self.engine_ids()), tls)

    def credentials(self, user: str) -> BusCredentials:
        """What an in-process client connects as: `user`'s generated credentials, or (no generated ones) this
        process's environment."""
        if self.secrets is None:
            return BusCredentials.from_env()
        return self.secrets.credentials(user)

    def expected_services(self) -> list[str]:
        names = [n for n in CONTROL_SERVICES if service_exists(n)]
        if self.config.engines and service_exists("engine_agent"):
            names += ["engine_agent"] * self.config.engines
        return names

    def _spawn(
        self, key: str, module: str, args: list[str], user: str = "", extra_env: dict[str, str] | None = None
    ) -> None:
        extra_env = dict(extra_env or {})
        self.commands[key] = (module, args, user, extra_env)
        cmd = [
            sys.executable,
            "-m",
            module if "." in module else f"services.{module}",
            "--nats",
            self.url,
            "--namespace",
            self.config.namespace,
            *args,
        ]
        env = dict(os.environ, PYTHONUNBUFFERED="1", **extra_env)
        if self.secrets is not None:  # this child's own credentials, none of this process's
            for var in CREDENTIAL_ENV.values():
                env.pop(var, None)
            env.update(self.secrets.credentials(user).to_env())
        env.update(self._child_env.get(key, {}))
        if self.config.log_dir:
            os.makedirs(self.config.log_dir, exist_ok=True)
            out = open(os.path.join(self.config.log_dir, f"{key}.log"), "ab")  # noqa: SIM115 - owned by Popen
        else:
            out = subprocess.DEVNULL
        self.children[key] = subprocess.Popen(cmd, stdout=out, stderr=out, env=env)
        if out is not subprocess.DEVNULL:
            out.close()  # the child holds its own descriptor
        self.supervisor.started(key, time.monotonic())

    def dead_children(self) -> dict[str, int]:
        return {k: p.returncode for k, p in self.children.items() if p.poll() is not None}

    # --- supervision ------------------------------------------------------------------------------------------
    def supervise(self, now: float | None = None) -> list[Exit | Restarted]:
        """Report new exits to the supervisor and restart the children that are due; returns what happened."""
        if self._stopping:
            return []
        now = time.monotonic() if now is None else now  # wall: processes crash and restart in real seconds
        events: list[Exit | Restarted] = []
        dead = dict(self.dead_children())
        if self.embedded is not None and not self.embedded.running:
            dead[NATS_KEY] = self.embedded.returncode
        for key, rc in sorted(dead.items()):
            if key not in self._dead:
                self._dead.add(key)
                events.append(self.supervisor.exited(key, rc if rc is not None else -1, now))
        for key in self.supervisor.due(now):
            if key not in self._dead or key in self.held:
                continue
            self._dead.discard(key)
            if key == NATS_KEY:
                assert self.embedded is not None
                self.embedded.start()  # same port and store: streams, consumers and unacked work survive
                self.supervisor.started(key, time.monotonic())
            else:
                module, args, user, extra_env = self.commands[key]
                self._spawn(key, module, args, user, extra_env)
            events.append(Restarted(key, self.supervisor.children[key].restarts))
        return events

    def signal(self, key: str, signum: int) -> None:
        """Send `signum` to one child (or the embedded server): the fault campaign's way to kill a part."""
        if key == NATS_KEY:
            assert self.embedded is not None
            self.embedded.signal(signum)
            return
        p = self.children[key]
        if p.poll() is None:
            p.send_signal(signum)

    def stop(self, timeout_s: float = 15.0) -> None:
        self._stopping = True
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
        if self.secrets is not None and self._own_secrets:
            shutil.rmtree(self.secrets.path, ignore_errors=True)
            self.secrets = None
