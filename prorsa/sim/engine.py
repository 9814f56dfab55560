"""One simulated engine in the simulator: the engine core that ships, woken by the event loop.

The rules (roles, steps, jumps, KV, prefix cache) are `services.engine_agent.engine_core.EngineCore`'s, the same
class the live simulated engine agent runs. This driver fills in the core's hooks with the simulator's side:
wake-ups go on the event heap, a prompt prefilled on a prefill engine goes to the router, a handoff's KV arrives
by a `HANDOFF_ARRIVE` event, a finished turn goes to the RL driver, and lifecycle events go to an observer when one
is attached. The core counts the work done into the run's `Metrics` itself (its `tally`).

Switching (`request_switch`: in place, or drain → restart → rejoin) lives in `prorsa.sim.engine_switching`; the
rule is `services.engine_agent.switch_rule`'s, which the live agent runs too.
"""

from __future__ import annotations

from heapq import heappush
from typing import TYPE_CHECKING, cast

from mypy_extensions import mypyc_attr

from prorsa.sim import engine_switching as switching
from prorsa.sim import events as ev
from proto import EngineStats
from services.engine_agent.engine_core import (
    ACTIVE,
    DRAINING,
    IDLE,
    JUMP,
    RECONFIG,
    SWITCHING,
    CoreSeq,
    EngineCore,
)
from services.engine_agent.pull_capacity import PullEstimates
from services.engine_agent.switch_rule import OutputEstimate
from services.runtime.perf_model import ModelProfile

if TYPE_CHECKING:
    from prorsa.sim.core import Simulation
    from prorsa.sim.state import Request

__all__ = ["ACTIVE", "DRAINING", "IDLE", "JUMP", "RECONFIG", "SWITCHING", "SimEngine"]

ENGINE_WAKE, HANDOFF_ARRIVE = ev.ENGINE_WAKE, ev.HANDOFF_ARRIVE


