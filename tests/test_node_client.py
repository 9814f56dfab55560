"""A trainer in another language: the Node.js client in clients/node, written from proto/README.md alone, runs a
multi-turn trajectory (start, turns, tool calls, finish) through the raw subjects against a real cluster
(`prorsa.system`: embedded nats-server, tracker, forecaster, allocator, two simulated engines).

The set-up installs the client's npm packages (`npm ci`, from clients/node/package-lock.json) into the ignored
clients/node/node_modules; the tests skip, saying so, only where node or npm is missing. The Python side checks
what the Node client put on the bus with the strict codec, and that no service answered any of it with an error.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import nats
import pytest

import proto
from prorsa.system import System, SystemConfig
from proto import ErrorReply, LifecycleSnapshot, RequestFinished, Subjects

pytestmark = pytest.mark.timeout(240)

NODE_DIR = Path(__file__).resolve().parent.parent / "clients" / "node"
STAMP = NODE_DIR / "node_modules" / ".prorsa-lock-sha256"


@pytest.fixture(scope="module")
def node() -> str:
    """The node binary, with the client's packages installed (npm ci when package-lock.json changed)."""
    node_bin, npm_bin = shutil.which("node"), shutil.which("npm")
    if node_bin is None or npm_bin is None:
        pytest.skip("node/npm not found: install Node.js >= 18 (Debian: apt-get install nodejs npm)")
    major = int(
        subprocess.run([node_bin, "--version"], capture_output=True, text=True)
        .stdout.strip()[1:]
        .split(".")[0]
    )
    if major < 18:
        pytest.skip(f"Node.js {major} is too old for @nats-io/transport-node (needs >= 18)")
    lock = hashlib.sha256((NODE_DIR / "package-lock.json").read_bytes()).hexdigest()
    if not STAMP.exists() or STAMP.read_text() != lock:
        out = subprocess.run(
            [npm_bin, "ci", "--no-audit", "--no-fund"],
            cwd=NODE_DIR,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert out.returncode == 0, f"npm ci failed in {NODE_DIR}:\n{out.stdout}\n{out.stderr}"
        STAMP.write_text(lock)
    return node_bin


def test_node_client_pure_parts(node: str) -> None:
    out = subprocess.run([node, "--test", "test/"], cwd=NODE_DIR, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


class BusLog:
    """What the Node client's trajectory leaves on the bus, decoded by the Python contract."""

    def __init__(self) -> None:
        self.lifecycle: list[proto.Message] = []
        self.errors: list[ErrorReply] = []
        self.finished: list[RequestFinished] = []
        self.snapshot: LifecycleSnapshot | None = None

    async def attach(self, nc: nats.NATS, s: Subjects) -> None:
        async def on_lifecycle(msg) -> None:  # noqa: ANN001
            self.lifecycle.append(proto.decode(msg.data, msg.subject, proto.LIFECYCLE_MESSAGES))

        async def on_error(msg) -> None:  # noqa: ANN001
            self.errors.append(proto.decode_as(msg.data, ErrorReply, msg.subject))

        async def on_engine_event(msg) -> None:  # noqa: ANN001
            event = proto.decode(msg.data, msg.subject)
            if isinstance(event, RequestFinished):
                self.finished.append(event)

        async def on_snapshot(msg) -> None:  # noqa: ANN001
            self.snapshot = proto.decode_as(msg.data, LifecycleSnapshot, msg.subject)

        await nc.subscribe(s.lifecycle, cb=on_lifecycle)
        await nc.subscribe(s.errors, cb=on_error)
        await nc.subscribe(s.all_engine_events, cb=on_engine_event)
        await nc.subscribe(s.snapshot, cb=on_snapshot)
        await nc.flush()


async def test_node_client_runs_a_multi_turn_trajectory(node: str, tmp_path, monkeypatch) -> None:
    from prorsa.commands.up import wait_healthy

    monkeypatch.setenv("PRORSA_TIME_SCALE", "20")  # the services, the engines and the Node client share it
    # Colocated engines keep their role, so which engine holds the prefix after each turn is certain.
    config = SystemConfig(
        # An open server: this test is about the trainer's use of the subjects, not credentials (the Node
        # client carries no nkey support yet; tests/test_bus_security*.py cover auth).
        auth=False,
        engines=2,
        extra_service_args={"allocator": ["--policy", "colocated"]},
        log_dir=str(tmp_path),
    )
    system = System(config).start()
    nc = None
    try:
        expected = system.expected_services()
        replies = await wait_healthy(system.url, "prorsa", expected, timeout_s=120.0)
        assert sorted(r.service for r in replies if r.status == "ok") == sorted(expected)
        nc = await nats.connect(system.url)
        log = BusLog()
        await log.attach(nc, Subjects())
        proc = await asyncio.create_subprocess_exec(
            node, "run-trajectory.mjs", "--nats", system.url, "--traj-id", "node-traj", "--turns", "3",
            cwd=NODE_DIR, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        stdout, stderr = await asyncio.wait_for(proc.communicate(), 90)
        assert proc.returncode == 0, stdout.decode() + stderr.decode()
        summary = json.loads(stdout.decode().strip().splitlines()[-1])
        await asyncio.sleep(1.0)  # the tracker's next snapshot
    finally:
        if nc is not None:
            await nc.close()
        system.stop()

    turns = summary["turns"]
    assert [t["request_id"] for t in turns] == ["node-traj:0", "node-traj:1", "node-traj:2"]
    for t in turns:  # every token streamed once, with its logprob, from one engine
        assert t["output_tokens"] == t["streamed_tokens"] == t["logprobs"] == 24 and t["restarts"] == 0
    for prev, t in zip(turns, turns[1:], strict=False):  # prefix affinity across the tool call
        assert t["engine_id"] == prev["prefill_engine"], turns
        assert t["cached_tokens"] == prev["prompt_tokens"] + prev["output_tokens"], turns
    assert summary["error_replies"] == [] and summary["bad_messages"] == 0

    mine = [e for e in log.lifecycle if e.source == summary["client_id"]]
    assert [e.seq for e in mine] == list(range(1, 10))
    assert [type(e).__name__ for e in mine] == [
        "TrajectoryStarted",
        *["TurnSubmitted", "ToolCallStarted", "ToolCallFinished"] * 2,
        "TurnSubmitted",
        "TrajectoryFinished",
    ]
    assert [e.observation_tokens for e in mine if isinstance(e, proto.ToolCallFinished)] == [150, 150]
    assert mine[-1].turns == 3 and mine[-1].reward == 1.0
    assert sorted(e.request_id for e in log.finished) == [t["request_id"] for t in turns]
    assert log.errors == [], log.errors
    assert log.snapshot is not None and log.snapshot.finished_total == 1
    assert log.snapshot.trajectories == []
