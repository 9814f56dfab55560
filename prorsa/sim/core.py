"""The simulation: wires workload driver, router, engines, metrics and the allocator policy to one event loop.

Virtual time only: the loop pops the earliest event and dispatches it; nothing sleeps. The allocator policy runs
every `policy.interval_s` on a `ClusterView` built from the engines, exactly the seam the allocator service uses.
"""

from __future__ import annotations

import copy
import heapq
import itertools
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

from mypy_extensions import mypyc_attr

from prorsa.sim import events as ev
from prorsa.sim.engine import ACTIVE, SimEngine
from prorsa.sim.metrics import Metrics
from prorsa.sim.router import Router
from prorsa.sim.sim_driver import Driver, StepSource
from prorsa.sim.state import Request, Traj
from prorsa.sim.views import DemandFeed, ViewBuilder
from proto import RoleSwitchCommand
from services.allocator.policies.common import role_demand
from services.allocator.policy import AllocatorPolicy, ClusterView, FixedRolesPolicy
from services.allocator.switch_coordinator import SwitchCoordinator
from services.runtime.perf_model import ModelProfile

if TYPE_CHECKING:
    from prorsa.sim.runner import SimConfig


@mypyc_attr(allow_interpreted_subclasses=True)  # deep-copied by `Simulation.fork` (see `prorsa.native`)
class Simulation:
    """One run. Build it, call `run()`, read `metrics`, `driver`, `engines`."""

    def __init__(
        self,
        config: SimConfig,
        workload: StepSource,
        profile: ModelProfile,
        policy: AllocatorPolicy,
        observer: ev.SimObserver | None = None,
        feed: DemandFeed | None = None,
    ) -> None:
        self.config = config
        self.profile = profile
        self.policy = policy
        self.observer = observer
        self.queue = ev.EventQueue()
        self.metrics = Metrics(config.window_s)
        self.router = Router(self)
        self.driver = Driver(self, workload, config.steps)
        width = len(str(config.engines - 1))
        ids = [f"engine-{i:0{width}d}" for i in range(config.engines)]
        roles = policy.initial_plan(ids).roles
        self.engines: dict[str, SimEngine] = {}
        for engine_id in ids:
            engine = SimEngine(engine_id, profile, roles[engine_id], self)
            self.engines[engine_id] = engine
            self.metrics.role_change(0.0, None, engine.role, engine_id)
            self.router.engine_available(engine, 0.0)
            engine._poke(0.0)  # it pulls: nothing waits yet, so its fetches wait in line
        self.now = 0.0
        self.plans_applied = 0
        # The live allocator's gate on role switches (`apply_plan`); its commands carry the run's drain bound.
        self.coord = SwitchCoordinator(drain_timeout_s=config.drain_bound_s)
        self.feed = feed  # fills the views' forecast and snapshot (None: the policy reads neither)
        self._views = ViewBuilder(self, feed)
        self.events_processed = 0
        # A fixed-roles policy (colocated, static) only ever re-asserts its initial roles: while every engine
        # serves (or is heading for) its role there, its decision is known to be None without building a view.
        self._fixed_roles = dict(roles) if type(policy) is FixedRolesPolicy else None

    # -- the loop -----------------------------------------------------------------------------------------------

    def run(self) -> float:
        """Run to the end (all steps trained, or the duration cap); returns the end time in virtual seconds."""
        limit = self.config.duration_s if self.config.duration_s is not None else float("inf")
        for engine in self.engines.values():  # an observer may have been attached after construction
            engine.observed = self.observer is not None
        self.driver.start(0.0)
        self.queue.push(self.policy.interval_s, ev.POLICY_TICK)
        if limit < math.inf:  # the cap as an event, due just after it (events at the cap itself still run)
            self.queue.push(math.nextafter(limit, math.inf), ev.END)
        end = self._loop(limit)
        self.now = end
        self.metrics.finish(end)
        return end

    def fork(self, policy: AllocatorPolicy) -> Simulation:
        """An independent copy of this run at its current state, deciding with `policy` from now on (the
        hindsight oracle's look-ahead, `prorsa.sim.hindsight`). The workload, profile and config are shared:
        nothing in a run writes to them."""
        memo: dict[int, Any] = {id(self.policy): policy, id(self.config): self.config}
        memo[id(self.profile)] = self.profile
        memo[id(self.driver.workload)] = self.driver.workload
        copy.deepcopy(self.queue, memo)  # first: it rebinds the queue's push closure for everything after
        twin = copy.deepcopy(self, memo)
        # The driver keys live trajectories by id(): the copies have ids of their own.
        twin.driver.live_trajs = {id(t): t for t in twin.driver.live_trajs.values()}
        return twin

    def advance(self, until: float) -> float:
        """Run a started simulation (a fork) up to virtual time `until` or its end; returns where it stopped.
        The metrics are left open (`Metrics.finish` is not called): the run may go on."""
        if until > self.now:
            self.queue.push(until, ev.END)
            self.now = self._loop(until)
        return self.now

    def _loop(self, limit: float) -> float:
        """The event loop up to `limit` (an END event due then stops it); returns the time it stopped."""
        heap, due, more, driver = self.queue.heap, self.queue.due, self.queue.more, self.driver
        pop = heapq.heappop
        wake, arrival, handoff = ev.ENGINE_WAKE, ev.ARRIVAL, ev.HANDOFF_ARRIVE
        t, ties = 0.0, 0
        # Dispatch inlined (an if-chain by frequency beats a table of lambdas by one call per event); the loop
        # counts events popped, and ends when the queue is empty, at END, or when the last batch is trained.
        for events in itertools.count():
            try:
                t = pop(heap)
            except IndexError:
                break
            kind, a, b = due.pop(t)
            if more and t in more:  # several events due at exactly t: run them all, in order
                if t > limit:
                    t = limit
                    break
                ran, stopped = self._run_tied(t, [(kind, a, b), *more.pop(t)])
                ties += ran - 1
                if driver.finished_s is not None:
                    events += 1
                    break
                if stopped:
                    t = limit
                    break
                continue
            # The kind says what `a` is: the casts let the compiled loop call the engine natively (`prorsa.native`).
            if kind == wake:
                engine = cast(SimEngine, a)
                if cast(int, b) == engine._token:  # else superseded by a replan
                    engine.on_wake(t)
            elif kind == arrival:
                driver.on_arrival(cast(Traj, a), t)
            elif kind == handoff:
                cast(SimEngine, a).on_handoff_arrive(cast(Request, b), t)
            elif kind == ev.END:
                t = limit
                break
            else:
                self._dispatch(kind, a, b, t)
                if driver.finished_s is not None:
                    events += 1
                    break  # the last batch is trained
        events += ties
        self.events_processed += events
        return t if driver.finished_s is None else driver.finished_s

    def _run_tied(self, t: float, batch: list[tuple[int, Any, Any]]) -> tuple[int, bool]:
        """Run events due at the same time `t` in order, until the last batch is trained or an END (`advance`),
        which puts the events after it back; returns (how many ran, whether END stopped it)."""
        for n, (kind, a, b) in enumerate(batch, 1):
            if kind == ev.ENGINE_WAKE:
                engine = cast(SimEngine, a)
                if cast(int, b) == engine._token:
                    engine.on_wake(t)
            elif kind == ev.END:
                for event in batch[n:]:
                    self.queue.push(t, *event)
                return n, True
            else:
                self._dispatch(kind, a, b, t)
            if self.driver.finished_s is not None:
                return n, False
        return len(batch), False

    def _dispatch(self, kind: int, a: Any, b: Any, t: float) -> None:
        """The less frequent event kinds (and any kind, for events that tie in time)."""
        if kind == ev.ARRIVAL:
            self.driver.on_arrival(a, t)
        elif kind == ev.HANDOFF_ARRIVE:
            a.on_handoff_arrive(b, t)
        elif kind == ev.RECONFIG_DONE:
            a.on_reconfig_done(b, t)
            if a.state == ACTIVE:
                self._follow_up(t)
        elif kind == ev.POLICY_TICK:
            self._policy_tick(t)
        elif kind == ev.TRAINING_DONE:
            self.driver.on_training_done(a, t)
        elif kind == ev.DECODE_CHECK:
            self.router.on_decode_check(a, t)
        else:
            raise AssertionError(f"unknown event kind {kind}")

    # -- callbacks from engines ------------------------------------------------------------------------------------

    def on_prefill_done(self, req: Request, engine: SimEngine, now: float) -> None:
        if self.observer is not None:
            self.emit(
                ev.PREFILL_DONE,
                req.traj,
                now,
                turn=req.turn,
                engine_id=engine.engine_id,
                computed_tokens=req.to_compute_tokens,
                cached_tokens=req.hit_tokens,
                migrated=req.migrated,
            )

    def on_decode_started(self, req: Request, engine: SimEngine, now: float) -> None:
        if self.observer is not None:
            self.emit(
                ev.DECODE_STARTED,
                req.traj,
                now,
                turn=req.turn,
                engine_id=engine.engine_id,
                output_tokens=req.output_tokens,
            )

    def emit_decode_progress(self, engine: SimEngine, now: float) -> None:
        for seq in engine.seqs.values():
            req = cast(Request, seq)
            self.emit(
                ev.DECODE_PROGRESS,
                req.traj,
                now,
                turn=req.turn,
                engine_id=engine.engine_id,
                tokens=engine.decoded_so_far(req),
                of=req.output_tokens,
            )

    def migrate(
        self, req: Request, engine: SimEngine, decoded: int, now: float, home: SimEngine | None = None
    ) -> None:
        """A decode left a switching engine after `decoded` tokens: prefill its context again — addressed to `home`
        (an engine that holds it in its prefix cache), else routed as any turn is."""
        self.metrics.migrations += 1
        if req.cancelled:
            self.metrics.wasted_decoded_tokens += decoded
            return
        req.traj.decoded_tokens += decoded
        moved = Request(
            self.driver.new_rid(),
            req.traj,
            req.turn,
            req.context_tokens + decoded,
            req.output_tokens - decoded,
            migrated=True,
        )
        req.traj.request = moved
        if self.observer is not None:
            self.emit(
                ev.REQUEST_MIGRATED,
                req.traj,
                now,
                turn=req.turn,
                engine_id=engine.engine_id,
                decoded_tokens=decoded,
            )
        if home is not None:
            self.router.address(home, moved, now)
        else:
            self.router.route_prefill(moved, now)

    def emit(self, kind: str, traj: Traj, now: float, **fields: Any) -> None:
        if self.observer is not None:
            self.observer.on_event(kind, traj.spec.traj_id, now, attempt=traj.attempt, **fields)

    def weights_updated(self, now: float) -> None:
        """New policy version: cached KV was computed by the old weights."""
        for engine in self.engines.values():
            engine.cache.clear()
        for traj in self.driver.live_trajs.values():
            traj.last_engine = None

    # -- the allocator policy ----------------------------------------------------------------------------------------

    def cluster_view(self, now: float) -> ClusterView:
        """The view the policy decides on (rates over the interval since the previous call)."""
        return self._views.build(now)

    def _policy_tick(self, now: float) -> None:
        fixed = self._fixed_roles
        if fixed is None or any((e.target_role or e.role) != fixed[i] for i, e in self.engines.items()):
            view = self.cluster_view(now)
            plan = self.policy.decide(view)
            if plan is not None:
                self.plans_applied += 1
                self.apply_plan(plan.roles, view, now)
        self.queue.push(now + self.policy.interval_s, ev.POLICY_TICK)

    def _follow_up(self, now: float) -> None:
        """A switch landed: the coordinator sends what its budget now allows of the last plan's target, as the live
        allocator does on each ack (`SwitchCoordinator.follow_up`)."""
        if not self.coord.goal:
            return
        self._observe_engines(now)
        self._send(self.coord.follow_up(now), now)

    def apply_plan(self, roles: Mapping[str, str], view: ClusterView, now: float) -> None:
        """Move engines toward `roles` as the live allocator does: through its `SwitchCoordinator` (one command in
        flight per engine, at most a quarter of the fleet switching at once, never a role emptied while it has
        demand), fed with the stats every engine would publish now; the rest follows as switches land
        (`_follow_up`)."""
        self._observe_engines(now)
        target = {
            e: r for e, r in roles.items() if (self.engines[e].target_role or self.engines[e].role) != r
        }
        prefill_demand, decode_demand = role_demand(view)
        self._send(self.coord.commands_for(target, now, prefill_demand, decode_demand), now)

    def _observe_engines(self, now: float) -> None:
        """The coordinator sees the stats every engine would publish now."""
        for engine in self.engines.values():
            self.coord.observe_stats(engine.stats(now), now)

    def _send(self, commands: list[RoleSwitchCommand], now: float) -> None:
        for cmd in commands:
            self.engines[cmd.engine_id].request_switch(cmd.role, now, cmd.epoch, cmd.drain_timeout_s)
