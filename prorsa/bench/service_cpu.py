"""CPU each service costs in a live rollout: `python -m prorsa.bench.service_cpu [--speedup 40]`.

A live rollout (`prorsa.rollout.live`) runs every service and engine agent as a child process of this one; this
samples each child's CPU time from /proc while the rollout runs and reports, per service, CPU seconds and CPU
share (CPU seconds per wall second; 1.0 is one core busy). The forecaster's cost per forecast divides its CPU by
the forecasts it published (seen on the bus by the rollout's recorder). Linux only (/proc).

Issue 16 asks that the forecaster cost little at a 40x clock even under `colocated`; the table says which service
spends the machine's CPU there, per policy, in one run. `--refit-cpu-shares 0,0.1` runs each policy with the
forecaster's refits uncapped and capped, side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from dataclasses import dataclass, field

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass
class ChildCpu:
    """CPU seconds of one child process, by the service it runs (`engine_agent` for every engine)."""

    service: str
    cpu_s: float = 0.0


def service_of(cmdline: list[str]) -> str:
    """`services.X` of a `python -m services.X ...` child; the executable's name for anything else."""
    for i, arg in enumerate(cmdline[:-1]):
        if arg == "-m" and cmdline[i + 1].startswith("services."):
            return cmdline[i + 1].removeprefix("services.")
    return os.path.basename(cmdline[0]) if cmdline else "?"


def read_children(parent: int) -> dict[int, ChildCpu]:
    """Every live direct child of `parent` with its CPU seconds so far (user + system)."""
    found: dict[int, ChildCpu] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        except OSError:  # exited between listdir and open
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "; comm may hold spaces
        if int(fields[1]) != parent:
            continue
        cpu_s = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime
        found[int(entry)] = ChildCpu(service_of(cmdline), cpu_s)
    return found


@dataclass
class CpuSampler:
    """Keeps the last CPU reading of every child it has seen, so a child that exits keeps what it spent up to the
    last sample before its exit (sampled every `interval_s`). `mark()` takes the start-up readings (imports,
    connecting, the first model fit) off, so the figures are the rollout's alone."""

    interval_s: float = 0.5
    last: dict[int, ChildCpu] = field(default_factory=dict)
    at_mark: dict[int, float] = field(default_factory=dict)
    marked_at: float | None = None
    frozen: bool = False  # after `freeze()`: teardown's CPU is not the rollout's

    def sample(self) -> None:
        if not self.frozen:
            self.last.update(read_children(os.getpid()))

    def freeze(self) -> None:
        self.sample()
        self.frozen = True

    def mark(self) -> None:
        self.sample()
        self.at_mark = {pid: child.cpu_s for pid, child in self.last.items()}
        self.marked_at = time.monotonic()

    async def run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(self.interval_s)

    def by_service(self) -> dict[str, tuple[int, float]]:
        """service -> (processes, CPU seconds)."""
        out: dict[str, tuple[int, float]] = {}
        for pid, child in self.last.items():
            n, s = out.get(child.service, (0, 0.0))
            out[child.service] = (n + 1, s + child.cpu_s - self.at_mark.get(pid, 0.0))
        return out


async def forecaster_phases(system) -> dict[str, float]:  # noqa: ANN001 - prorsa.system.System
    """The forecaster's CPU seconds by phase so far (its health details; empty if it does not answer)."""
    from prorsa.health import gather_health

    replies = await gather_health(system.url, wait_s=0.5, credentials=system.credentials("operator"))
    for r in replies:
        if r.service == "forecaster":
            return {k: float(v) for k, v in r.details.get("cpu_s", {}).items()}
    return {}


@dataclass
class Run:
    summary: dict
    wall_s: float  # of the rollout itself, start-up and teardown excluded
    forecasts: int
    phases: dict[str, float]  # forecaster CPU seconds by phase over the rollout


