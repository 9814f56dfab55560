"""`prorsa top` against a live system (as `prorsa up` starts it: every service and two simulated engines, each its
own process) while trajectories run, drawn on rich's recording console; and against buses it cannot show."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys

import pytest
from rich.console import Console

import proto
from prorsa.client import RolloutClient
from prorsa.commands.top import watch
from prorsa.commands.up import wait_healthy
from prorsa.rollout.live_driver import RolloutConfig, RolloutDriver
from prorsa.sim.fixed_workload import FixedWorkload
from prorsa.system import System, SystemConfig
from prorsa.workload.types import TrajectorySpec, Turn
from proto import HealthReply
from services.runtime.clock import time_scale_set

pytestmark = pytest.mark.timeout(180)


def recording() -> Console:
    return Console(record=True, width=160, force_terminal=False, color_system=None)


async def test_top_shows_a_running_cluster() -> None:
    specs = [
        # Long enough (hundreds of workload seconds) to be mid-flight when the view's last frame is drawn.
        TrajectorySpec(f"t{i}", "coding", tuple(Turn(2000 if k == 0 else 300, 3000, 5.0) for k in range(8)))
        for i in range(4)
    ]
    with time_scale_set(10.0):
        system = System(SystemConfig(engines=2, extra_engine_args=["--stats-interval-s", "0.25"])).start()
        try:
            replies = await wait_healthy(
                system.url,
                "prorsa",
                system.expected_services(),
                timeout_s=90,
                credentials=system.credentials("operator"),
            )
            assert len(replies) == len(system.expected_services())
            client = await RolloutClient.connect(system.url, credentials=system.credentials("trainer"))
            driver = RolloutDriver(client, RolloutConfig(steps=1, training_s=1.0))
            console = recording()
            rollout = asyncio.create_task(driver.run([FixedWorkload(specs).step(0)]))
            rc = await watch(
                system.url,
                "prorsa",
                console,
                for_s=8.0,
                interval_s=0.5,
                credentials=system.credentials("operator"),
            )
            assert not rollout.done()
            rollout.cancel()
            await asyncio.gather(rollout, return_exceptions=True)
            await client.close()
        finally:
            system.stop()
    assert rc == 0
    text = console.export_text()
    assert "Traceback" not in text and "bad input" not in text
    assert "services: allocator ×1, engine_agent ×2, forecaster ×1, trajectory_tracker ×1" in text
    for engine in ("engine-0", "engine-1"):
        assert engine in text
    assert "mixed" in text  # both engines start mixed under prorsa's initial plan for two engines
    assert "plan: epoch" in text and "prorsa" in text
    assert "forecast next" in text and "no forecast yet" not in text
    assert "no engine stats yet" not in text
    # The last frame, mid-rollout: every trajectory live in some phase, tokens flowing.
    live = re.search(r"trajectories: queued (\d+), prefill (\d+), decode (\d+), tool_call (\d+)", text)
    assert live is not None and sum(int(n) for n in live.groups()) == 4, text
    rate = re.search(r"throughput: prefill \S+ tok/s · decode (\S+) tok/s", text)
    assert rate is not None and rate.group(1) != "0", text


async def test_top_on_a_bus_without_services_says_so(nats_server) -> None:
    console = recording()
    rc = await watch(nats_server.url, "prorsa", console, for_s=1.0, probe_s=0.5)
    text = console.export_text()
    assert rc == 1 and "no Prorsa service answered on the bus" in text and "prorsa up" in text


async def test_top_against_a_service_of_another_schema_version(nats_server) -> None:
    """A service of a newer contract answers health in the next schema version: top says so instead of drawing
    nothing."""
    import nats

    nc = await nats.connect(nats_server.url)
    reply = json.loads(
        proto.encode(
            HealthReply(service="allocator", instance_id="a-v2", status="ok", uptime_s=1.0, ts_s=0.0)
        )
    )
    reply["schema_version"] = proto.SCHEMA_VERSION + 1

    async def answer(msg) -> None:  # noqa: ANN001
        await nc.publish(msg.reply, json.dumps(reply).encode())

    await nc.subscribe(proto.Subjects().health, cb=answer)
    await nc.flush()
    try:
        console = recording()
        rc = await watch(nats_server.url, "prorsa", console, for_s=1.0, probe_s=0.5)
    finally:
        await nc.close()
    text = console.export_text()
    assert (
        rc == 1
        and "another wire format" in text
        and f"schema version {proto.SCHEMA_VERSION + 1}" in text
        and "Traceback" not in text
    )


def test_top_without_a_server_says_so() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "prorsa", "top", "--nats", "nats://127.0.0.1:1"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert (
        out.returncode == 1
        and "cannot reach NATS" in out.stdout
        and "Traceback" not in out.stdout + out.stderr
    )