@mypyc_attr(allow_interpreted_subclasses=True)  # deep-copied by `Simulation.fork` (see `prorsa.native`)
class SimEngine(EngineCore):
    """An engine core inside the simulator. All methods take the current virtual time `now`."""

    __slots__ = tuple(  # one expression: mypy cannot type a tuple grown by `+=` (`prorsa.native_build`)
        "engine_id sim router metrics target_role _push _heap _due _more driver epoch"  # noqa: SIM905
        " pending_epoch drain_bound_s pull_estimates decode_due_s decode_check_pending output_estimate"
        " restart_roles switch_token drain_decided drain_expired hand_on_due".split()
    )

    def __init__(self, engine_id: str, profile: ModelProfile, role: str, sim: Simulation) -> None:
        super().__init__(profile, role)
        self.engine_id = engine_id
        self.sim = sim
        self.router = sim.router
        self.metrics = sim.metrics
        self.busy_s = sim.metrics.busy_s  # role → busy seconds, shared by every engine
        self.tally = sim.metrics  # the run's token counts and rows, shared by every engine
        self._push = sim.queue.push
        # For the per-step wake-ups, which inline `EventQueue.push`.
        self._heap, self._due, self._more = sim.queue.heap, sim.queue.due, sim.queue.more
        self.observed = sim.observer is not None  # lifecycle events to emit (set again by Simulation.run)
        # A finished turn goes to the driver: held as an attribute, not as its bound method, which a fork's copy
        # would share when compiled (and report to the original run).
        self.driver = sim.driver
        self.target_role = ""
        self.epoch = 0  # newest role-switch command applied (what its stats would report)
        self.pending_epoch = 0  # newest command received
        self.drain_bound_s = sim.config.drain_bound_s  # the switch command's drain timeout
        # Placement state the router keeps per engine (the live agent's pull loops hold the same).
        self.pull_estimates = PullEstimates()
        self.decode_due_s = 0.0  # a mixed engine's next look at the handoff queue
        self.decode_check_pending = False
        # What a switch knows of answer lengths: the answers this engine saw finish, as the live agent's runner.
        self.output_estimate = OutputEstimate()
        # Roles whose layout differs from this engine's: a switch to one restarts it (`switch_rule`).
        self.restart_roles: tuple[str, ...] = sim.config.restart_roles
        self.switch_token = 0  # names the switch in progress: a completion event of an older one is stale
        self.hand_on_due = False  # switching in place to prefill: its decodes go at the next step boundary
        self.drain_decided = False  # a restart's drain chose the decodes that stay (once, as the live agent)
        self.drain_expired = False  # its drain bound has passed: whatever still runs is handed on

    def stats(
        self, now: float, prefill_tokens_per_s: float = 0.0, decode_tokens_per_s: float = 0.0
    ) -> EngineStats:
        """What this engine's agent would publish now (`EngineAgent.stats_snapshot`); the token rates are the
        caller's, over the interval it measures. Tokens in flight count as the job runner counts them
        (`JobRunner.in_flight_tokens`): whole contexts of prompts not yet prefilled, outputs not yet generated by
        what decodes here (handoffs whose KV is still in transfer are left out: milliseconds)."""
        in_flight = self.decode_tokens_left()
        for seq in self.arrivals:
            in_flight += seq.output_tokens - 1
        mixed = self.role == "mixed"
        for prompts in (self.queue, self.active):
            for seq in prompts:
                in_flight += seq.context_tokens + (seq.output_tokens if mixed else 0)
        return EngineStats(
            engine_id=self.engine_id,
            ts_s=now,
            role=self.role,  # type: ignore[arg-type]
            epoch=self.epoch,
            running=len(self.seqs) + len(self.active),
            waiting=len(self.queue) + len(self.arrivals) + self.incoming,
            kv_used_tokens=self.kv_reserved,
            kv_capacity_tokens=self.p.kv_capacity_tokens,
            prefill_tokens_per_s=prefill_tokens_per_s,
            decode_tokens_per_s=decode_tokens_per_s,
            switching=self.state != ACTIVE,
            in_flight_tokens=in_flight,
            prefix_cache_tokens=self.cache.used_tokens,
            addressed_waiting=len(self.own_prompts),
            restart_roles=list(self.restart_roles),  # type: ignore[arg-type]
        )

    # -- the core's hooks ---------------------------------------------------------------------------------------

    def _wake_at(self, t: float, token: int) -> None:
        """Schedule this engine's wake-up at `t` (`EventQueue.push` for engines, inlined: once per step)."""
        if t in self._due:
            ev.push_more(self._more, t, (ENGINE_WAKE, self, token))
        else:
            self._due[t] = (ENGINE_WAKE, self, token)
            heappush(self._heap, t)

    def enqueue_prefill(self, seq: CoreSeq, now: float) -> None:
        """Queue a prompt pulled now: a prefill engine's prompt decodes elsewhere (the live job kind, fixed at the
        pull: it stays so through a switch)."""
        seq.remote = self.role == "prefill"
        EngineCore.enqueue_prefill(self, seq, now)

    def take_prompt(self, seq: CoreSeq) -> None:
        seq.remote = self.role == "prefill"
        EngineCore.take_prompt(self, seq)

    def _hand_off(self, seq: CoreSeq, now: float) -> None:
        self.router.handoff(cast("Request", seq), now)  # the simulator's engines hold its requests

    def _hands_off_while_draining(self) -> bool:
        return self.router.has_decode_engines()

    def accept_handoff(self, seq: CoreSeq, now: float) -> float:
        """Pull a prefilled request: reserve its KV and start the transfer (its arrival is an event)."""
        arrive = EngineCore.accept_handoff(self, seq, now)
        self.metrics.handoffs += 1
        self._push(arrive, HANDOFF_ARRIVE, self, seq)
        return arrive

    def _on_prefill_done(self, seq: Request, now: float) -> None:  # type: ignore[override]
        last = seq.traj.last_engine
        # Sent away from the engine that prefilled its last turn: the live agent's `PrefillDone.away`.
        if last is not None and last is not self and not seq.migrated:
            self.metrics.away_prefills += 1
            self.metrics.away_computed_tokens += seq.to_compute_tokens
        seq.traj.last_engine = self
        if self.observed:
            self.sim.on_prefill_done(seq, self, now)

    def _on_decode_started(self, seq: Request, now: float) -> None:  # type: ignore[override]
        self.sim.on_decode_started(seq, self, now)

    def _on_progress(self, now: float) -> None:
        self.sim.emit_decode_progress(self, now)

    def _on_finished(self, seq: CoreSeq, now: float) -> None:
        req = cast("Request", seq)
        # The whole answer, as the live runner counts a finished job's output (resumed tokens included).
        self.output_estimate.observe(req.traj.spec.turns[req.turn].output_tokens)
        self.driver.on_turn_done(req, now)

    def _pull_handoffs(self, now: float) -> None:
        self.router.pull_handoffs(self, now)

    def _pull_prompts(self, now: float) -> None:
        self.router.pull_prompts(self, now)

    def _switching(self, now: float) -> None:
        switching.hand_on_decodes(self, now)

    def _drain(self, now: float) -> None:
        switching.migrate_long_decodes(self, now)

    def _on_drained(self, now: float) -> None:
        switching.start_reconfig(self, now)

    # -- switching (`prorsa.sim.engine_switching`) --------------------------------------------------------------

    def request_switch(
        self, role: str, now: float, epoch: int = 0, drain_bound_s: float | None = None
    ) -> None:
        """Start moving to `role` under command `epoch` (`engine_switching.request_switch`)."""
        switching.request_switch(self, role, now, epoch, drain_bound_s)

    def on_reconfig_done(self, token: int, now: float) -> None:
        switching.on_reconfig_done(self, token, now)
