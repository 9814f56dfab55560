"""Placement in the simulator: the live system's, modelled — shared work queues that engines pull from by capacity,
and prefix affinity decided the way the client decides it.

The rules are the shipped code's, called, not copied:
- how much an engine may pull (`services.engine_agent.pull_capacity.pull_size`: a prefill token budget, batch slots
  and KV room, sizes of unseen work estimated from what the engine pulled before — `PullEstimates`);
- whether a turn goes to its trajectory's last engine (`prorsa.client.directory.EngineDirectory.accepts`: that
  engine prefills, is not switching, and its queue is short), from what its `EngineStats` would say;
- a mixed engine takes decode handoffs only while it holds no prompt, and after a look that found none, not again
  for `decode_check_s` (`services.engine_agent.puller`).

The queues: one shared prefill queue (`work.prefill.any`), one addressed queue per engine (`work.prefill.<id>`), one
shared handoff queue (`work.decode.any`), all FIFO. Which engine takes a message that several have room for: the one
whose fetch has waited longest — a JetStream pull consumer serves waiting pull requests in arrival order, and an
engine fetches again as soon as it has taken a message, so engines with room take turns (`_prompt_line`,
`_handoff_line`). An engine with no room pulls again at its next step boundary, when it may have freed some.

What the model leaves out: live, stats are up to one stats interval old, a fetch costs a bus round trip and the
pull loops poll at wall-clock cadences; here each engine's picture is current and a pull is instant. The
differential test (`tests/test_engine_differential.py`) measures what that leaves between the two.

A first turn goes to the shared queue, GRPO group or not (the client knows no engine for it). Members of a group
that land on one engine share their prompt's cache (`EngineCore`); placing a group together on purpose was tried —
rendezvous hashing of the group, which the client could do too — and lost 17 % on a colocated general workload
(4 engines, 4 groups of 8: hashing piles groups onto one engine, and affinity keeps them there).
"""

from __future__ import annotations

import math
from collections import deque
from typing import TYPE_CHECKING, cast

from mypy_extensions import mypyc_attr

from prorsa.client.directory import EngineDirectory
from prorsa.sim import events as ev
from prorsa.sim.engine import ACTIVE, SimEngine
from prorsa.sim.state import Request
from services.engine_agent.pull_capacity import (
    EngineLimits,
    HeldWork,
    PullConfig,
    WorkKind,
    decode_fetch,
    prefill_fetch,
    pull_size,
)
from services.runtime.affinity import worth_prompts

if TYPE_CHECKING:
    from prorsa.sim.core import Simulation


def _prompt_tokens(engine: SimEngine) -> int:
    """Context tokens of the prompts `engine` holds and has not prefilled (queued or started)."""
    tokens = 0
    for seq in engine.queue:
        tokens += seq.context_tokens
    for seq in engine.active:
        tokens += seq.context_tokens
    return tokens


def held_work(engine: SimEngine) -> HeldWork:
    """What the live job runner would count as held (`JobRunner.held`): prompts not yet prefilled with their
    context tokens; requests that decode here with their KV reservation (context plus expected output)."""
    prompts = len(engine.queue) + len(engine.active)
    prompt_tokens = _prompt_tokens(engine)
    role = engine.role
    if role == "prefill":
        return HeldWork(prompts, prompt_tokens, 0, 0)
    decodes = len(engine.seqs) + len(engine.arrivals) + engine.incoming
    kv = engine.kv_reserved  # decodes and handoffs in transfer, and a mixed engine's started prompts
    if role == "mixed":
        decodes += prompts
        for seq in engine.queue:  # reserved when their prefill starts; the runner counts them from the pull
            kv += seq.context_tokens + seq.output_tokens
    return HeldWork(prompts, prompt_tokens, decodes, kv)


