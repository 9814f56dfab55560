"""Issue 14, finding 4: work addressed to an engine that died (`work.prefill.engine.<id>`) reaches a live engine
within seconds (its peers notice its stats stop and move the addressed queue to the shared one; JetStream redelivers
what it held after a short ack_wait), and the client stops addressing an engine whose stats stopped."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import proto
from prorsa.client.directory import EngineDirectory
from proto import EngineStats, Subjects
from services.engine_agent.rescue import PeerWatch
from tests.engine_agent_support import Watcher, expected_ids, make_agent, publish_work, request, wait_until

S = Subjects()
REPO = Path(__file__).resolve().parents[1]
RECOVERY_TARGET_S = 5.0


def stats(engine_id: str, ts: float) -> EngineStats:
    return EngineStats(engine_id=engine_id, ts_s=ts, role="mixed", epoch=0)


def test_the_client_stops_addressing_an_engine_after_three_missed_reports() -> None:
    d = EngineDirectory()
    for k in range(5):
        d.observe(stats("e", float(k)), now=k * 0.25)  # reports every 0.25 s
    last = 4 * 0.25
    assert d.affinity_target("e", last + 0.7) == "e"
    assert d.affinity_target("e", last + 0.8) is None  # 3 × 0.25 s (0.5 s floor), not a fixed 3 s
    slow = EngineDirectory()
    slow.observe(stats("s", 0.0), now=0.0)
    assert slow.affinity_target("s", 2.9) == "s" and slow.affinity_target("s", 3.1) is None  # one report: 3 s


def test_one_rescuer_per_dead_peer_the_smallest_live_id() -> None:
    watches = {e: PeerWatch(e, dead_after_s=3.0) for e in ("a", "b", "c")}
    for w in watches.values():
        for e in ("a", "b", "c"):
            w.observe(e, 0.0)
        w.observe("b", 10.0)
        w.observe("c", 10.0)
    # "a" stopped at 0: at 11 s it is dead; "b" (smallest live id) rescues it, "c" does not, "a" is not asked.
    assert watches["b"].to_rescue(11.0) == ["a"] and watches["c"].to_rescue(11.0) == []
    assert watches["b"].to_rescue(12.9) == ["a"] and watches["b"].dead(10.0 + 2.0) == ["a"]
    watches["b"].observe("a", 13.0)  # a replacement with the same id reports: no more rescue
    assert watches["b"].to_rescue(13.5) == []


def spawn_engine(url: str, engine_id: str) -> subprocess.Popen[bytes]:
    """An engine agent process with the production defaults for ack_wait (3 s) and stats (1 s)."""
    cmd = [sys.executable, "-m", "services.engine_agent", "--nats", url, "--engine-id", engine_id]
    cmd += ["--backend", "sim", "--role", "mixed", "--speedup", "2", "--chunk-interval-s", "0.01"]
    env = dict(os.environ, PYTHONUNBUFFERED="1", PRORSA_LOG_LEVEL="WARNING")
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def test_work_addressed_to_a_killed_engine_moves_to_a_live_one_within_seconds(nats_server, nc) -> None:  # noqa: ANN001
    watcher = Watcher()
    await watcher.attach(nc)
    seen: list[str] = []

    async def on_stats(msg: Any) -> None:
        seen.append(proto.decode_as(msg.data, EngineStats).engine_id)

    await nc.subscribe(S.all_engine_stats, cb=on_stats)
    survivor = make_agent(nats_server.url, "fast-b", "mixed", ack_wait_s=3.0, stats_interval_s=1.0)
    await survivor.start()
    proc = spawn_engine(nats_server.url, "fast-a")
    try:
        await wait_until(lambda: "fast-a" in seen, timeout_s=20)
        await asyncio.sleep(1.2)  # the survivor has seen the victim's stats (it must know whom to watch)
        # Held by the victim when it dies: it is redelivered to the victim's own consumer, which nobody reads.
        await publish_work(nc, S.prefill_work_for("fast-a"), request("held", max_tokens=600))
        await wait_until(lambda: watcher.tokens_streamed("held") >= 10, timeout_s=10)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=5)
        t_kill = time.monotonic()
        # Addressed by a client that has not noticed the death yet.
        await publish_work(nc, S.prefill_work_for("fast-a"), request("late", max_tokens=20))
        await wait_until(
            lambda: (
                any(c.engine_id == "fast-b" for c in watcher.chunks["held"])
                and any(c.engine_id == "fast-b" for c in watcher.chunks["late"])
            ),
            timeout_s=15,
        )
        recovered_s = time.monotonic() - t_kill
        assert recovered_s <= RECOVERY_TARGET_S, f"recovery took {recovered_s:.1f} s"
        await watcher.wait_finished(["held", "late"], timeout_s=20)
        mine = sorted((c for c in watcher.chunks["held"] if c.engine_id == "fast-b"), key=lambda c: c.index)
        assert [t for c in mine for t in c.token_ids] == expected_ids("held", 600)
        assert survivor.rescue.moved >= 2 and survivor.rescue.rescued == {"fast-a"}
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        await survivor.stop()
