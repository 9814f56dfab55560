"""One simulated engine in the simulator: the engine core that ships, woken by the event loop.

The rules (roles, steps, jumps, KV, prefix cache) are `services.engine_agent.engine_core.EngineCore`'s, the same
class the live simulated engine agent runs. This driver fills in the core's hooks with the simulator's side:
wake-ups go on the event heap, a prompt prefilled on a prefill engine goes to the router, a handoff's KV arrives
by a `HANDOFF_ARRIVE` event, a finished turn goes to the RL driver, and lifecycle events go to an observer when one
is attached. The core counts the work done into the run's `Metrics` itself (its `tally`).

Switching (`request_switch`, drain → reconfigure → rejoin) lives in `prorsa.sim.engine_switching`, mixed in here.
"""

from __future__ import annotations

from heapq import heappush
from typing import TYPE_CHECKING

from prorsa.sim import events as ev
from prorsa.sim.engine_switching import RoleSwitching
from proto import EngineStats
from services.engine_agent.engine_core import ACTIVE, DRAINING, IDLE, JUMP, RECONFIG, CoreSeq, EngineCore
from services.engine_agent.pull_capacity import PullEstimates
from services.runtime.perf_model import ModelProfile

if TYPE_CHECKING:
    from prorsa.sim.core import Simulation
    from prorsa.sim.state import Request

__all__ = ["ACTIVE", "DRAINING", "IDLE", "JUMP", "RECONFIG", "SimEngine"]

ENGINE_WAKE, HANDOFF_ARRIVE = ev.ENGINE_WAKE, ev.HANDOFF_ARRIVE


class SimEngine(RoleSwitching, EngineCore):
    """An engine core inside the simulator. All methods take the current virtual time `now`."""

    __slots__ = ("engine_id", "sim", "router", "metrics", "target_role", "_push", "_heap", "_due", "_more")
    __slots__ += ("_turn_done", "epoch", "pending_epoch", "drain_bound_s")
    __slots__ += ("pull_estimates", "decode_due_s", "decode_check_pending")

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
        self._turn_done = sim.driver.on_turn_done
        self.target_role = ""
        self.epoch = 0  # newest role-switch command applied (what its stats would report)
        self.pending_epoch = 0  # newest command received
        self.drain_bound_s = sim.config.drain_bound_s  # the switch command's drain timeout
        # Placement state the router keeps per engine (the live agent's pull loops hold the same).
        self.pull_estimates = PullEstimates()
        self.decode_due_s = 0.0  # a mixed engine's next look at the handoff queue
        self.decode_check_pending = False

    def stats(self, now: float) -> EngineStats:
        """What this engine's agent would publish now (the fields the switch coordinator reads)."""
        return EngineStats(
            engine_id=self.engine_id,
            ts_s=now,
            role=self.role,  # type: ignore[arg-type]
            epoch=self.epoch,
            running=len(self.seqs) + len(self.active),
            waiting=len(self.queue) + len(self.arrivals) + self.incoming,
            kv_used_tokens=self.kv_reserved,
            kv_capacity_tokens=self.p.kv_capacity_tokens,
            switching=self.state != ACTIVE,
            in_flight_tokens=self.tokens_in_flight(),
        )

    # -- the core's hooks ---------------------------------------------------------------------------------------

    def _wake_at(self, t: float, token: int) -> None:
        """Schedule this engine's wake-up at `t` (`EventQueue.push` for engines, inlined: once per step)."""
        if t in self._due:
            ev.push_more(self._more, t, (ENGINE_WAKE, self, token))
        else:
            self._due[t] = (ENGINE_WAKE, self, token)
            heappush(self._heap, t)

    def _hand_off(self, seq: CoreSeq, now: float) -> None:
        self.router.handoff(seq, now)

    def _hands_off_while_draining(self) -> bool:
        return self.router.has_decode_engines()

    def accept_handoff(self, seq: CoreSeq, now: float) -> float:
        """Pull a prefilled request: reserve its KV and start the transfer (its arrival is an event)."""
        arrive = EngineCore.accept_handoff(self, seq, now)
        self.metrics.handoffs += 1
        self._push(arrive, HANDOFF_ARRIVE, self, seq)
        return arrive

    def _on_prefill_done(self, seq: Request, now: float) -> None:  # type: ignore[override]
        seq.traj.last_engine = self
        if self.observed:
            self.sim.on_prefill_done(seq, self, now)

    def _on_decode_started(self, seq: Request, now: float) -> None:  # type: ignore[override]
        self.sim.on_decode_started(seq, self, now)

    def _on_progress(self, now: float) -> None:
        self.sim.emit_decode_progress(self, now)

    def _on_finished(self, seq: CoreSeq, now: float) -> None:
        self._turn_done(seq, now)

    def _pull_handoffs(self, now: float) -> None:
        self.router.pull_handoffs(self, now)

    def _pull_prompts(self, now: float) -> None:
        self.router.pull_prompts(self, now)

    def _drain(self, now: float) -> None:
        self._migrate_long_decodes(now)

    def _on_drained(self, now: float) -> None:
        self._start_reconfig(now)