@mypyc_attr(allow_interpreted_subclasses=True)  # deep-copied by `Simulation.fork` (see `prorsa.native`)
class Router:
    """The shared queues and the engines' pulls from them."""

    def __init__(self, sim: Simulation, pull: PullConfig | None = None) -> None:
        self.sim = sim
        self.pull = pull or PullConfig()
        profile = sim.profile
        self.limits = EngineLimits(
            max_batch=profile.max_batch,
            kv_capacity_tokens=profile.kv_capacity_tokens,
            prefill_budget_tokens=self.pull.prefill_budget_tokens,
            max_fetch=self.pull.max_fetch,
        )
        self.directory = EngineDirectory()
        self.prompts: deque[Request] = deque()  # work.prefill.any
        self.handoffs: deque[Request] = deque()  # work.decode.any: prefilled, waiting for a decode engine
        self._prompt_line: deque[SimEngine] = deque()  # engines whose prompt fetch waits, oldest first
        self._handoff_line: deque[SimEngine] = deque()
        self.decode_pool: list[SimEngine] = []  # active decode engines
        self.mixed_pool: list[SimEngine] = []  # active mixed engines
        self.affinity_hits = 0
        self.affinity_misses = 0

    # -- engines coming and going ---------------------------------------------------------------------------------

    def has_decode_engines(self) -> bool:
        return bool(self.decode_pool)

    def engine_available(self, engine: SimEngine, now: float) -> None:
        """`engine` serves its role now: it starts pulling."""
        engine.waiting_prompts = self.prompts
        engine.waiting_handoffs = self.handoffs
        if engine.role == "decode":
            self.decode_pool.append(engine)
            self._forward_addressed(engine, now)  # a decode engine does not prefill (`forward_addressed`)
        elif engine.role == "mixed":
            self.mixed_pool.append(engine)
            engine.decode_due_s = now + self.pull.decode_check_s  # it looked on joining and found none
        # It pulls at its next step boundary (the caller pokes it), and then waits in line if it has room. A mixed
        # engine never waits on the handoff queue: it looks when handoffs wait (`pull_handoffs`).
        engine.prompt_fetch_waiting = False
        engine.handoff_fetch_waiting = engine.role == "mixed"

    def engine_leaving(self, engine: SimEngine, now: float) -> None:
        """`engine` starts switching: its pulls pause (its addressed queue waits for it)."""
        for pool in (self.decode_pool, self.mixed_pool):
            if engine in pool:
                pool.remove(engine)
        self._drop_from_lines(engine)
        engine.prompt_fetch_waiting = engine.handoff_fetch_waiting = True  # no fetch, and none to make

    def _drop_from_lines(self, engine: SimEngine) -> None:
        for line in (self._prompt_line, self._handoff_line):
            if engine in line:
                line.remove(engine)

    def _forward_addressed(self, engine: SimEngine, now: float) -> None:
        own = engine.own_prompts
        if own:
            engine.own_prompts = ()
            for req in cast("deque[Request]", own):  # a deque while not empty (`address`)
                self._post(req, now)

    # -- prompts --------------------------------------------------------------------------------------------------

    def route_prefill(self, req: Request, now: float) -> None:
        """A turn's prompt is published: to its trajectory's engine if the client's affinity check passes, else
        to the shared queue."""
        traj = req.traj
        engine = traj.last_engine
        if engine is not None:
            # The fields `EngineStats` reports (`SimEngine.stats`), read directly: this runs once per turn.
            waiting = len(engine.queue) + len(engine.arrivals) + engine.incoming + len(engine.own_prompts)
            new = traj.spec.turns[req.turn].new_prompt_tokens
            worth = worth_prompts(req.context_tokens, new)
            if self.directory.accepts_state(engine.role, engine.state != ACTIVE, waiting, worth):
                self.affinity_hits += 1
                self.address(engine, req, now)
                return
            self.affinity_misses += 1
        self._post(req, now)

    def address(self, engine: SimEngine, req: Request, now: float) -> None:
        """Publish a prompt to `engine`'s own queue (delivered at once if it serves and has room)."""
        own = engine.own_prompts
        if not own and engine.state == ACTIVE and self._room(engine, "prefill"):
            self._take_prompt(engine, req, now)  # its own queue's fetch waits: delivered at once
            return
        if not own:
            engine.own_prompts = own = deque()
        cast("deque[Request]", own).append(req)

    def _post(self, req: Request, now: float) -> None:
        if self.prompts:  # FIFO: others wait already, so no engine has room
            self.prompts.append(req)
            return
        engine = self._serve(self._prompt_line, "prefill")
        if engine is None:
            self.prompts.append(req)
        else:
            self._take_prompt(engine, req, now)

    def _take_prompt(self, engine: SimEngine, req: Request, now: float) -> None:
        """Deliver a prompt to an engine between its steps (it queues the prompt and pokes itself)."""
        engine.pull_estimates.observe(req.context_tokens, req.output_tokens)
        engine.enqueue_prefill(req, now)

    def pull_prompts(self, engine: SimEngine, now: float) -> None:
        """At `engine`'s step boundary: take from its own queue, then the shared one, while it has room; with room
        left and nothing more to take, its fetch waits in line."""
        own = engine.own_prompts
        queue = self.prompts
        while (own or queue) and self._room(engine, "prefill"):
            req = cast("deque[Request]", own).popleft() if own else queue.popleft()
            if req.cancelled:
                continue
            engine.pull_estimates.observe(req.context_tokens, req.output_tokens)
            engine.take_prompt(req)
        if not own:
            engine.own_prompts = ()
        if not engine.prompt_fetch_waiting and not queue and self._room(engine, "prefill"):
            engine.prompt_fetch_waiting = True
            self._prompt_line.append(engine)

    def unpulled_prompts(self) -> int:
        """Prompts no engine has pulled yet (shared and addressed queues)."""
        return len(self.prompts) + sum(len(e.own_prompts) for e in self.sim.engines.values())

    def _serve(self, line: deque[SimEngine], kind: WorkKind) -> SimEngine | None:
        """The engine whose waiting fetch takes the next message of `kind`: the first in `line` with room. It
        fetches again, to the back of the line (its room is checked when it is served); those found without room
        leave the line and pull again at a step boundary."""
        while line:
            engine = line.popleft()
            if self._room(engine, kind):
                line.append(engine)
                return engine
            if kind == "prefill":
                engine.prompt_fetch_waiting = False
            else:
                engine.handoff_fetch_waiting = False
        return None

    def _room(self, engine: SimEngine, kind: WorkKind) -> bool:
        """Whether `engine` would fetch a message of `kind` now (`pull_size` > 0 on its `held_work`)."""
        est = engine.pull_estimates
        role = engine.role
        # The two common cases with `held_work`'s counts inlined (a call each per prompt and per handoff).
        if role == "decode" and kind == "decode":
            jobs = len(engine.seqs) + len(engine.arrivals) + engine.incoming
            return decode_fetch(self.limits, jobs, engine.kv_reserved, est.kv_tokens.value) > 0
        if role == "prefill" and kind == "prefill":
            jobs = len(engine.queue) + len(engine.active)
            return prefill_fetch(self.limits, jobs, _prompt_tokens(engine), est.prompt_tokens.value) > 0
        held = held_work(engine)
        return pull_size(role, kind, self.limits, held, est.prompt_tokens.value, est.kv_tokens.value) > 0

    # -- decode handoffs ------------------------------------------------------------------------------------------

    def handoff(self, req: Request, now: float) -> None:
        """A prefilled request is published to the shared handoff queue."""
        if not self.handoffs:  # FIFO: with handoffs waiting already, no decode engine has room
            engine = self._serve(self._handoff_line, "decode")
            if engine is not None:
                self._take_handoff(engine, req, now)
                return
        self.handoffs.append(req)
        # A mixed engine holding no prompt looks at its next check (one holding some, at a boundary without them).
        for engine in self.mixed_pool:
            if not engine.decode_check_pending and not (engine.queue or engine.active or engine.own_prompts):
                self._schedule_check(engine, now)

    def _take_handoff(self, engine: SimEngine, req: Request, now: float) -> None:
        engine.pull_estimates.observe(req.context_tokens, req.output_tokens)
        engine.accept_handoff(req, now)

    def pull_handoffs(self, engine: SimEngine, now: float) -> None:
        """At `engine`'s step boundary (or a mixed engine's due check): take handoffs from the head of the queue
        while it has room. A decode engine with room left then waits in line; a mixed engine takes handoffs only
        with no prompt held, and after a look that found none, not again for `decode_check_s`."""
        queue = self.handoffs
        if engine.role == "mixed":
            if engine.queue or engine.active or engine.own_prompts:
                return  # its prompts come first; it looks again at a boundary without them
            if now < engine.decode_due_s:
                if queue and not engine.decode_check_pending:
                    self._schedule_check(engine, now)
                return
            if not queue:
                engine.decode_due_s = now + self.pull.decode_check_s
                return
            engine.decode_due_s = now  # it found some: it looks again at once (`_last_decode_check = -inf`)
        while queue and self._room(engine, "decode"):
            req = queue.popleft()
            if not req.cancelled:
                self._take_handoff(engine, req, now)
        if (
            engine.role == "decode"
            and not engine.handoff_fetch_waiting
            and not queue
            and self._room(engine, "decode")
        ):
            engine.handoff_fetch_waiting = True
            self._handoff_line.append(engine)

    def _schedule_check(self, engine: SimEngine, now: float) -> None:
        """A mixed engine holding no prompt looks at the handoff queue every `decode_check_s` from its last look
        that found none: the first such time at or after `now`."""
        check, due = self.pull.decode_check_s, engine.decode_due_s
        if now > due:
            due += math.ceil((now - due) / check) * check
        engine.decode_check_pending = True
        self.sim.queue.push(due, ev.DECODE_CHECK, engine, None)

    def on_decode_check(self, engine: SimEngine, now: float) -> None:
        """A mixed engine's look at the handoff queue falls due (scheduled while handoffs waited)."""
        engine.decode_check_pending = False
        if engine.state == ACTIVE and engine.role == "mixed":
            self.pull_handoffs(engine, now)  # what it takes arrives by a HANDOFF_ARRIVE event
