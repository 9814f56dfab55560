"""What the HTTP gateway adds over the SDK, per turn, in one run: `python -m prorsa.bench.gateway`.

One system (embedded nats-server, the tracker, simulated engines at a high speed-up so that engine time is small,
and a gateway process) serves the same kind of turns two ways, in alternating rounds: through the client SDK in
this process (reporting its tool calls, as a trainer does and as the gateway does for its clients), and through the gateway over HTTP (`/v1/completions` with token-id prompts, one session per
trajectory, as a trainer would). `--concurrency` sessions run at once, each `--turns` turns whose prompts extend
the last. Per path: turns/s sustained, per-turn latency p50/p99 (request to whole response), and the gateway's
added latency (gateway minus SDK at each quantile); the gateway process's CPU per turn (from /proc, so Linux
only). The load generator shares the machine's cores with everything it measures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from dataclasses import asdict, dataclass

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass
class PathResult:
    path: str
    turns: int
    wall_s: float
    p50_ms: float
    p99_ms: float

    @property
    def rate(self) -> float:
        return self.turns / self.wall_s if self.wall_s else 0.0


def _quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else 0.0


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


async def _sdk_round(
    url: str, sessions: int, turns: int, max_tokens: int, tag: str
) -> tuple[list[float], float]:
    from prorsa.client.client import RolloutClient
    from proto import SamplingParams

    client = await RolloutClient.connect(url)
    lat: list[float] = []

    async def one(i: int) -> None:
        t0 = time.perf_counter()  # the first turn includes starting the trajectory, as the gateway's does
        traj = await client.start_trajectory(f"sdk-{tag}-{i}")
        prompt = list(range(1, 200))
        for k in range(turns):
            if k:
                t0 = time.perf_counter()
                # A trainer reports its tool calls, as the gateway does for its clients.
                await traj.tool_finished("", observation_tokens=3)
            out = await traj.generate(prompt, SamplingParams(max_tokens=max_tokens))
            lat.append(time.perf_counter() - t0)
            await traj.tool_started("")
            prompt = [*prompt, *out.token_ids, 5, 6, 7]
        await traj.finish()

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(sessions)))
    wall = time.perf_counter() - t0
    await client.close()
    return lat, wall


async def _http_round(
    base: str, sessions: int, turns: int, max_tokens: int, tag: str
) -> tuple[list[float], float]:
    # aiohttp, not httpx: under a few dozen concurrent requests httpx's own overhead, not the gateway, set the pace.
    import aiohttp

    lat: list[float] = []

    async def one(http: aiohttp.ClientSession, i: int) -> None:
        sid = f"gw-{tag}-{i}"
        prompt = list(range(1, 200))
        for _ in range(turns):
            t0 = time.perf_counter()
            body = {"prompt": prompt, "max_tokens": max_tokens, "trajectory_id": sid, "logprobs": 0}
            async with http.post(f"{base}/completions", json=body) as r:
                r.raise_for_status()
                out = await r.json()
            lat.append(time.perf_counter() - t0)
            prompt = [*prompt, *out["choices"][0]["token_ids"], 5, 6, 7]
        async with http.post(f"{base}/trajectories/{sid}/finish", json={}) as r:
            r.raise_for_status()

    connector = aiohttp.TCPConnector(limit=sessions)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(http, i) for i in range(sessions)))
        wall = time.perf_counter() - t0
    return lat, wall


async def _wait_http(url: str, timeout_s: float = 60.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient() as client:
        while time.monotonic() < deadline:
            try:
                if (await client.get(url)).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.2)
    raise TimeoutError(f"{url} never answered")


async def _measure(args: argparse.Namespace, url: str, base: str, gateway_pid: int) -> dict:
    await _wait_http(base.removesuffix("/v1") + "/health")
    # Warm both paths (connections, JIT-free but cache-cold code paths) before measuring.
    await _sdk_round(url, 4, 2, args.max_tokens, "warm")
    await _http_round(base, 4, 2, args.max_tokens, "warm")
    lat: dict[str, list[float]] = {"sdk": [], "gateway": []}
    wall: dict[str, float] = {"sdk": 0.0, "gateway": 0.0}
    cpu = 0.0
    for r in range(args.rounds):
        sdk, sdk_wall = await _sdk_round(url, args.concurrency, args.turns, args.max_tokens, f"r{r}")
        before = _cpu_s(gateway_pid)
        gw, gw_wall = await _http_round(base, args.concurrency, args.turns, args.max_tokens, f"r{r}")
        cpu += _cpu_s(gateway_pid) - before
        lat["sdk"] += sdk
        lat["gateway"] += gw
        wall["sdk"] += sdk_wall
        wall["gateway"] += gw_wall
    results = [
        PathResult(p, len(lat[p]), wall[p], 1000 * _quantile(lat[p], 0.5), 1000 * _quantile(lat[p], 0.99))
        for p in ("sdk", "gateway")
    ]
    sdk_r, gw_r = results
    return {
        "paths": [asdict(r) | {"turns_per_s": r.rate} for r in results],
        "added_p50_ms": gw_r.p50_ms - sdk_r.p50_ms,
        "added_p99_ms": gw_r.p99_ms - sdk_r.p99_ms,
        "gateway_cpu_ms_per_turn": 1000 * cpu / max(1, gw_r.turns),
        "config": vars(args),
    }


def run(args: argparse.Namespace) -> dict:
    from prorsa.gateway.launch import free_port
    from prorsa.system import System, SystemConfig

    system = System(
        SystemConfig(
            engines=args.engines,
            backend="sim",
            extra_engine_args=["--speedup", str(args.speedup)],
            auth=False,
            gateway_port=free_port(),
        )
    ).start()
    try:
        return asyncio.run(_measure(args, system.url, system.gateway_url, system.children["gateway"].pid))
    finally:
        system.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--engines", type=int, default=4, help="simulated engines")
    p.add_argument("--speedup", type=float, default=200.0, help="engines' virtual seconds per wall second")
    p.add_argument("--concurrency", type=int, default=16, help="sessions (trajectories) at once")
    p.add_argument("--turns", type=int, default=10, help="turns per session")
    p.add_argument("--rounds", type=int, default=3, help="alternating SDK / gateway rounds")
    p.add_argument("--max-tokens", type=int, default=8, help="output tokens per turn")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    out = run(args)
    print(f"{'path':<8} {'turns':>6} {'turns/s':>8} {'p50 ms':>8} {'p99 ms':>8}")
    for r in out["paths"]:
        print(
            f"{r['path']:<8} {r['turns']:>6} {r['turns_per_s']:>8.1f} {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f}"
        )
    print(
        f"gateway adds p50 {out['added_p50_ms']:+.2f} ms, p99 {out['added_p99_ms']:+.2f} ms per turn; "
        f"gateway CPU {out['gateway_cpu_ms_per_turn']:.2f} ms per turn"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
