"""Role switching of a simulated engine: drain, reconfigure, rejoin (mixed into `SimEngine`).

`request_switch(role, now, epoch)`: the engine leaves the router's pools (queued, unstarted prompts are re-routed),
finishes prefills in progress, keeps decodes expected to finish within `drain_bound_s` and migrates the others
(re-queued for prefill elsewhere with their context recomputed); handoffs that arrive while draining are forwarded
to another decode engine. Drained, it reconfigures for `role_switch_s` and rejoins in its new role; its prefix
cache survives unless the new role is `decode`. A switch back to the current role before reconfiguration starts cancels it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prorsa.sim import events as ev
from services.engine_agent.engine_core import ACTIVE, DRAINING, RECONFIG
from services.runtime import perf_model as pm

if TYPE_CHECKING:
    from prorsa.sim.engine import SimEngine

__all__ = ["ACTIVE", "DRAINING", "RECONFIG", "RoleSwitching"]


class RoleSwitching:
    """The switching half of `SimEngine` (state lives there; no slots of its own, so engines keep theirs)."""

    __slots__ = ()

    def request_switch(
        self: SimEngine, role: str, now: float, epoch: int = 0, drain_bound_s: float | None = None
    ) -> None:
        """Start moving to `role` under command `epoch` (see the module docstring for the draining rules); the
        engine reports `epoch` as applied once it serves `role`. `drain_bound_s`: the command's drain timeout
        (None: the run's `drain_bound_s`)."""
        self.pending_epoch = max(self.pending_epoch, epoch)
        self.drain_bound_s = self.sim.config.drain_bound_s if drain_bound_s is None else drain_bound_s
        if self.state == RECONFIG:
            self.target_role = role
            return
        if role == self.role:
            if self.state == DRAINING:  # switch cancelled before it happened
                self.epoch = self.pending_epoch
                self.state, self.target_role = ACTIVE, ""
                self.router.engine_available(self, now)
                self._poke(now)
            return
        first = self.state == ACTIVE
        self.state, self.target_role = DRAINING, role
        if first:
            self.router.engine_leaving(self, now)
            requeue = list(self.queue)
            self.queue.clear()
            self.queued_tokens = 0
            for req in requeue:
                if not req.cancelled:
                    self.router.route_prefill(req, now)
        self._poke(now)

    def _migrate_long_decodes(self: SimEngine, now: float) -> None:
        if not self.seqs:
            return
        batch = len(self.seqs)
        step_s = self._cost.decode_step_s(batch, self._ctx_base + batch * self.steps_done)
        bound = self.drain_bound_s
        leaving = [r for r in self.seqs.values() if (r.target_step - self.steps_done) * step_s > bound]
        for req in leaving:
            decoded = self.decoded_so_far(req)
            self._leave_batch(req)
            self.sim.migrate(req, self, decoded, now)
        if leaving:
            self._forget_finishes()

    def _start_reconfig(self: SimEngine, now: float) -> None:
        self.state = RECONFIG
        self.metrics.role_change(now, self.role, "switching", self.engine_id)
        self._token += 1
        self._push(now + pm.role_switch_time_s(self.p), ev.RECONFIG_DONE, self, self._token)

    def on_reconfig_done(self: SimEngine, token: int, now: float) -> None:
        if token != self._token:
            return
        self.metrics.role_change(now, "switching", self.target_role, self.engine_id)
        self.metrics.role_switches += 1
        self.set_role(self.target_role)  # drained: nothing holds KV
        self.target_role, self.state, self.epoch = "", ACTIVE, self.pending_epoch
        self.router.engine_available(self, now)
        self._poke(now)
