"""The engine layout `prorsa up` starts: devices per engine (CUDA_VISIBLE_DEVICES), engine arguments reaching every
engine (a simulated engine serves a 200k-token context once `max_model_len=262144` is given), and a supervised
restart keeping an engine's devices."""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

import pytest

import proto
from prorsa.commands.up import add_arguments, engine_args, engine_devices
from prorsa.engine_layout import device_groups, parse_devices
from prorsa.health import gather_health
from prorsa.system import System, SystemConfig
from proto import Subjects
from tests.engine_agent_support import request

pytestmark = pytest.mark.timeout(120)


def test_devices_are_divided_among_engines() -> None:
    assert parse_devices("0-3,6,7") == ["0", "1", "2", "3", "6", "7"]
    assert device_groups(2, 2) == ["0,1", "2,3"]
    assert device_groups(3, 2, parse_devices("0-3,6,7")) == ["0,1", "2,3", "6,7"]
    assert device_groups(2, 0) == ["", ""]  # no placement: every engine sees every device
    with pytest.raises(ValueError, match="need 8 devices, 6 listed"):
        device_groups(4, 2, parse_devices("0-5"))
    for bad in ("0,0", "a", "3-1"):
        with pytest.raises(ValueError):
            parse_devices(bad)


def _up_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_up_passes_the_layout_to_every_engine(tmp_path) -> None:
    f = tmp_path / "engine.args"
    f.write_text("max_num_seqs=128\n")
    args = _up_args(
        "--engines", "2", "--engine-arg", "tensor_parallel_size=2", "--engine-args-file", str(f),
        "--role-engine-arg", "decode:data_parallel_size=2", "--devices-per-engine", "2", "--devices", "4-7",
    )  # fmt: skip
    assert engine_args(args) == [
        "--engine-arg", "tensor_parallel_size=2", "--engine-args-file", str(f),
        "--role-engine-arg", "decode:data_parallel_size=2",
    ]  # fmt: skip
    assert engine_devices(args) == ["4,5", "6,7"]
    with pytest.raises(SystemExit, match="need 6 devices"):
        engine_devices(_up_args("--engines", "3", "--devices-per-engine", "2", "--devices", "0-3"))


def _env_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


async def _engines_healthy(url: str, n: int) -> list[proto.HealthReply]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        replies = [r for r in await gather_health(url, wait_s=0.5) if r.service == "engine_agent"]
        if len(replies) == n and all(r.status == "ok" for r in replies):
            return replies
    raise TimeoutError("engines not healthy")


async def test_engines_start_with_their_devices_and_serve_long_contexts() -> None:
    config = SystemConfig(
        engines=2,
        auth=False,
        extra_engine_args=["--engine-arg", "max_model_len=262144", "--speedup", "200"],
        engine_devices=["0,1", "2,3"],
    )
    system = System(config).start()
    try:
        replies = await _engines_healthy(system.url, 2)
        assert {r.details["max_model_len"] for r in replies} == {262144}
        assert [_env_of(system.children[f"engine-{i}"].pid)["CUDA_VISIBLE_DEVICES"] for i in (0, 1)] == [
            "0,1",
            "2,3",
        ]
        # A 200k-token context: refused under the sim's default model length, served with the engine argument.
        import nats

        nc = await nats.connect(system.url)
        finished = asyncio.Event()

        async def on_chunk(msg) -> None:  # type: ignore[no-untyped-def]
            chunk = proto.decode_as(msg.data, proto.TokenChunk, msg.subject)
            assert not chunk.error, chunk.error
            if chunk.finished:
                finished.set()

        await nc.subscribe("prorsa.reply.test.*", cb=on_chunk)
        long = request("long-ctx", 16, prompt_len=200_000, sim_output_tokens=16)
        await nc.jetstream().publish(Subjects().prefill_work_any, proto.encode(long))
        await asyncio.wait_for(finished.wait(), 60)
        await nc.close()
        # A supervised restart keeps the engine's devices.
        system.children["engine-1"].kill()
        system.children["engine-1"].wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and system.children["engine-1"].poll() is not None:
            system.supervise()
            await asyncio.sleep(0.1)
        assert _env_of(system.children["engine-1"].pid)["CUDA_VISIBLE_DEVICES"] == "2,3"
    finally:
        system.stop()
