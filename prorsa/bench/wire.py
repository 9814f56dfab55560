"""Bytes and CPU per turn on the bus, whole contexts against the lean wire: `python -m prorsa.bench.wire`.

One agentic trajectory (default: 100 turns growing to a 128k-token context, 32 output tokens a turn) runs twice
through a real nats-server and simulated engine agents (their own processes, as `prorsa up` runs them; `--layout
mixed`: one mixed engine, `disagg`: one prefill and two decode engines, so the decode engine of a turn often lacks
its prefix and reads the log): once with the
whole context in every request (`RolloutClient(lean_wire=False)`, schema 1's way), once with the lean wire (the
turn's new ids and a prefix reference; its segment in the context log: `proto/context_log.py`). Per run:

- bytes the client sent (its connection's out_bytes: requests, context-log segments, lifecycle events), per turn;
- bytes the nats-server took in from everyone (its /varz in_bytes: the client's, the engines' handoffs, events and
  stats, and their context-log reads' requests) and sent out (out_bytes: deliveries, log reads), per turn;
- bytes stored in file-backed streams by the client (WORK requests + CONTEXT segments), per turn;
- CPU seconds per turn of the client (this process, inside `generate`), of the engine agents (summed) and of the nats-server (from
  /proc); context-log reads per turn (engines' health: a read fetches a trajectory's segments when the engine does
  not hold the prefix).

The nats-server runs with max_payload 8 MiB so that the whole-context run fits at all (at nats-server's default
1 MiB it stops near 150k tokens of JSON). It also prints the size of the last turn's request in each encoding
(JSON and MessagePack, whole and lean), which says where binary token arrays pay. Linux only (/proc).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass
from typing import Any

import msgspec

from prorsa.client import RolloutClient
from prorsa.health import gather_health
from proto import GenerateRequest, SamplingParams, Subjects
from services.runtime.nats_server import EmbeddedNatsServer, free_port

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
BENCH_MAX_PAYLOAD = 8 * 1024 * 1024


@dataclass
class RunResult:
    mode: str  # "whole" | "lean"
    turns: int
    final_context_tokens: int
    client_bytes_per_turn: float  # everything the client's connection sent, averaged over the turns
    bus_in_bytes_per_turn: float  # everything the server took in (all connections), averaged
    bus_out_bytes_per_turn: float  # everything the server sent out (all connections), averaged
    stored_bytes_per_turn: float  # WORK request bytes + CONTEXT segment bytes, averaged
    last_request_bytes: int  # the last turn's GenerateRequest (the largest context)
    log_reads_per_turn: float  # context-log reads by the engines (lean: a prefix the engine did not hold)
    client_cpu_ms_per_turn: float
    engine_cpu_ms_per_turn: float
    server_cpu_ms_per_turn: float
    wall_s: float


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def growth(turns: int, context_tokens: int, first_tokens: int, output_tokens: int) -> int:
    """Observation tokens per turn so that the last turn's prompt is `context_tokens` long."""
    return max(0, (context_tokens - first_tokens) // max(1, turns - 1) - output_tokens)


LAYOUTS = {"mixed": ("mixed",), "disagg": ("prefill", "decode", "decode")}


def start_engines(
    url: str, layout: str, time_scale: float, max_model_len: int
) -> list[subprocess.Popen[bytes]]:
    env = {**os.environ, "PRORSA_TIME_SCALE": str(time_scale), "PRORSA_LOG_LEVEL": "WARNING"}
    procs = []
    for i, role in enumerate(LAYOUTS[layout]):
        cmd = [sys.executable, "-m", "services.engine_agent", "--nats", url, "--engine-id", f"wire-{i}"]
        cmd += ["--backend", "sim", "--role", role, "--max-model-len", str(max_model_len)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return procs


async def log_reads(url: str) -> int:
    """Context-log reads so far, summed over the engines (their health details)."""
    replies = await gather_health(url, "prorsa", wait_s=0.5)
    return sum(
        r.details.get("context_cache", {}).get("log_reads", 0) for r in replies if r.service == "engine_agent"
    )


async def wait_engines(client: RolloutClient, n: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(client.directory.engines) < n:
        if time.monotonic() > deadline:
            raise TimeoutError("the engine agent did not publish stats")
        await asyncio.sleep(0.1)


async def run(mode: str, args: argparse.Namespace) -> RunResult:
    monitor = free_port()
    server = EmbeddedNatsServer(
        max_payload=BENCH_MAX_PAYLOAD, extra_config=f"http: 127.0.0.1:{monitor}"
    ).start()
    engines: list[subprocess.Popen[bytes]] = []
    client = None
    try:
        client = await RolloutClient.connect(server.url, lean_wire=mode == "lean", clock=None)
        engines = start_engines(server.url, args.layout, args.time_scale, 2 * args.context_tokens)
        await wait_engines(client, len(engines))
        rng = random.Random(args.seed)
        obs = growth(args.turns, args.context_tokens, args.first_tokens, args.output_tokens)
        prompt = [rng.randrange(args.vocab) for _ in range(args.first_tokens)]
        sampling = SamplingParams(max_tokens=args.output_tokens, ignore_eos=True)
        traj = await client.start_trajectory(f"wire-{mode}")
        out0 = client.nc.stats["out_bytes"]
        reads0 = await log_reads(server.url)
        varz0 = varz(monitor)
        client_cpu_s = 0.0
        cpu0 = (time.process_time(), _engines_cpu_s(engines), proc_cpu_s(server._proc.pid))  # type: ignore[union-attr]
        t0 = time.monotonic()
        for turn in range(args.turns):
            if turn:
                prompt = (
                    prompt
                    + list(traj.results[-1].token_ids)
                    + [rng.randrange(args.vocab) for _ in range(obs)]
                )
            c0 = time.process_time()  # the client's CPU only: building the next prompt is the agent's work
            await traj.generate(prompt, sampling, timeout_s=120)
            client_cpu_s += time.process_time() - c0
        wall_s = time.monotonic() - t0
        cpu1 = (time.process_time(), _engines_cpu_s(engines), proc_cpu_s(server._proc.pid))  # type: ignore[union-attr]
        reads = await log_reads(server.url) - reads0
        varz1 = varz(monitor)
        sent = client.nc.stats["out_bytes"] - out0
        context_stream = await client.js.stream_info(Subjects().context_stream)
        stored = client.request_bytes + context_stream.state.bytes
        last = _request(traj.traj_id, len(prompt), prompt, mode, args)
        await traj.finish()
        n = args.turns
        return RunResult(
            mode=mode,
            turns=n,
            final_context_tokens=len(prompt),
            client_bytes_per_turn=sent / n,
            bus_in_bytes_per_turn=(varz1["in_bytes"] - varz0["in_bytes"]) / n,
            bus_out_bytes_per_turn=(varz1["out_bytes"] - varz0["out_bytes"]) / n,
            stored_bytes_per_turn=stored / n,
            last_request_bytes=len(msgspec.json.encode(last)),
            log_reads_per_turn=reads / n,
            client_cpu_ms_per_turn=1000 * client_cpu_s / n,
            engine_cpu_ms_per_turn=1000 * (cpu1[1] - cpu0[1]) / n,
            server_cpu_ms_per_turn=1000 * (cpu1[2] - cpu0[2]) / n,
            wall_s=wall_s,
        )
    finally:
        if client is not None:
            await client.close()
        for engine in engines:
            engine.terminate()
        for engine in engines:
            engine.wait(timeout=30)
        server.stop(remove_store=True)


def varz(port: int) -> dict[str, Any]:
    """The nats-server's monitoring counters (bytes and messages in and out since it started)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/varz", timeout=5) as resp:
        return json.load(resp)


def _engines_cpu_s(engines: list[subprocess.Popen[bytes]]) -> float:
    return sum(proc_cpu_s(e.pid) for e in engines)


def _request(traj_id: str, n: int, prompt: list[int], mode: str, args: argparse.Namespace) -> GenerateRequest:
    """The last turn's request as each mode sends it (lean: the last turn's new ids after the previous prompt)."""
    new = growth(args.turns, args.context_tokens, args.first_tokens, args.output_tokens) + args.output_tokens
    ids = prompt if mode == "whole" else prompt[n - new :]
    return GenerateRequest(
        request_id=f"{traj_id}:{args.turns - 1}",
        traj_id=traj_id,
        turn=args.turns - 1,
        prompt_token_ids=ids,
        prompt_len=n,
        sampling=SamplingParams(max_tokens=args.output_tokens),
        reply_to="prorsa.reply.bench.0",
        prefix_turn=args.turns - 2 if mode == "lean" else 0,
        prefix_len=n - new if mode == "lean" else 0,
        context_logged=mode == "lean",
    )


def encodings(args: argparse.Namespace) -> dict[str, Any]:
    """Bytes and encode+decode microseconds of the last turn's request, JSON vs MessagePack, whole vs lean."""
    rng = random.Random(args.seed)
    prompt = [rng.randrange(args.vocab) for _ in range(args.context_tokens)]
    out: dict[str, Any] = {}
    for mode in ("whole", "lean"):
        req = _request("wire-x", len(prompt), prompt, mode, args)
        for name, enc, dec in (
            ("json", msgspec.json.Encoder(), msgspec.json.Decoder(GenerateRequest)),
            ("msgpack", msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(GenerateRequest)),
        ):
            data = enc.encode(req)
            reps = 20 if mode == "whole" else 2000
            t0 = time.perf_counter()
            for _ in range(reps):
                dec.decode(enc.encode(req))
            out[f"{mode}/{name}"] = {"bytes": len(data), "codec_us": 1e6 * (time.perf_counter() - t0) / reps}
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--turns", type=int, default=100, help="turns of the trajectory (default: 100)")
    p.add_argument(
        "--context-tokens", type=int, default=131_072, help="the last turn's context (default: 131072)"
    )
    p.add_argument(
        "--first-tokens", type=int, default=2_000, help="the first prompt's tokens (default: 2000)"
    )
    p.add_argument("--output-tokens", type=int, default=32, help="output tokens a turn (default: 32)")
    p.add_argument(
        "--vocab", type=int, default=151_000, help="token ids are drawn below this (default: 151000)"
    )
    p.add_argument(
        "--time-scale", type=float, default=1000.0, help="the sim engine's clock speed-up (default: 1000)"
    )
    p.add_argument("--seed", type=int, default=0, help="random seed of the token ids (default: 0)")
    p.add_argument("--modes", default="whole,lean", help="runs, comma-separated (default: whole,lean)")
    p.add_argument("--layout", choices=sorted(LAYOUTS), default="mixed", help="engines (default: mixed)")
    p.add_argument("--json", default=None, help="also write the results to this file (default: none)")
    args = p.parse_args(argv)
    results = [asyncio.run(run(mode, args)) for mode in args.modes.split(",")]
    codec = encodings(args)
    print(
        f"{args.turns} turns to a {results[0].final_context_tokens}-token context, {args.output_tokens} out a turn,"
        f" layout {args.layout}; per turn:"
    )
    head = (
        f"{'mode':6} {'client B':>11} {'bus in B':>11} {'bus out B':>11} {'stored B':>11} {'last req B':>11}"
    )
    head += f" {'client ms':>9}"
    print(head + f" {'engine ms':>10} {'server ms':>10} {'log reads':>9} {'wall s':>7}")
    for r in results:
        print(
            f"{r.mode:6} {r.client_bytes_per_turn:11,.0f} {r.bus_in_bytes_per_turn:11,.0f}"
            f" {r.bus_out_bytes_per_turn:11,.0f} {r.stored_bytes_per_turn:11,.0f} {r.last_request_bytes:11,}"
            f" {r.client_cpu_ms_per_turn:9.2f} {r.engine_cpu_ms_per_turn:10.2f} {r.server_cpu_ms_per_turn:10.2f}"
            f" {r.log_reads_per_turn:9.2f} {r.wall_s:7.1f}"
        )
    print(
        "last turn's request:",
        ", ".join(f"{k} {v['bytes']:,} B ({v['codec_us']:.0f} us)" for k, v in codec.items()),
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"runs": [asdict(r) for r in results], "encodings": codec, "args": vars(args)}, f, indent=1
            )


if __name__ == "__main__":
    main()
