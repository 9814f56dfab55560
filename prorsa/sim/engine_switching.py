"""Role switching of a simulated engine: drain, reconfigure, rejoin (`SimEngine` calls these).

The rule is the live agent's (`services.engine_agent.role_state`): an engine drains to idle before it
reconfigures, whatever the new role. `request_switch(role, now, epoch)`: the engine leaves the router's pools
(queued, unstarted prompts are re-routed) and finishes prefills in progress (`job_fate`: a prefill finishes); a
decode stays if `finishes_in_drain` within `drain_bound_s` and migrates otherwise (re-queued for prefill
elsewhere with its context recomputed). Handoffs that arrive while draining are forwarded to another decode engine,
and a mixed engine hands a prompt it prefilled while draining to a decode engine with its KV (a live mixed request
is one generate call, which cannot move its KV: it finishes or migrates as a decode). Drained, it reconfigures for
`role_switch_s` and rejoins in its new role; its prefix cache survives unless the new role is `decode`. A switch
back to the current role before reconfiguration starts cancels it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from prorsa.sim import events as ev
from services.engine_agent.engine_core import ACTIVE, DRAINING, RECONFIG
from services.engine_agent.role_state import finishes_in_drain
from services.runtime import perf_model as pm

if TYPE_CHECKING:
    from prorsa.sim.engine import SimEngine
    from prorsa.sim.state import Request

__all__ = ["migrate_long_decodes", "on_reconfig_done", "request_switch", "start_reconfig"]


def request_switch(
    engine: SimEngine, role: str, now: float, epoch: int = 0, drain_bound_s: float | None = None
) -> None:
    """Start moving to `role` under command `epoch` (see the module docstring for the draining rules); the
    engine reports `epoch` as applied once it serves `role`. `drain_bound_s`: the command's drain timeout
    (None: the run's `drain_bound_s`)."""
    engine.pending_epoch = max(engine.pending_epoch, epoch)
    engine.drain_bound_s = engine.sim.config.drain_bound_s if drain_bound_s is None else drain_bound_s
    if engine.state == RECONFIG:
        engine.target_role = role
        return
    if role == engine.role:
        if engine.state == DRAINING:  # switch cancelled before it happened
            engine.epoch = engine.pending_epoch
            engine.state, engine.target_role = ACTIVE, ""
            engine.router.engine_available(engine, now)
            engine._poke(now)
        return
    first = engine.state == ACTIVE
    engine.state, engine.target_role = DRAINING, role
    if first:
        engine.router.engine_leaving(engine, now)
        requeue = list(engine.queue)
        engine.queue.clear()
        engine.queued_tokens = 0
        for req in requeue:
            if not req.cancelled:
                engine.router.route_prefill(cast("Request", req), now)
    engine._poke(now)


def migrate_long_decodes(engine: SimEngine, now: float) -> None:
    if not engine.seqs:
        return
    batch = len(engine.seqs)
    step_s = engine._cost.decode_step_s(batch, engine._ctx_base + batch * engine.steps_done)
    bound = engine.drain_bound_s
    done = engine.steps_done
    leaving = [r for r in engine.seqs.values() if not finishes_in_drain(r.target_step - done, step_s, bound)]
    for req in leaving:
        decoded = engine.decoded_so_far(req)
        engine._leave_batch(req)
        engine.sim.migrate(cast("Request", req), engine, decoded, now)
    if leaving:
        engine._forget_finishes()


def start_reconfig(engine: SimEngine, now: float) -> None:
    engine.state = RECONFIG
    engine.metrics.role_change(now, engine.role, "switching", engine.engine_id)
    engine._token += 1
    engine._push(now + pm.role_switch_time_s(engine.p), ev.RECONFIG_DONE, engine, engine._token)


def on_reconfig_done(engine: SimEngine, token: int, now: float) -> None:
    if token != engine._token:
        return
    engine.metrics.role_change(now, "switching", engine.target_role, engine.engine_id)
    engine.metrics.role_switches += 1
    engine.set_role(engine.target_role)  # drained: nothing holds KV
    engine.target_role, engine.state, engine.epoch = "", ACTIVE, engine.pending_epoch
    engine.router.engine_available(engine, now)
    engine._poke(now)
