"""An engine killed mid-request (SIGKILL: no ack, no hand-off) leaves its work in JetStream; after ack_wait it is
redelivered to another engine, which completes it. Also covers `python -m services.engine_agent`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import proto
from prorsa.client.stream import StreamAssembler
from proto import EngineStats, Subjects
from tests.engine_agent_support import (
    Watcher,
    expected_ids,
    make_agent,
    publish_work,
    request,
    wait_until,
    wait_work_queue_empty,
)

S = Subjects()
REPO = Path(__file__).resolve().parents[1]
ACK_WAIT_S = 2.0


def spawn_engine(url: str, engine_id: str) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable,
        "-m",
        "services.engine_agent",
        "--nats",
        url,
        "--engine-id",
        engine_id,
        "--backend",
        "sim",
        "--role",
        "mixed",
        "--speedup",
        "2",
        "--ack-wait-s",
        str(ACK_WAIT_S),
        "--stats-interval-s",
        "0.2",
        "--chunk-interval-s",
        "0.01",
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1", PRORSA_LOG_LEVEL="WARNING")
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def test_killed_engine_work_is_redelivered_and_completed(nats_server, nc) -> None:
    watcher = Watcher()
    await watcher.attach(nc)
    seen: list[EngineStats] = []

    async def on_stats(msg: Any) -> None:
        seen.append(proto.decode_as(msg.data, EngineStats))

    await nc.subscribe(S.engine_stats("crash-a"), cb=on_stats)
    proc = spawn_engine(nats_server.url, "crash-a")
    survivor = make_agent(nats_server.url, "crash-b", "mixed", ack_wait_s=ACK_WAIT_S)
    try:
        await wait_until(lambda: bool(seen), timeout_s=15)  # the subprocess is up and serving
        await publish_work(nc, S.prefill_work_any, request("c0", max_tokens=400))
        await wait_until(lambda: watcher.tokens_streamed("c0") >= 20)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=5)
        streamed_by_a = watcher.tokens_streamed("c0")
        assert streamed_by_a < 400
        await survivor.start()
        await watcher.wait_finished(["c0"], timeout_s=15)
        # The survivor restarted the stream from chunk 0 with the same (deterministic) tokens.
        chunks = watcher.chunks["c0"]
        mine = sorted((c for c in chunks if c.engine_id == "crash-b"), key=lambda c: c.index)
        assert [c.index for c in mine] == list(range(len(mine))) and mine[-1].finished
        assert [t for c in mine for t in c.token_ids] == expected_ids("c0", 400)
        # A client sees one result: the restart is detected and the first engine's partial stream dropped.
        assembler = StreamAssembler("c0")
        results = [r for c in chunks if (r := assembler.add(c)) is not None]
        assert len(results) == 1
        assert results[0].token_ids == expected_ids("c0", 400) and results[0].restarts == 1
        await wait_work_queue_empty(nc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        await survivor.stop()


def test_cli_builds_a_sim_engine_without_importing_vllm() -> None:
    import argparse

    from services.engine_agent import __main__ as cli
    from services.engine_agent.backends.sim_backend import SimBackend

    parser = argparse.ArgumentParser()
    cli.extend(parser)
    args = parser.parse_args(
        ["--role", "decode", "--profile", "cpu-tiny", "--speedup", "4", "--max-model-len", "8192"]
    )
    backend = cli.make_backend(args, "cli-e")
    assert isinstance(backend, SimBackend)
    assert (backend.speedup, backend.max_model_len, backend.core.role) == (4.0, 8192, "decode")
    proto.check_token(cli.default_engine_id())
    # In a fresh interpreter (other tests in this process may have imported vllm for real):
    probe = (
        "import sys, argparse\n"
        "from services.engine_agent import __main__ as cli\n"
        "p = argparse.ArgumentParser(); cli.extend(p)\n"
        "cli.make_backend(p.parse_args(['--profile', 'cpu-tiny']), 'cli-e')\n"
        "print('vllm' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr
