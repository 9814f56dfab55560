"""One simulated engine: prefill, decode or mixed role, stepped in virtual time by the performance model.

Roles:
* `prefill`: each step takes queued requests FIFO up to `prefill_batch_tokens` of uncached tokens (a longer
  prompt is chunked over steps), costs `prefill_overhead_s + Σ prefill_compute_s(chunk, cached before it)`, and
  hands every finished prompt to the router, which finds a decode engine (KV transfer paid there).
* `decode`: continuous batching. Batch composition changes only when a sequence finishes or a handed-off one is
  admitted, so the engine *jumps*: it plans `m` steps up to the next finish, with step times from
  `decode_step_time_s(batch, context)` (context grows by `batch` per step; the sum is taken as an arithmetic
  series, exact while step time is affine in context). An admission mid-jump cuts the jump at the end of the step
  in progress (`_interrupt`), as a real engine admits between steps.
* `mixed` (colocation): chunked prefill interleaved with its own decodes. While prompts wait, every step is one
  `mixed_step_time_s` step carrying up to `mixed_chunk_tokens` per request (and per DP rank) of prefill plus the
  whole decode batch; with no prefill it jumps like a decode engine.

KV: a running request reserves context + output tokens on admission (no preemption). Where prefixes live: a
prefill engine caches the prompt it computed; a mixed engine caches prompt + output once the turn is decoded; a
decode engine's KV is never sent back. So a trajectory's next turn on the prefill engine that served its last
turn recomputes the last output plus the new tokens, on its mixed engine only the new tokens.

Switching (`request_switch`, drain → reconfigure → rejoin) lives in `prorsa.sim.engine_switching`, mixed into `SimEngine`.

Speed: the step loop below runs several times per turn, so it keeps running totals instead of re-summing
(`_active_left`, `_ctx_base`, `_target_sum`), prices steps with `StepCost` (the perf model's fast path, `services.runtime.step_cost`), pushes its
own wake-ups onto the heap, and inlines a few calls where the profile showed them (each marked "inlined"). A lone
prompt on an idle prefill engine starts without the queue round trip (`enqueue_prefill`). Every shortcut must keep
the result bit-identical to the general path: `tests/test_sim_speed_paths.py` compares them.
"""

from __future__ import annotations

import math
from collections import deque
from heapq import heapify, heappop, heappush
from typing import TYPE_CHECKING

from prorsa.sim import events as ev
from prorsa.sim.engine_switching import ACTIVE, DRAINING, RECONFIG, RoleSwitching
from prorsa.sim.metrics import spread
from prorsa.sim.state import Request
from services.engine_agent.prefix_cache import PrefixCache
from services.runtime.perf_model import ModelProfile
from services.runtime.step_cost import step_cost

if TYPE_CHECKING:
    from prorsa.sim.core import Simulation

__all__ = ["ACTIVE", "DRAINING", "RECONFIG", "SimEngine"]

ENGINE_WAKE, HANDOFF_ARRIVE = ev.ENGINE_WAKE, ev.HANDOFF_ARRIVE
IDLE, PREFILL_STEP, MIXED_STEP, JUMP = 0, 1, 2, 3
_RID_BITS = 48  # request ids below 2**48 (one per turn: ~10**14)
_RID_MASK = (1 << _RID_BITS) - 1


