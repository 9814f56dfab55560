"""Role switching of a simulated engine (`SimEngine` calls these), by the live agent's rule (`switch_rule`).

`request_switch(role, now, epoch)` asks `switch_rule.switch_kind` whether the new role's layout is the engine's own
(the run's `SimConfig.restart_roles` names those that differ; by default none do, as with kv_both engines):

* In place: the engine leaves the router's pools and pulls nothing (state SWITCHING) for `role_switch_s`, while
  what it holds — queued and started prompts, decodes, handoffs whose KV is on its way — runs on as the engine core
  steps it (a prefill engine's prompts still hand their KV on). Then it serves the new role and pulls its work; its
  prefix cache stays. An engine switching to prefill (`switch_rule.hands_on_decodes`) hands on, at its next step
  boundary (`hand_on_decodes`), the answers it decodes that `plan_drain` does not expect to end within the drain
  bound: each leaves the batch with its KV kept in the prefix cache and is addressed back to this engine, which
  prefills it from that cache once it serves as prefill and hands it to a decode engine.
* Restart: the engine leaves the pools (queued, unstarted prompts are re-routed), finishes prefills in progress
  (`job_fate`: a prefill finishes) and, at its first step boundary, keeps a decode if `plan_drain` expects it to
  end within `drain_bound_s`, from the engine's `OutputEstimate` — never from the turn's true length, which no
  live engine knows; the others migrate (re-queued for prefill with their context recomputed: `Simulation.migrate`
  routes them by the affinity rule, so a turn whose prefix a prefill engine holds goes there). A decode kept that
  still runs when the bound passes migrates then, as the live agent hands on its late jobs. Handoffs that arrive
  while draining are forwarded to another decode engine, and a mixed engine hands a prompt it prefilled while
  draining to a decode engine with its KV. Drained, it restarts for the profile's `engine_start_s`, loses its
  prefix cache and rejoins in its new role.

A command that arrives mid-switch retargets it: a restart under way (RECONFIG) just restarts into the newest role;
a drain or an in-place pause back to the current role ends at once (nothing to do); one that needs a restart
while switching in place becomes a drain.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from prorsa.sim import events as ev
from services.engine_agent.engine_core import ACTIVE, DRAINING, RECONFIG, SWITCHING
from services.engine_agent.switch_rule import DrainItem, hands_on_decodes, plan_drain, switch_kind
from services.runtime import perf_model as pm

if TYPE_CHECKING:
    from prorsa.sim.engine import SimEngine
    from prorsa.sim.state import Request

__all__ = [
    "drain_plan",
    "hand_on_decodes",
    "migrate_long_decodes",
    "on_reconfig_done",
    "request_switch",
    "start_reconfig",
]


def request_switch(
    engine: SimEngine, role: str, now: float, epoch: int = 0, drain_bound_s: float | None = None
) -> None:
    """Start moving to `role` under command `epoch` (see the module docstring); the engine reports `epoch` as
    applied once it serves `role`. `drain_bound_s`: the command's drain timeout (None: the run's)."""
    engine.pending_epoch = max(engine.pending_epoch, epoch)
    engine.drain_bound_s = engine.sim.config.drain_bound_s if drain_bound_s is None else drain_bound_s
    state = engine.state
    if state == RECONFIG:
        engine.target_role = role
        return
    if role == engine.role:
        if state != ACTIVE:  # switched back before anything changed: serve on
            _resume(engine, now)
        return
    engine.target_role = role
    if switch_kind(role, engine.restart_roles) == "in_place":
        if state != SWITCHING:  # (already switching in place: it goes on, to the newest target)
            if state == ACTIVE:
                engine.router.engine_leaving(engine, now)
            engine.state = SWITCHING  # a drain for a restart no longer needed stops draining
            engine.metrics.role_change(now, engine.role, "switching", engine.engine_id)
            engine.switch_token += 1
            engine._push(now + pm.role_switch_time_s(engine.p), ev.RECONFIG_DONE, engine, engine.switch_token)
        if hands_on_decodes(role) and engine.seqs:
            engine.hand_on_due = True
            engine._poke(now)  # at the next step boundary (now, if idle)
        return
    if state == SWITCHING:  # an in-place pause becomes a drain: its completion is void
        engine.switch_token += 1
        engine.metrics.role_change(now, "switching", engine.role, engine.engine_id)
    elif state == ACTIVE:
        engine.router.engine_leaving(engine, now)
    engine.state = DRAINING
    if state != DRAINING:
        engine.drain_decided = engine.drain_expired = False
        engine.switch_token += 1  # its timer: the drain bound
        engine._push(now + engine.drain_bound_s, ev.RECONFIG_DONE, engine, engine.switch_token)
        requeue = list(engine.queue)
        engine.queue.clear()
        engine.queued_tokens = 0
        for req in requeue:
            if not req.cancelled:
                engine.router.route_prefill(cast("Request", req), now)
    engine._poke(now)


def _resume(engine: SimEngine, now: float) -> None:
    """A switch back to the role the engine still has, before anything changed: it serves on at once."""
    if engine.state == SWITCHING:
        engine.metrics.role_change(now, "switching", engine.role, engine.engine_id)
    engine.switch_token += 1  # a pending in-place completion is void
    engine.epoch = engine.pending_epoch
    engine.state, engine.target_role = ACTIVE, ""
    engine.router.engine_available(engine, now)
    engine._poke(now)


def drain_plan(engine: SimEngine, now: float) -> list[Request]:
    """The decodes a draining engine hands on (`switch_rule.plan_drain` on what it knows: each answer's output so
    far, the step time of its batch, its `OutputEstimate`)."""
    if not engine.seqs:
        return []
    batch = len(engine.seqs)
    step_s = engine._cost.decode_step_s(batch, engine._ctx_base + batch * engine.steps_done)
    by_rid: dict[int, Request] = {}
    items: list[DrainItem] = []
    for seq in engine.seqs.values():
        req = cast("Request", seq)
        # The turn's output so far: what earlier engines streamed before it migrated here (a migrated request's
        # context carries it past the turn's prompt, `Simulation.migrate`), plus this engine's.
        resumed = req.context_tokens - req.traj.context_tokens
        by_rid[req.rid] = req
        items.append(DrainItem(str(req.rid), resumed + engine.decoded_so_far(req), 0, step_s))
    _, leaving = plan_drain(items, engine.output_estimate, engine.drain_bound_s)
    return [by_rid[int(rid)] for rid in leaving]


def hand_on_decodes(engine: SimEngine, now: float) -> None:
    """At the first step boundary of an engine switching in place to prefill: each answer it decodes that
    `drain_plan` would not keep leaves with its KV cached here and is addressed back to this engine, to be
    prefilled from that cache once it serves as prefill (`switch_rule.hands_on_decodes`; the live agent's
    `switch_drain.hand_on_in_place`)."""
    if not engine.hand_on_due:
        return
    engine.hand_on_due = False
    if engine.target_role != "prefill" or not engine.seqs:
        return  # retargeted meanwhile: nothing to hand on
    for req in drain_plan(engine, now):
        decoded = engine.release_decode(req, now)
        engine.sim.migrate(req, engine, decoded, now, home=engine)
    engine._forget_finishes()


def migrate_long_decodes(engine: SimEngine, now: float) -> None:
    """At a draining engine's step boundary: the first hands on the decodes `drain_plan` does not keep; the first
    after the drain bound, every decode still running."""
    if engine.drain_expired:
        leaving = [cast("Request", seq) for seq in engine.seqs.values()]
    elif not engine.drain_decided:
        engine.drain_decided = True
        leaving = drain_plan(engine, now)
    else:
        return
    for req in leaving:
        decoded = engine.decoded_so_far(req)
        engine._leave_batch(req)
        engine.sim.migrate(req, engine, decoded, now)
    if leaving:
        engine._forget_finishes()


def start_reconfig(engine: SimEngine, now: float) -> None:
    """Drained for a restart: the engine restarts (the profile's `engine_start_s`), doing nothing meanwhile."""
    engine.state = RECONFIG
    engine.metrics.role_change(now, engine.role, "switching", engine.engine_id)
    engine.switch_token += 1
    engine._push(now + pm.engine_start_time_s(engine.p), ev.RECONFIG_DONE, engine, engine.switch_token)


def on_reconfig_done(engine: SimEngine, token: int, now: float) -> None:
    """The timer of the switch named by `token` fires: a drain's bound passes (what still runs is handed on at the
    next step boundary), or an in-place pause or a restart ends (the engine serves the target role)."""
    if token != engine.switch_token:
        return
    if engine.state == DRAINING:
        engine.drain_expired = True
        engine._poke(now)
        return
    restarted = engine.state == RECONFIG
    engine.metrics.role_change(now, "switching", engine.target_role, engine.engine_id)
    engine.metrics.role_switches += 1
    engine.set_role(engine.target_role)
    if restarted:
        engine.cache.clear()  # a restarted engine starts with an empty KV cache
    engine.target_role, engine.state, engine.epoch = "", ACTIVE, engine.pending_epoch
    engine.router.engine_available(engine, now)
    engine._poke(now)
