"""The allowed paths still work under credentials: a `prorsa up`-style system (embedded server with the generated
config, every service and engine a child with its own credentials) runs turns for a trainer credential; and the
bus runs over TLS with a certificate the test makes."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import subprocess
from pathlib import Path

import nats
import pytest
from nats.errors import NoServersError

from prorsa.client import RolloutClient
from prorsa.client.workload_hint import WorkloadHint, generate_hinted
from prorsa.commands.up import wait_healthy
from prorsa.system import System, SystemConfig
from proto import SamplingParams, Subjects
from services.runtime.bus import connect, ensure_streams
from services.runtime.bus_secrets import TlsFiles, generate
from services.runtime.credentials import BusCredentials, CredentialsError
from services.runtime.nats_server import EmbeddedNatsServer

pytestmark = pytest.mark.timeout(180)


async def test_a_system_with_credentials_runs_turns_for_a_trainer(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PRORSA_TIME_SCALE", "20")
    logs = tmp_path / "logs"
    system = System(SystemConfig(engines=2, log_dir=str(logs))).start()
    try:
        assert system.secrets is not None
        replies = await wait_healthy(
            system.url, "prorsa", system.expected_services(), 90.0, credentials=system.credentials("operator")
        )
        assert sorted(r.service for r in replies if r.status == "ok") == sorted(system.expected_services())
        with pytest.raises(CredentialsError, match="Authorization Violation"):  # at once, not retried forever
            await asyncio.wait_for(RolloutClient.connect(system.url, credentials=BusCredentials()), 10)
        client = await RolloutClient.connect(system.url, credentials=system.credentials("trainer"))
        await asyncio.sleep(1.0)  # first EngineStats: the second turn is addressed to the first's engine
        traj = await client.start_trajectory(task="coding")
        for turn in range(2):
            hint = WorkloadHint(600 + 300 * turn, output_tokens=12, cacheable_tokens=0 if turn == 0 else 612)
            out = await generate_hinted(
                traj, [], SamplingParams(max_tokens=12, ignore_eos=True), hint, timeout_s=60
            )
            assert len(out.token_ids) == 12
        await traj.tool_started("bash")
        await traj.tool_finished("bash", observation_tokens=10)
        await traj.finish(reward=1.0)
        # The lean wire within the grants: the trainer writes and purges the context log, the engines read it
        # (no segment inline, so every turn's engine reads the log).
        client.inline_max_tokens = 0
        lean = await client.start_trajectory(task="coding")
        prompt = list(range(1, 601))
        for _ in range(2):
            out = await lean.generate(prompt, SamplingParams(max_tokens=12, ignore_eos=True), timeout_s=60)
            prompt = prompt + out.token_ids + list(range(1, 51))
        await lean.finish(reward=1.0)
        assert client.bad_messages == 0 and client.context_bytes == 4 * (600 + 12 + 50)
        await client.close()
    finally:
        system.stop()
    # Every child did its job within its grants: the server refused none of them anything.
    for log in logs.iterdir():
        assert "violation" not in log.read_text().lower(), log.name


def _self_signed(tmp: Path) -> TlsFiles:
    cert, key = tmp / "server.pem", tmp / "server.key"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
            "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", str(key), "-out", str(cert),
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return TlsFiles(str(cert), str(key))


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
async def test_the_bus_runs_over_tls_with_credentials(tmp_path) -> None:
    secrets = generate(tmp_path / "secrets", tls=_self_signed(tmp_path))
    with EmbeddedNatsServer(config_file=str(secrets.server_config)) as srv:
        creds = secrets.credentials("trainer")
        assert creds.tls_ca  # the env files carry it
        nc = await connect(srv.url, "tls-trainer", credentials=creds)
        await ensure_streams(nc.jetstream(), Subjects())
        ack = await nc.jetstream().publish("prorsa.lifecycle", b"{}")
        assert ack.seq == 1
        await nc.close()
        # The server says so to anyone who connects: no plain-text session is possible.
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as raw:
            info = json.loads(raw.recv(4096).decode().removeprefix("INFO ").strip())
        assert info["tls_required"] is True and info["auth_required"] is True
        # The right nkey without trusting the certificate: the TLS handshake fails, nothing is sent.
        untrusted = BusCredentials(nkey_file=creds.nkey_file, inbox_prefix=creds.inbox_prefix)
        with pytest.raises((NoServersError, nats.errors.Error, OSError)):
            await nats.connect(
                srv.url,
                allow_reconnect=False,
                max_reconnect_attempts=0,
                connect_timeout=2,
                **untrusted.connect_options(),
            )
