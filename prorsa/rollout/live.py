"""One rollout over the live system: bring up NATS + services + engines, drive the workload, tear down.

The engines start in the roles the policy's `initial_plan` gives (so a static split pays no switch at start-up);
from then on the allocator service runs the policy. With simulated engines the whole system shares one compressed
clock (`services.runtime.clock`, PRORSA_TIME_SCALE = speedup), so every duration reported is in workload seconds.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from prorsa.client import RolloutClient
from prorsa.rollout.live_driver import RolloutConfig, RolloutDriver
from prorsa.rollout.recorder import Recorder
from prorsa.system import System, SystemConfig
from prorsa.workload.spec import load_workload
from services.allocator.registry import make_policy
from services.runtime.clock import time_scale_set
from services.runtime.logging import get_logger

log = get_logger("rollout_live", "main")


@dataclass
class LiveConfig:
    workload: str = "swe"
    engines: int = 4
    backend: str = "sim"
    model: str | None = None
    profile: str = "qwen3-235b"  # sim engines run as this profile
    # vLLM engines: the profile they report to the allocator (a `prorsa profile` JSON or a built-in name; "" = none,
    # and the allocator falls back to its default)
    engine_profile: str = ""
    policy: str = "prorsa"
    mode: str = "sync"
    staleness: int = 0
    steps: int = 1
    batch_size: int = 16
    group_size: int = 1
    training_s: float = 30.0
    speedup: float = 20.0
    seed: int = 0
    token_scale: float = 1.0
    nats_url: str | None = None
    log_dir: str | None = None
    allocator_interval_s: float | None = None
    # extra arguments of `python -m services.forecaster` (e.g. `--refit-cpu-share`)
    forecaster_args: list[str] = field(default_factory=list)
    extra_engine_args: list[str] = field(default_factory=list)


@dataclass
class LiveResult:
    summary: dict
    recorder: Recorder
    notes: list[str]
    trajectory_s: list[float] = field(default_factory=list)  # completion time of every completed trajectory


def initial_roles(policy: str, engines: int, profile: str) -> list[str]:
    ids = [f"engine-{i}" for i in range(engines)]
    plan = make_policy(policy, engines).initial_plan(ids)
    return [plan.roles.get(e, "mixed") for e in ids]


# Called with the running system (its url and credentials): once it is healthy, just before the first trajectory,
# and once the last trajectory ended, before teardown. A bench measures the rollout alone between the two.
Hook = Callable[[System], Awaitable[None]]


async def run_live(
    cfg: LiveConfig,
    progress: Callable[[str, int, int], None] | None = None,
    started: Hook | None = None,
    finished: Hook | None = None,
) -> LiveResult:
    speedup = cfg.speedup if cfg.backend == "sim" else 1.0
    with time_scale_set(speedup):  # inherited by every child process; restored afterwards
        return await _run_live(cfg, speedup, progress, started, finished)


async def _run_live(
    cfg: LiveConfig,
    speedup: float,
    progress: Callable[[str, int, int], None] | None,
    started: Hook | None,
    finished: Hook | None,
) -> LiveResult:
    workload = load_workload(
        cfg.workload, batch_size=cfg.batch_size, group_size=cfg.group_size, seed=cfg.seed
    )
    steps = [workload.step(i) for i in range(cfg.steps)]
    # Stats cadences are wall-clock; at a speed-up the allocator must judge staleness and decide on that cadence.
    stats_wall_s = 0.25 if speedup > 1 else 1.0
    engine_args = [*cfg.extra_engine_args, "--stats-interval-s", str(stats_wall_s)]
    if cfg.backend == "sim":
        engine_args += ["--profile", cfg.profile, "--speedup", str(speedup)]
    elif cfg.engine_profile:  # a real engine's calibration (`prorsa profile`), reported to the allocator
        engine_args += ["--profile", cfg.engine_profile]
    interval_s = cfg.allocator_interval_s or max(5.0, 2 * stats_wall_s * speedup)
    allocator_args = [
        "--policy",
        cfg.policy,
        "--profile",
        "auto",  # what the engines report (EngineStats.profile)
        "--engines",
        str(cfg.engines),
        "--interval-s",
        str(interval_s),
        "--stale-after-s",
        str(max(5.0, 4 * stats_wall_s * speedup)),
    ]
    system = System(
        SystemConfig(
            nats_url=cfg.nats_url,
            engines=cfg.engines,
            backend=cfg.backend,
            model=cfg.model,
            extra_engine_args=engine_args,
            engine_roles=initial_roles(cfg.policy, cfg.engines, cfg.profile),
            extra_service_args={"allocator": allocator_args, "forecaster": cfg.forecaster_args},
            log_dir=cfg.log_dir,
        )
    ).start()
    supervision = asyncio.create_task(_supervise(system))
    try:
        from prorsa.commands.up import wait_healthy

        expected = system.expected_services()
        replies = await wait_healthy(
            system.url, "prorsa", expected, timeout_s=120.0, credentials=system.credentials("operator")
        )
        if sorted(r.service for r in replies) != sorted(expected):
            raise RuntimeError(f"system not healthy: expected {expected}, got {[r.service for r in replies]}")
        client = await RolloutClient.connect(system.url, credentials=system.credentials("trainer"))
        recorder = Recorder()
        await recorder.attach(client.nc, client.subjects)
        await asyncio.sleep(1.5)  # first EngineStats: lets the client route by affinity from turn 1
        driver = RolloutDriver(
            client,
            RolloutConfig(
                steps=cfg.steps,
                mode=cfg.mode,
                staleness=cfg.staleness,
                training_s=cfg.training_s,
                send_token_ids=cfg.backend != "sim",
                token_scale=cfg.token_scale,
                seed=cfg.seed,
            ),
            progress,
        )
        if started is not None:
            await started(system)
        metrics = await driver.run(steps)
        if finished is not None:
            await finished(system)
        metrics.role_switches = recorder.role_switches
        await client.close()
        durations = [r.duration_s for r in metrics.records.values() if r.completed]
        return LiveResult(metrics.summary(), recorder, list(workload.notes), durations)
    finally:
        supervision.cancel()
        system.stop()


async def _supervise(system: System, interval_s: float = 0.2) -> None:
    """Restart a child that dies during the rollout (as `prorsa up` does), logging each exit and restart."""
    from prorsa.supervisor import Exit

    while True:
        for ev in system.supervise():
            if isinstance(ev, Exit):
                log.warning(
                    "child_exited",
                    child=ev.key,
                    rc=ev.returncode,
                    restart_in_s=ev.delay_s,
                    crash_loop=ev.crash_loop,
                )
            else:
                log.info("child_restarted", child=ev.key, restarts=ev.restarts)
        await asyncio.sleep(interval_s)