class SimEngine(RoleSwitching):
    """State and stepping of one engine. All methods take the current virtual time `now`."""

    # Slots: an engine has ~40 attributes, more than CPython 3.11 keeps in a shared-key instance dict, so without
    # them every attribute access on the hot path is a dict lookup.
    __slots__ = ("engine_id", "p", "role", "sim", "router", "metrics", "cache", "state", "target_role")
    __slots__ += ("_busy_s", "_push", "_heap", "_due", "_more", "_cost")
    __slots__ += ("queue", "queued_tokens", "active", "_active_left", "_chunks")
    __slots__ += ("seqs", "_finish_heap", "steps_done", "_ctx_base", "_target_sum", "kv_reserved", "arrivals")
    __slots__ += ("incoming", "activity", "_token", "_t_start", "_jump_steps", "_jump_a", "_jump_b")
    __slots__ += ("_drop_pending", "prefill_tokens_done", "decode_tokens_done")
    __slots__ += ("_observed", "_turn_done", "_jump")

    def __init__(self, engine_id: str, profile: ModelProfile, role: str, sim: Simulation) -> None:
        self.engine_id = engine_id
        self.p = profile
        self.role = role
        self.sim = sim
        self.router = sim.router
        self.metrics = sim.metrics
        self._busy_s = sim.metrics.busy_s  # role → busy seconds, added to at the end of every activity
        self._push = sim.queue.push
        # For the per-step wake-ups, which inline `EventQueue.push`.
        self._heap, self._due, self._more = sim.queue.heap, sim.queue.due, sim.queue.more
        self._cost = step_cost(profile)  # the perf model's fast path for this profile
        self._jump = self._cost.jump_s  # bound once: a jump is planned twice per turn
        self._observed = sim.observer is not None  # lifecycle events to emit (set again by Simulation.run)
        self._turn_done = sim.driver.on_turn_done
        self.state = ACTIVE
        self.target_role = ""
        self.cache = PrefixCache(profile.kv_capacity_tokens)
        # Prefill side: queued (not started) and started-but-unfinished (chunked) prompts.
        self.queue: deque[Request] = deque()
        self.queued_tokens = 0  # Σ est_tokens of `queue`
        self.active: list[Request] = []
        self._active_left = 0  # Σ (to_compute - computed) of `active`: prefill tokens still to compute
        # Decode side: batch, finish heap of exactly the batch (a sequence that leaves early, migrated or cancelled,
        # is taken out at once: `_forget_finishes`), step counter, context bookkeeping. A heap entry is one int,
        # target_step << _RID_BITS | rid (ints compare faster than (target_step, rid) tuples, in the same order).
        self.seqs: dict[int, Request] = {}
        self._finish_heap: list[int] = []
        self.steps_done = 0
        self._ctx_base = 0  # Σ (context - start_step): total context = _ctx_base + batch × steps_done
        self._target_sum = 0  # Σ target_step: tokens left = _target_sum - batch × steps_done
        self.kv_reserved = 0
        self.arrivals: list[
            Request
        ] = []  # handed-off requests whose KV has arrived, admitted at the next step
        self.incoming = 0  # handoffs pulled, KV in transfer
        # The activity in progress.
        self.activity = IDLE
        self._token = 0
        self._t_start = 0.0
        self._jump_steps = 0
        self._jump_a = 0.0  # first step time of the jump
        self._jump_b = 0.0  # step time increase per step
        self._chunks: list[tuple[Request, int]] = []
        self._drop_pending = False  # an aborted trajectory's sequence is in the batch
        # Work done, cumulative (the policy view turns them into per-interval rates).
        self.prefill_tokens_done = 0
        self.decode_tokens_done = 0

    # -- what the router and the views read ---------------------------------------------------------------------

    @property
    def accepts_prefill(self) -> bool:
        return self.state == ACTIVE and self.role != "decode"

    def prefill_load_s(self) -> float:
        """Estimated seconds of prefill work ahead of a new prompt (+ a batch-fullness term for mixed)."""
        load = (self.queued_tokens + self._active_left) / self.p.prefill_tokens_per_s
        if self.role == "mixed":
            load += len(self.seqs) / self.p.max_batch
        return load

    def decode_load(self) -> int:
        return len(self.seqs) + len(self.arrivals) + self.incoming + len(self.active)

    def has_decode_room(self, kv_tokens: int) -> bool:
        held = self.decode_load()
        if held == 0:
            return (
                True  # an empty engine always admits (a request larger than the KV cache must run somewhere)
            )
        return held < self.p.max_batch and self.kv_reserved + kv_tokens <= self.p.kv_capacity_tokens

    def tokens_in_flight(self) -> int:
        decode_left = self._target_sum - len(self.seqs) * self.steps_done
        return decode_left + self.queued_tokens + self._active_left

    # -- work in ------------------------------------------------------------------------------------------------

    def enqueue_prefill(self, req: Request, now: float) -> None:
        """Queue a prompt here (the router chose this engine)."""
        t = req.traj
        hit = self.cache.lookup(t.key, req.context_tokens, t.group_key, t.group_tokens)
        req.est_tokens = req.context_tokens - hit
        if (
            self.activity == IDLE
            and self.role == "prefill"
            and self.state == ACTIVE
            and not (self.queue or self.active or req.cancelled or self._drop_pending or self.arrivals)
        ):
            # Shortcut, the same step as queueing and then `_poke` → `_boundary` → `_plan_prefill_step` would
            # start: a lone prompt on an idle prefill engine (the common case of a tool-heavy workload), whose
            # prefix hit was just looked up (nothing in between changes this engine's cache).
            self._start_prefill(req, now, hit)
            p = self.p
            n = req.to_compute_tokens
            if n > p.prefill_batch_tokens:
                n = p.prefill_batch_tokens
            self._chunks = [(req, n)]
            self._schedule(PREFILL_STEP, now, self._cost.prefill_step_s(((n, req.hit_tokens),)))
            return
        self.queue.append(req)
        self.queued_tokens += req.est_tokens
        self._poke(now)

    def accept_handoff(self, req: Request, now: float) -> None:
        """Pull a prefilled request: reserve its KV and start the transfer."""
        req.engine = self
        req.kv_tokens = kv = req.context_tokens + req.output_tokens
        self.kv_reserved += kv  # _reserve, inlined (once per turn)
        if self.role == "mixed":
            self.cache.resize(max(self.p.kv_capacity_tokens - self.kv_reserved, 0))
        self.incoming += 1
        self.metrics.handoffs += 1
        self._push(now + self._cost.kv_transfer_s(req.context_tokens), HANDOFF_ARRIVE, self, req)

    def on_handoff_arrive(self, req: Request, now: float) -> None:
        self.incoming -= 1
        if req.cancelled or self.state != ACTIVE:
            self._reserve(-req.kv_tokens)
            req.engine = None
            if not req.cancelled:  # draining: forward the KV to another decode engine
                self.router.handoff(req, now)
            self._poke(now)
            return
        self.arrivals.append(req)
        if self.activity == JUMP:  # _poke, inlined for the common case (state is ACTIVE here)
            self._interrupt(now)
        elif self.activity == IDLE:
            self._boundary(now)

    def _poke(self, now: float) -> None:
        """Something arrived: start now if idle, or end a decode jump at the next step boundary."""
        if self.state == RECONFIG:
            return
        if self.activity == IDLE:
            self._boundary(now)
        elif self.activity == JUMP:
            self._interrupt(now)

    # -- the step loop --------------------------------------------------------------------------------------------

    def on_wake(self, now: float) -> None:
        """The activity in progress ends (the event loop has checked the wake-up's token: not superseded)."""
        activity = self.activity
        if activity == JUMP:  # _complete, inlined for the two most frequent activities
            t0 = self._t_start
            self.activity = IDLE
            self._busy_s[self.role] += now - t0
            self._apply_decode_steps(self._jump_steps, t0, now)
        elif activity == PREFILL_STEP:
            t0 = self._t_start
            self.activity = IDLE
            self._busy_s[self.role] += now - t0
            self._apply_chunks(t0, now)
        else:
            self._complete(now)
        self._boundary(now)

    def _complete(self, now: float) -> None:
        """Apply the effects of the activity that ends at `now`."""
        kind, t0 = self.activity, self._t_start
        self.activity = IDLE
        self._busy_s[self.role] += now - t0  # busy seconds of the role, once per activity
        if kind == JUMP:
            self._apply_decode_steps(self._jump_steps, t0, now)
        elif kind == MIXED_STEP:
            if self.seqs:
                self._apply_decode_steps(1, t0, now)
            self._apply_chunks(t0, now)
        elif kind == PREFILL_STEP:
            self._apply_chunks(t0, now)

    def _boundary(self, now: float) -> None:
        """Between steps: admit arrivals, handle draining, pull work, plan the next activity."""
        if self._drop_pending:
            self._drop_pending = False
            self.drop_cancelled()
        if self.arrivals:
            for req in self.arrivals:
                if req.cancelled:
                    self._reserve(-req.kv_tokens)
                    req.engine = None
                else:
                    self._join_batch(req, now)
            self.arrivals.clear()
        role, draining = self.role, self.state == DRAINING
        if draining:
            self._migrate_long_decodes(now)
        elif self.router.handoffs and (role == "decode" or (role == "mixed" and not self.router.decode_pool)):
            self.router.pull_handoffs(self, now)  # (mixed engines take handoffs only with no decode engine)
        # Plan the next activity. With no prompt started or queued there are no chunks to take.
        if role == "prefill":
            if self.active or self.queue:
                self._plan_prefill_step(now)
        elif role == "mixed" and (self.active or self.queue) and self._plan_mixed_step(now):
            pass  # a chunked-prefill step, which carries the decodes too
        elif self.seqs:
            self._plan_jump(now)
        if draining and self.activity == IDLE and self._drained():
            self._start_reconfig(now)

    def _plan_prefill_step(self, now: float) -> None:
        p = self.p
        self._chunks = chunks = self._take_chunks(p.prefill_batch_tokens, p.prefill_batch_tokens, now)
        if chunks:
            priced = [(n, r.hit_tokens + r.computed_tokens) for r, n in chunks]
            self._schedule(PREFILL_STEP, now, self._cost.prefill_step_s(priced))

    def _plan_mixed_step(self, now: float) -> bool:
        """Start a chunked-prefill step if prompts can go in; False: nothing to chunk (decode only)."""
        per_request = self.p.mixed_chunk_tokens
        self._chunks = self._take_chunks(per_request * self.p.dp_ranks, per_request, now)
        if not self._chunks:
            return False
        self._schedule(MIXED_STEP, now, self._mixed_step_s())
        return True

    def _schedule(self, kind: int, now: float, duration_s: float) -> None:
        self.activity = kind
        self._t_start = now
        self._token = token = self._token + 1
        t = now + duration_s
        if t in self._due:  # _wake_at, inlined (once per prefill step)
            ev.push_more(self._more, t, (ENGINE_WAKE, self, token))
        else:
            self._due[t] = (ENGINE_WAKE, self, token)
            heappush(self._heap, t)

    def _wake_at(self, t: float, token: int) -> None:
        """Schedule this engine's wake-up at `t` (`EventQueue.push` for engines)."""
        if t in self._due:
            ev.push_more(self._more, t, (ENGINE_WAKE, self, token))
        else:
            self._due[t] = (ENGINE_WAKE, self, token)
            heappush(self._heap, t)

    # -- prefill ----------------------------------------------------------------------------------------------------

    def _take_chunks(self, budget: int, per_request: int, now: float) -> list[tuple[Request, int]]:
        """Chunks for the next step: started prompts first, then new ones from the queue (not while draining)."""
        chunks: list[tuple[Request, int]] = []
        for req in self.active:
            if budget <= 0:
                return chunks
            n = min(req.to_compute_tokens - req.computed_tokens, per_request, budget)
            chunks.append((req, n))
            budget -= n
        while budget > 0 and self.queue and self.state == ACTIVE:
            req = self.queue[0]
            if req.cancelled:
                self.queue.popleft()
                self.queued_tokens -= req.est_tokens
                continue
            if self.role == "mixed" and not self._mixed_room(req):
                break  # FCFS: wait for KV or a batch slot
            self.queue.popleft()
            self.queued_tokens -= req.est_tokens
            self._start_prefill(req, now)
            n = min(req.to_compute_tokens, per_request, budget)
            chunks.append((req, n))
            budget -= n
        return chunks

    def _mixed_room(self, req: Request) -> bool:
        return self.has_decode_room(req.context_tokens + req.output_tokens)

    def _start_prefill(self, req: Request, now: float, hit: int | None = None) -> None:
        """Start computing `req` (`hit`: its prefix hit, if just looked up here)."""
        if hit is None:
            t = req.traj
            hit = self.cache.lookup(t.key, req.context_tokens, t.group_key, t.group_tokens)
        context = req.context_tokens
        if hit >= context:  # the last prompt token is always recomputed (vLLM does)
            hit = context - 1 if context > 0 else 0
        req.hit_tokens = hit
        req.to_compute_tokens = to_compute = context - hit
        req.computed_tokens = 0
        self.active.append(req)
        self._active_left += to_compute
        if self.role == "mixed":
            req.engine = self
            req.kv_tokens = context + req.output_tokens
            self._reserve(req.kv_tokens)
        metrics = self.metrics  # prefill starts and prompt tokens (once per turn)
        if req.migrated:
            metrics.migration_hit_tokens += hit
        else:
            metrics.prefill_starts += 1
            metrics.prompt_tokens += context
            metrics.prefix_hit_tokens += hit

    def _mixed_step_s(self) -> float:
        priced = [(n, r.hit_tokens + r.computed_tokens) for r, n in self._chunks]
        batch = len(self.seqs)
        return self._cost.mixed_chunks_step_s(priced, batch, self._ctx_base + batch * self.steps_done)

    def _apply_chunks(self, t0: float, now: float) -> None:
        computed = recomputed = wasted = 0
        for req, n in self._chunks:
            req.computed_tokens += n
            self._active_left -= n
            if req.cancelled:
                wasted += n
                self._active_left -= req.to_compute_tokens - req.computed_tokens
                self.active.remove(req)
                if req.engine is self:
                    self._reserve(-req.kv_tokens)
                    req.engine = None
                continue
            if req.migrated:
                recomputed += n
            else:
                computed += n
            if req.computed_tokens >= req.to_compute_tokens:
                self.active.remove(req)
                self._prefill_finished(req, now)
        self._chunks = []
        done = computed + recomputed + wasted
        self.prefill_tokens_done += done
        # Prompt tokens computed (once per prefill step), with `spread`'s common case inlined: inside one window.
        metrics = self.metrics
        metrics.prefill_computed_tokens += computed
        metrics.migration_recompute_tokens += recomputed
        metrics.wasted_prefill_tokens += wasted
        row, w = metrics.computed_row, metrics.window_s
        index = int(t0 / w)
        if t0 < now and int(now / w) == index and len(row) > index:
            row[index] += done
        else:
            spread(row, w, t0, now, done)

    def _prefill_finished(self, req: Request, now: float) -> None:
        t = req.traj
        self.cache.insert(t.key, req.context_tokens, now, t.group_key, t.group_tokens)
        t.last_engine = self
        if self._observed:
            self.sim.on_prefill_done(req, self, now)
        if self.role == "prefill":
            self.router.handoff(req, now)
        elif self.state == DRAINING and self.router.has_decode_engines():
            self._reserve(-req.kv_tokens)  # leaving: send the KV to a decode engine instead
            req.engine = None
            self.router.handoff(req, now)
        else:
            self._join_batch(req, now)

    # -- decode -----------------------------------------------------------------------------------------------------

    def _join_batch(self, req: Request, now: float) -> None:
        req.start_step = start = self.steps_done
        req.target_step = target = start + req.output_tokens
        self.seqs[req.rid] = req
        heappush(self._finish_heap, target << _RID_BITS | req.rid)
        self._ctx_base += req.context_tokens - start
        self._target_sum += target
        if self._observed:
            self.sim.on_decode_started(req, self, now)

    def _leave_batch(self, req: Request) -> None:
        """Take a sequence out of the batch (its finish heap entry is the caller's: popped, or `_forget_finishes`)."""
        del self.seqs[req.rid]
        self._ctx_base -= req.context_tokens - req.start_step
        self._target_sum -= req.target_step
        self.kv_reserved -= req.kv_tokens  # _reserve(-kv), inlined: once per turn
        if self.role == "mixed":
            self.cache.resize(max(self.p.kv_capacity_tokens - self.kv_reserved, 0))
        req.engine = None

    def _forget_finishes(self) -> None:
        """Drop the finish heap entries of sequences that left the batch early (migrated or cancelled: rare)."""
        seqs = self.seqs
        self._finish_heap = heap = [e for e in self._finish_heap if e & _RID_MASK in seqs]
        heapify(heap)

    def _plan_jump(self, now: float) -> None:
        """Plan the decode steps up to the batch's next finish, and wake up then."""
        done = self.steps_done
        m = (self._finish_heap[0] >> _RID_BITS) - done
        batch = len(self.seqs)
        context = self._ctx_base + batch * done
        a, b = self._jump(batch, context, m)
        self._jump_steps, self._jump_a, self._jump_b = m, a, b
        # _schedule(JUMP, ...), inlined: the most frequent activity.
        self.activity = JUMP
        self._t_start = now
        self._token = token = self._token + 1
        t = now + (m * a + b * m * (m - 1) / 2)
        if t in self._due:  # _wake_at, inlined
            ev.push_more(self._more, t, (ENGINE_WAKE, self, token))
        else:
            self._due[t] = (ENGINE_WAKE, self, token)
            heappush(self._heap, t)

    def _interrupt(self, now: float) -> None:
        """End the current jump at the first step boundary at or after `now`."""
        t0 = self._t_start
        dt = now - t0
        a, b, steps = self._jump_a, self._jump_b, self._jump_steps
        # k steps of the jump take k·a + b·k(k-1)/2 seconds: start at the whole part of the root for dt (written
        # without cancellation, so it is within rounding of the true root, below the answer), then step up to the
        # first boundary at or after now.
        if b > 0 and dt > 0:
            c = a - b / 2
            k = int(2 * dt / (c + math.sqrt(c * c + 2 * b * dt)))
        else:
            k = int(dt / a) if a > 0 else steps - 1
        elapsed = k * a + b * k * (k - 1) / 2
        while elapsed < dt and k < steps:
            k += 1
            elapsed = k * a + b * k * (k - 1) / 2
        if k >= steps:
            return  # the planned wake-up is that boundary
        self._jump_steps = k
        self._token = token = self._token + 1
        end = t0 + elapsed
        if k == 0 or end <= now:
            self._complete(now)
            self._boundary(now)
            return
        self._wake_at(end, token)

    def _apply_decode_steps(self, m: int, t0: float, now: float) -> None:
        """`m` decode steps of the whole batch ran from `t0` to `now`: count them, and finish what is done."""
        if m <= 0:
            return
        seqs = self.seqs
        tokens = len(seqs) * m
        self.steps_done = steps = self.steps_done + m
        self.decode_tokens_done += tokens
        metrics = self.metrics
        metrics.decoded_tokens += tokens
        # Decoded tokens (once per decode jump), with `spread`'s common case inlined: a jump inside one window.
        row, w = metrics.decode_row, metrics.window_s
        index = int(t0 / w)
        if t0 < now and int(now / w) == index and len(row) > index:
            row[index] += tokens
        else:
            spread(row, w, t0, now, tokens)
        if self._observed:
            self.sim.emit_decode_progress(self, now)
        heap, bound = self._finish_heap, (steps + 1) << _RID_BITS  # entries below `bound`: finished
        while heap and heap[0] < bound:
            req = seqs[heappop(heap) & _RID_MASK]
            self._leave_batch(req)
            if req.cancelled:  # its trajectory was aborted: the tokens are wasted, nobody waits for them
                metrics.wasted_decoded_tokens += req.output_tokens
                continue
            if self.role == "mixed":
                t = req.traj
                self.cache.insert(
                    t.key, req.context_tokens + req.output_tokens, now, t.group_key, t.group_tokens
                )
            self._turn_done(req, now)

    def decoded_so_far(self, req: Request) -> int:
        return self.steps_done - req.start_step

    def cancel(self, now: float) -> None:
        """A request held here was cancelled (trajectory aborted): drop it at the next step boundary."""
        self._drop_pending = True
        self._poke(now)

    def drop_cancelled(self) -> None:
        """Remove decodes of aborted trajectories from the batch."""
        cancelled = [r for r in self.seqs.values() if r.cancelled]
        for req in cancelled:
            self.metrics.wasted_decoded_tokens += self.decoded_so_far(req)
            self._leave_batch(req)
        if cancelled:
            self._forget_finishes()

    # -- helpers ------------------------------------------------------------------------------------------------------

    def _reserve(self, tokens: int) -> None:
        """Change reserved KV; a mixed engine's prefix cache lives in what running work leaves free."""
        self.kv_reserved += tokens
        if self.role == "mixed":
            self.cache.resize(max(self.p.kv_capacity_tokens - self.kv_reserved, 0))
