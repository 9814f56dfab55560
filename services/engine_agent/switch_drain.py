"""The I/O side of a role switch and of a graceful stop: drain or hand on what the engine holds.

A switch (the epoch decision is `role_state`'s; this only executes an accepted command) drains the engine to idle,
whatever the new role — the rule the simulator's engines run too (`role_state.job_fate`):
1. pulling is already paused by the caller; wait until no fetch is in flight;
2. prompts queued for this engine by address (`work.prefill.engine.<id>`, the only addressed queue) move to the
   shared prefill queue if the new role is decode, which does not prefill;
3. prefills finish (the batch completes); every request that decodes here, or would once prefilled, finishes if
   expected to end within the command's `drain_timeout_s` and migrates otherwise (`pull_capacity.plan_drain`, from
   each request's observed inter-token time) — a prompt that streamed nothing goes back to the prefill queue
   unchanged;
4. requests still running when the drain timeout passes are handed on too, so a switch takes bounded time;
5. the engine holds nothing: the backend reconfigures (`set_role`: the sim backend pays the profile's switch cost,
   a vLLM backend restarts only if the new role's settings differ).
A graceful stop hands on everything at once: nothing the engine held is lost, and migrated streams stay exact
(a crash instead relies on JetStream redelivery).

Timeouts: a command's `drain_timeout_s` bounds generation, so it is in scaled seconds (the agent's `clock`, like
the inter-token times `plan_drain` compares it with); the others bound I/O (a fetch, a publish) and are wall
seconds.
"""

from __future__ import annotations

import asyncio
from typing import Any

from proto import RoleSwitchCommand
from services.engine_agent.jobs import Job
from services.engine_agent.pull_capacity import DrainItem, plan_drain
from services.engine_agent.role_state import job_fate

HAND_ON_TIMEOUT_S = 10.0  # wall: a stopped job publishes one message and acks, seconds are plenty


async def drain_for_switch(agent: Any, cmd: RoleSwitchCommand) -> tuple[int, int]:
    """Steps 1-5 above for `agent` (an EngineAgent). Returns (migrated requests, drained requests)."""
    runner, puller = agent.runner, agent.puller
    old, new = agent.role, cmd.role
    await puller.wait_idle()
    if old != "decode" and new == "decode":
        await puller.forward_addressed()
    jobs: list[Job] = list(runner.jobs.values())
    by_id = {j.request_id: j for j in jobs}
    finishing = [j for j in jobs if job_fate(j.kind) == "finish"]
    items = [
        DrainItem(j.request_id, j.remaining_tokens, runner.s_per_token(j))
        for j in jobs
        if job_fate(j.kind) == "drain"
    ]
    finish_ids, migrate_ids = plan_drain(items, cmd.drain_timeout_s)
    finishing += [by_id[i] for i in finish_ids]
    movers = [by_id[i] for i in migrate_ids]
    for job in movers:
        await runner.stop_job(job)
    await wait_jobs(finishing, agent.clock.wall_s(cmd.drain_timeout_s))
    late = [j for j in finishing if not _ended(j)]
    for job in late:
        await runner.stop_job(job)
    await wait_jobs(movers + late, HAND_ON_TIMEOUT_S)
    migrated = sum(j.outcome in ("migrated", "requeued") for j in jobs)
    drained = sum(j.outcome in ("finished", "handed_off") for j in jobs)
    agent.log.info(
        "role_drained", old=old, new=new, epoch=cmd.epoch, migrated=migrated, drained=drained, late=len(late)
    )
    await agent.backend.set_role(new)
    return migrated, drained


async def hand_off_all(agent: Any, timeout_s: float) -> int:
    """Graceful stop: stop pulling and hand on every held request. Returns how many were handed on."""
    agent.puller.pause("stop")
    await agent.puller.wait_idle(timeout_s)
    jobs: list[Job] = list(agent.runner.jobs.values())
    for job in jobs:
        await agent.runner.stop_job(job)
    await wait_jobs(jobs, timeout_s)
    return sum(j.outcome in ("migrated", "requeued") for j in jobs)


async def wait_jobs(jobs: list[Job], timeout_s: float) -> None:
    """Wait until `jobs` ended, at most `timeout_s` wall seconds."""
    tasks = [j.task for j in jobs if j.task is not None and not j.task.done()]
    if tasks:
        await asyncio.wait(tasks, timeout=max(0.0, timeout_s))


def _ended(job: Job) -> bool:
    return job.task is None or job.task.done()
