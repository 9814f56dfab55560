"""The router: where each prompt is prefilled and which decode engine takes each handoff.

Prefill routing, per request:
1. prefix affinity — the engine that prefilled the trajectory's previous turn (for a first turn: the engine that
   prefilled its GRPO group's shared prompt), if it still takes prefills and its queued prefill work is below
   `affinity_overload_s` seconds;
2. otherwise the least-loaded prefill-capable engine (exact minimum over up to `_SCAN_LIMIT` engines, else the
   better of two random picks — "power of two choices", O(1) per request at hundreds of engines);
3. no prefill-capable engine (all switching): the request waits in `pending` until one appears.

Decode handoffs wait in one FIFO (`handoffs`). A new handoff goes to the decode engine with the fewest sequences
that has a batch slot and KV room; an engine that frees room pulls from the head of the queue. Mixed engines take
handoffs only when no decode-role engine exists (a plan with prefill and mixed engines but no decode ones).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

import numpy as np

from prorsa.sim.engine import ACTIVE, SimEngine
from prorsa.sim.state import Request

if TYPE_CHECKING:
    from prorsa.sim.core import Simulation

_SCAN_LIMIT = 8  # up to this many candidates, take the exact least-loaded one
_RANDOM_BATCH = 4096  # uniform draws fetched from the generator at a time


class Router:
    """Prefill placement and the decode handoff queue."""

    def __init__(self, sim: Simulation, rng: np.random.Generator, affinity_overload_s: float) -> None:
        self.sim = sim
        self._rng = rng
        self._draws: list[float] = []
        self.affinity_overload_s = affinity_overload_s
        self.prefill_pool: list[SimEngine] = []  # active prefill and mixed engines
        self.decode_pool: list[SimEngine] = []  # active decode engines
        self.mixed_pool: list[SimEngine] = []
        self.pending: deque[Request] = deque()  # prompts with no prefill-capable engine
        self.handoffs: deque[Request] = deque()  # prefilled, waiting for a decode engine
        self.group_engine: dict[str, SimEngine] = {}
        self.affinity_hits = 0
        self.affinity_misses = 0

    # -- pools ------------------------------------------------------------------------------------------------------

    @property
    def mixed_takes_handoffs(self) -> bool:
        return not self.decode_pool

    def has_decode_engines(self) -> bool:
        return bool(self.decode_pool)

    def engine_available(self, engine: SimEngine, now: float) -> None:
        """`engine` serves its role now: add it to its pool and give it waiting work."""
        if engine.role == "decode":
            self.decode_pool.append(engine)
            self.pull_handoffs(engine, now)
        else:
            self.prefill_pool.append(engine)
            if engine.role == "mixed":
                self.mixed_pool.append(engine)
            waiting = list(self.pending)
            self.pending.clear()
            for req in waiting:
                self.route_prefill(req, now)
            if engine.role == "mixed" and self.mixed_takes_handoffs:  # a prefill engine never decodes
                self.pull_handoffs(engine, now)

    def engine_leaving(self, engine: SimEngine, now: float) -> None:
        """`engine` starts switching: it takes no new work."""
        for pool in (self.prefill_pool, self.decode_pool, self.mixed_pool):
            if engine in pool:
                pool.remove(engine)

    # -- prefill ----------------------------------------------------------------------------------------------------

    def route_prefill(self, req: Request, now: float) -> None:
        traj = req.traj
        engine = traj.last_engine
        if engine is None and traj.turn == 0 and traj.group_key:
            engine = self.group_engine.get(traj.group_key)
        if (
            engine is not None
            and engine.state == ACTIVE
            and engine.role != "decode"  # accepts_prefill, inlined
            and engine.prefill_load_s() < self.affinity_overload_s
        ):
            self.affinity_hits += 1
        else:
            if engine is not None:
                self.affinity_misses += 1
            engine = self._least_loaded(self.prefill_pool)
            if engine is None:
                self.pending.append(req)
                return
        if traj.turn == 0 and traj.group_key:
            self.group_engine.setdefault(traj.group_key, engine)
        engine.enqueue_prefill(req, now)

    def pending_tokens(self) -> int:
        return sum(r.context_tokens for r in self.pending)

    def _uniform(self) -> float:
        if not self._draws:
            self._draws = self._rng.random(_RANDOM_BATCH).tolist()
        return self._draws.pop()

    def _least_loaded(self, pool: list[SimEngine]) -> SimEngine | None:
        if not pool:
            return None
        if len(pool) <= _SCAN_LIMIT:
            return min(pool, key=SimEngine.prefill_load_s)
        a = pool[int(self._uniform() * len(pool))]
        b = pool[int(self._uniform() * len(pool))]
        return a if a.prefill_load_s() <= b.prefill_load_s() else b

    # -- decode handoffs --------------------------------------------------------------------------------------------

    def handoff(self, req: Request, now: float) -> None:
        """A prefilled request needs a decode engine."""
        if self.handoffs:  # FIFO: others are already waiting for room
            self.handoffs.append(req)
            return
        engine = self._decode_engine_for(req)
        if engine is None:
            self.handoffs.append(req)
        else:
            engine.accept_handoff(req, now)

    def _decode_engine_for(self, req: Request) -> SimEngine | None:
        pool = self.decode_pool or self.mixed_pool
        if not pool:
            return None
        kv = req.context_tokens + req.output_tokens
        n = len(pool)
        if n > _SCAN_LIMIT:
            # Two random picks; `decode_load` and `has_decode_room` inlined (once per handoff).
            draws = self._draws
            if len(draws) >= 2:  # _uniform twice, inlined (the same draws in the same order)
                a = pool[int(draws.pop() * n)]
                b = pool[int(draws.pop() * n)]
            else:
                a = pool[int(self._uniform() * n)]
                b = pool[int(self._uniform() * n)]
            load_a = len(a.seqs) + len(a.arrivals) + a.incoming
            load_b = len(b.seqs) + len(b.arrivals) + b.incoming
            if pool is self.mixed_pool:  # only a mixed engine prefills (its prompts hold KV too)
                load_a += len(a.active)
                load_b += len(b.active)
            if load_b < load_a:
                a, load_a = b, load_b
            p = a.p
            if load_a == 0 or (load_a < p.max_batch and a.kv_reserved + kv <= p.kv_capacity_tokens):
                return a  # the less loaded of the two (the first on a tie), if it has room
        fits = [e for e in pool if e.has_decode_room(kv)]
        return min(fits, key=SimEngine.decode_load) if fits else None

    def pull_handoffs(self, engine: SimEngine, now: float) -> None:
        """`engine` has room: take handoffs from the head of the queue while they fit."""
        queue = self.handoffs
        while queue:
            req = queue[0]
            if req.cancelled:
                queue.popleft()
                continue
            if not engine.has_decode_room(req.context_tokens + req.output_tokens):
                return
            queue.popleft()
            engine.accept_handoff(req, now)
