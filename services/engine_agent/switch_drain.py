"""The I/O side of a role switch and of a graceful stop (the epoch decision is `role_state`'s, the rule
`switch_rule`'s, which the simulator's engines run too).

A switch (pulling is already paused by the caller, and resumes in the new role when this returns):
* **In place** (the backend's `restart_roles` does not name the new role): the backend takes the new role
  (`set_role`: the sim backend pauses for the profile's `role_switch_s`, vLLM has nothing to do). Held jobs run on
  as the kind they were pulled as — a prefill hands its KV on, a prompt not prefilled yet stays what it was pulled
  as — except on a switch to prefill (`switch_rule.hands_on_decodes`): every answer being decoded here (it has
  streamed tokens) that `plan_drain` does not keep is stopped first and migrates to this engine's own prefill
  queue (`hand_on_in_place`), which the engine pulls once it serves as prefill, prefilling it from its prefix cache
  and handing its KV to a decode engine. A message a fetch still in flight delivers for the old role goes back to
  its queue (`puller.py`). A decode engine's addressed queue is forwarded to the shared prefill queue by its
  own-queue loop.
* **Restart** (another layout): the engine drains, then restarts —
  1. wait until no fetch is in flight;
  2. prompts queued for this engine by address move to the shared prefill queue if the new role is decode;
  3. prefills finish; every request that decodes here, or would once prefilled, finishes if `plan_drain`
     expects it to end within the command's `drain_timeout_s` (from the engine's `OutputEstimate` and each
     request's observed inter-token time) and migrates otherwise — to the engine holding its prefix when that
     engine still takes prompts (`AddressedRescue.takes_prompts`), else to the shared queue; a request that
     streamed nothing goes back to its queue unchanged;
  4. requests still running when the drain timeout passes are handed on too, so a switch takes bounded time;
  5. the engine holds nothing: the backend restarts in the new layout (`set_role`).
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
from services.engine_agent.switch_rule import DrainItem, hands_on_decodes, job_fate, plan_drain, switch_kind

HAND_ON_TIMEOUT_S = 10.0  # wall: a stopped job publishes one message and acks, seconds are plenty


async def run_switch(agent: Any, cmd: RoleSwitchCommand) -> tuple[int, int]:
    """Switch `agent` (an EngineAgent) to `cmd.role`, in place or by a restart (the module docstring).
    Returns (migrated requests, drained requests); in place nothing drains, and only a switch to prefill migrates
    (its decodes, back to this engine)."""
    if switch_kind(cmd.role, agent.backend.stats().restart_roles) == "in_place":
        old = agent.role
        migrated = await hand_on_in_place(agent, cmd) if hands_on_decodes(cmd.role) else 0
        await agent.backend.set_role(cmd.role)
        agent.log.info(
            "role_switched_in_place",
            old=old,
            new=cmd.role,
            epoch=cmd.epoch,
            held=len(agent.runner.jobs),
            migrated=migrated,
        )
        return migrated, 0
    return await drain_for_restart(agent, cmd)


async def hand_on_in_place(agent: Any, cmd: RoleSwitchCommand) -> int:
    """Before an in-place switch to prefill: stop each answer being decoded here that `plan_drain` does not expect
    to end within `cmd.drain_timeout_s`, and address it back to this engine's own prefill queue
    (`switch_rule.hands_on_decodes` says why). Returns how many migrated."""
    runner = agent.runner
    decoding = {
        j.request_id: j for j in runner.jobs.values() if j.kind != "prefill" and j.streamed_ids and not j.stop
    }
    _, leaving = plan_drain(
        _drain_items(runner, list(decoding.values())), runner.output_estimate, cmd.drain_timeout_s
    )
    jobs = [decoding[i] for i in leaving]
    if not jobs:
        return 0
    # A fetch of the own queue still in flight would take a migrated request in the old role (a decode engine's
    # forwards it to the shared queue, a mixed engine's would decode it here again): let it end first.
    await agent.puller.wait_idle()
    for job in jobs:
        job.hand_on_to = agent.engine_id  # its prompt and the tokens streamed so far are cached here
        await runner.stop_job(job)
    await wait_jobs(jobs, HAND_ON_TIMEOUT_S)
    return sum(j.outcome == "migrated" for j in jobs)


async def drain_for_restart(agent: Any, cmd: RoleSwitchCommand) -> tuple[int, int]:
    """Steps 1-5 of a restart. Returns (migrated requests, drained requests)."""
    runner, puller = agent.runner, agent.puller
    old, new = agent.role, cmd.role
    await puller.wait_idle()
    if old != "decode" and new == "decode":
        await puller.forward_addressed()
    jobs: list[Job] = list(runner.jobs.values())
    by_id = {j.request_id: j for j in jobs}
    finishing = [j for j in jobs if job_fate(j.kind) == "finish"]
    items = _drain_items(runner, [j for j in jobs if job_fate(j.kind) == "drain"])
    finish_ids, migrate_ids = plan_drain(items, runner.output_estimate, cmd.drain_timeout_s)
    finishing += [by_id[i] for i in finish_ids]
    movers = [by_id[i] for i in migrate_ids]
    for job in movers:
        await _move(agent, job)
    await wait_jobs(finishing, agent.clock.wall_s(cmd.drain_timeout_s))
    late = [j for j in finishing if not _ended(j)]
    for job in late:
        await _move(agent, job)
    await wait_jobs(movers + late, HAND_ON_TIMEOUT_S)
    migrated = sum(j.outcome in ("migrated", "requeued") for j in jobs)
    drained = sum(j.outcome in ("finished", "handed_off") for j in jobs)
    agent.log.info(
        "role_drained", old=old, new=new, epoch=cmd.epoch, migrated=migrated, drained=drained, late=len(late)
    )
    await agent.backend.set_role(new)
    return migrated, drained


def _drain_items(runner: Any, jobs: list[Job]) -> list[DrainItem]:
    """What `plan_drain` needs of each job: its output so far, its cap and its observed inter-token time."""
    return [
        DrainItem(j.request_id, j.output_tokens, j.request.sampling.max_tokens, runner.s_per_token(j))
        for j in jobs
    ]


async def _move(agent: Any, job: Job) -> None:
    """Stop a job so that it hands its work on, towards the engine that holds its prefix where one takes it: the
    prefill engine that handed a decode over (this engine's own cache goes with the restart)."""
    home = job.prefill_engine
    if home and home != agent.engine_id and agent.rescue.takes_prompts(home):
        job.hand_on_to = home
    await agent.runner.stop_job(job)


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