async def measure(cfg, sampler: CpuSampler) -> Run:  # noqa: ANN001 - LiveConfig
    """Run one live rollout under the sampler, counting from its first trajectory to its last."""
    from prorsa.rollout.live import run_live

    phases: dict[str, dict[str, float]] = {}
    ended: list[float] = []

    async def started(system) -> None:  # noqa: ANN001
        phases["start"] = await forecaster_phases(system)
        sampler.mark()

    async def finished(system) -> None:  # noqa: ANN001
        sampler.freeze()
        ended.append(time.monotonic())
        phases["end"] = await forecaster_phases(system)

    task = asyncio.create_task(sampler.run())
    try:
        result = await run_live(cfg, started=started, finished=finished)
    finally:
        task.cancel()
    start, end = phases.get("start", {}), phases.get("end", {})
    return Run(
        result.summary,
        ended[0] - (sampler.marked_at or ended[0]),
        len(result.recorder.forecasts),
        {k: v - start.get(k, 0.0) for k, v in end.items()},
    )


def main(argv: list[str] | None = None) -> int:
    from prorsa.rollout.live import LiveConfig

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="profile:general")
    p.add_argument("--profile", default="qwen3-235b")
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--speedup", type=float, default=40.0)
    p.add_argument("--policies", default="colocated,prorsa")
    p.add_argument(
        "--refit-cpu-shares",
        default="",
        help="comma-separated forecaster --refit-cpu-share values to run each policy with (default: the service's)",
    )
    p.add_argument("--json", dest="json_path", default=None)
    args = p.parse_args(argv)
    rows = []
    shares = [s for s in args.refit_cpu_shares.split(",") if s] or [None]
    for policy, share in ((pol, sh) for pol in args.policies.split(",") for sh in shares):
        label = policy if share is None else f"{policy} (refit share {share})"
        cfg = LiveConfig(
            workload=args.workload,
            engines=args.engines,
            profile=args.profile,
            policy=policy,
            steps=args.steps,
            batch_size=args.batch_size,
            training_s=20.0,
            speedup=args.speedup,
            forecaster_args=[] if share is None else ["--refit-cpu-share", share],
        )
        print(f"{label}: live rollout at {args.speedup:g}x ...", flush=True)
        sampler = CpuSampler()
        run = asyncio.run(measure(cfg, sampler))
        summary, wall_s, forecasts = run.summary, run.wall_s, run.forecasts
        services = sampler.by_service()
        print(
            f"{label}: {wall_s:.1f} s wall, {summary['trajectories_completed']}/{summary['trajectories_expected']}"
            f" trajectories, {forecasts} forecasts"
        )
        print(f"  {'service':<20} {'procs':>5} {'cpu s':>8} {'cpu share':>9}")
        for name, (n, cpu_s) in sorted(services.items(), key=lambda kv: -kv[1][1]):
            print(f"  {name:<20} {n:>5} {cpu_s:>8.1f} {cpu_s / wall_s:>9.3f}")
        fc_cpu = services.get("forecaster", (0, 0.0))[1]
        if forecasts:
            print(f"  forecaster: {1000 * fc_cpu / forecasts:.1f} ms CPU (process) per forecast published")
        if run.phases:
            split = ", ".join(f"{k} {v:.2f} s" for k, v in sorted(run.phases.items(), key=lambda kv: -kv[1]))
            print(f"  forecaster CPU by phase: {split}")
            if forecasts and "forecast" in run.phases:
                print(
                    f"  forecast phase: {1000 * run.phases['forecast'] / forecasts:.1f} ms CPU per forecast"
                )
        rows.append(
            {
                "policy": policy,
                "refit_cpu_share": share,
                "wall_s": wall_s,
                "forecasts": forecasts,
                "forecaster_cpu_s_by_phase": run.phases,
                "avg_trajectory_s": summary["avg_trajectory_s"],
                "services": {
                    k: {"processes": n, "cpu_s": s, "cpu_share": s / wall_s} for k, (n, s) in services.items()
                },
            }
        )
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"config": vars(args), "runs": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
