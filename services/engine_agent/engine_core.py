"""The engine core: one engine's queues, batch, KV and prefix cache, stepped in modelled time. Pure.

Both simulated engines are this class: the simulator's (`prorsa.sim.engine.SimEngine`, woken by the event loop) and
the live engine agent's (`backends.sim_backend.SimBackend`, woken on the scaled clock). Each subclasses it and
fills in the hooks (`_wake_at`, `_hand_off`, `_on_*`); the rules below exist nowhere else. Work done is counted
into the driver's `tally` (`StepTally`: the simulator's metrics; none live) inline, not through a hook per step.

Roles:
* `prefill`: each step takes queued prompts FIFO up to `prefill_batch_tokens` of uncached tokens (a longer prompt
  is chunked over steps) and costs `prefill_step_time_s`. A prompt done is handed on (`_hand_off`): its KV goes to
  a decode engine, which pays the transfer (`accept_handoff` → arrival time).
* The step that completes a prompt samples its first output token (vLLM does): a turn of `output_tokens` tokens
  decodes `output_tokens - 1` steps after its prefill, here or on the decode engine its KV goes to.
* `decode`: continuous batching. Batch composition changes only when a sequence finishes or a handed-off one is
  admitted, so the engine *jumps*: it plans the steps up to the next finish, with step times from
  `decode_step_time_s(batch, context)` (context grows by `batch` per step; the sum is an arithmetic series, exact
  while step time is affine in context). An admission mid-jump cuts the jump at the end of the step in progress
  (`_interrupt`), as a real engine admits between steps; `steps_at(now)` reads how far a jump has come.
* `mixed` (colocation): chunked prefill interleaved with its own decodes. While prompts wait, every step is one
  `mixed_step_time_s` step carrying up to `mixed_chunk_tokens` per request (and per DP rank) of prefill plus the
  whole decode batch; with no prefill it jumps like a decode engine.

What a sequence does is its own, not the role's: a prompt prefilled for a decode elsewhere (`remote`: every prompt
a prefill-role engine takes) hands its KV on; any other decodes here. The role decides what the engine pulls and
how it schedules; what it steps is what it holds. An engine that switched role in place still holds work of its old
role (`switch_rule.py`) and is mixed in effect until that is done: a prefill engine's steps (its prefill budget,
as it schedules) carry the decodes it still holds along, one token each per step (`_plan_prefill_step`) — which is
why a switch to prefill hands on those not near their end (`release_decode`, the driver's); a decode engine
prefills the prompts it still holds the same way, its decodes riding along; a mixed engine keeps its chunked
mixed steps.

KV: a running request reserves context + output tokens on admission (no preemption); a prompt that decodes here is
admitted only with a batch slot and KV room (FCFS), but an empty engine always admits (a request larger than the KV
cache must run somewhere). Prefix cache: a prompt's hit is its trajectory's cached prefix (or its GRPO group's shared
first prompt), at most `cacheable_tokens`, and the last prompt token is always recomputed (vLLM does). An engine
caches the prompt it computed; one that prefills caches prompt + output once a turn is decoded here too; a decode
engine's KV is never sent back. The cache lives in the KV that running work leaves free. With a host KV tier
(`ModelProfile.host_kv_tokens`; `PrefixCache`'s host tier) a prompt's hit extends to what host memory holds beyond
the device hit: those `reload_tokens` are loaded, not computed, during the first step of its prefill, which lasts
the longer of its compute and the load (`perf_model.host_reload_step_s`: HiCache's layer-wise overlap).

Switching: `state` is ACTIVE, SWITCHING (in place: it steps what it holds and pulls nothing until the switch
completes), DRAINING (before a restart: no new prompts start; handoffs that arrive are forwarded) or RECONFIG
(restarting: the engine does nothing). Which and when is the driver's (`prorsa.sim.engine_switching`,
`switch_drain.py`), by `switch_rule.py`.

Speed: the simulator runs the step loop several times per turn, so it keeps running totals instead of re-summing
(`_active_left`, `_ctx_base`, `_target_sum`), prices steps with `StepCost` (the perf model's fast path), and
inlines a few calls where the profile showed them (each marked "inlined"). A lone prompt on an idle prefill
engine starts without the queue round trip (`enqueue_prefill`). Every shortcut keeps the result bit-identical to
the general path: `tests/test_sim_speed_paths.py` compares them.
"""

from __future__ import annotations

import math
from collections import defaultdict, deque
from collections.abc import Sized
from heapq import heapify, heappop, heappush
from typing import Protocol

from mypy_extensions import mypyc_attr

from services.engine_agent.prefix_cache import PrefixCache
from services.runtime import perf_model as pm
from services.runtime.perf_model import ModelProfile
from services.runtime.step_cost import step_cost
from services.runtime.time_windows import spread

# Engine states: serving its role; leaving it before a restart; restarting; switching in place (see the docstring).
ACTIVE, DRAINING, RECONFIG, SWITCHING = 0, 1, 2, 3
IDLE, PREFILL_STEP, MIXED_STEP, JUMP = 0, 1, 2, 3  # activities
_RID_BITS = 48  # request ids below 2**48 (one per turn: ~10**14)
_RID_MASK = (1 << _RID_BITS) - 1
WHOLE_CONTEXT = 1 << 62  # `cacheable_tokens` of a sequence whose whole context may hit the prefix cache
# The simulated engine's context limit, both drivers' default (live backend, simulator): Qwen3 with YaRN; the SWE
# trace's contexts reach ~76k tokens at p99.
DEFAULT_MAX_MODEL_LEN = 131_072


class StepTally(Protocol):
    """Where an engine counts its work, if its driver keeps count (the simulator's `Metrics`, shared by every
    engine; a live engine keeps none). Rows are token sums per window of `window_s` (`time_windows.spread`)."""

    window_s: float
    computed_row: list[float]  # prompt tokens computed
    decode_row: list[float]  # output tokens produced
    prefill_starts: int
    prompt_tokens: int  # whole prompts of first prefills (not migrations)
    prefix_hit_tokens: int  # every tier's
    host_hit_tokens: int  # of them, those reloaded from the host KV tier
    migration_hit_tokens: int
    prefill_computed_tokens: int
    migration_recompute_tokens: int
    wasted_prefill_tokens: int  # computed for cancelled sequences
    decoded_tokens: int
    wasted_decoded_tokens: int  # produced for cancelled sequences


# The live simulated backend's `LiveSeq` subclasses it in interpreted code (`prorsa.native` compiles this module).
@mypyc_attr(allow_interpreted_subclasses=True)
class CoreSeq:
    """One request's work inside an engine: a prefill of `context_tokens`, then `output_tokens` of decode.

    The drivers subclass it with what they carry besides (the simulator's trajectory, the live stream)."""

    __slots__ = tuple(
        "rid key group_key group_tokens cacheable_tokens context_tokens output_tokens migrated"  # noqa: SIM905
        " cancelled hit_tokens to_compute_tokens computed_tokens est_tokens engine kv_tokens"
        " start_step target_step remote started_s reload_tokens".split()
    )

    def __init__(
        self,
        rid: int,
        key: str,
        context_tokens: int,
        output_tokens: int,
        *,
        group_key: str = "",
        group_tokens: int = 0,
        cacheable_tokens: int = WHOLE_CONTEXT,
        migrated: bool = False,
        remote: bool = False,
    ) -> None:
        self.rid = rid  # unique per engine core, < 2**48
        self.key = key  # prefix-cache key (the trajectory's)
        self.group_key = group_key  # prefix-cache key of its GRPO group's shared first prompt ("" if none)
        self.group_tokens = group_tokens  # tokens of that shared prompt
        self.cacheable_tokens = cacheable_tokens  # a prefix hit is at most this long
        self.context_tokens = context_tokens  # prompt to prefill (incl. output decoded before a migration)
        self.output_tokens = output_tokens  # tokens still to decode
        self.migrated = migrated  # prefilled again after its decode engine switched role (recomputation)
        self.cancelled = False  # dropped wherever it is found
        self.remote = (
            remote  # prefilled for a decode elsewhere, whatever this engine's role (a prefill engine's are)
        )
        # Prefill progress (set when an engine starts it).
        self.hit_tokens = 0  # prefix-cache hit at prefill start (every tier)
        self.reload_tokens = 0  # of it, tokens loaded from the host KV tier before its first chunk
        self.to_compute_tokens = 0  # context - hit
        self.computed_tokens = 0  # computed so far (chunked prefill)
        self.est_tokens = 0  # uncached tokens estimated while queued
        self.started_s = 0.0  # when its prefill started
        # Decode progress (on the engine that decodes it).
        self.engine: EngineCore | None = None  # the engine holding its KV
        self.kv_tokens = 0  # KV reserved on `engine` (context + output)
        self.start_step = 0  # engine step counter value when it joined the batch
        self.target_step = 0  # step counter value at which its last token is out


@mypyc_attr(allow_interpreted_subclasses=True)  # deep-copied by `Simulation.fork` (see `prorsa.native`)
class EngineCore:
    """State and stepping of one engine. Every method takes the current modelled time `now`, never earlier than
    the previous call's. The driver wakes the core at `wake_s` (set by the default `_wake_at`) with `on_wake`."""

    # Slots: an engine has ~40 attributes, more than CPython 3.11 keeps in a shared-key instance dict, so without
    # them every attribute access on the hot path is a dict lookup. One expression, not a tuple grown by `+=`,
    # which mypy cannot type (`prorsa.native_build` compiles this module).
    __slots__ = tuple(
        "p role state cache busy_s wake_s waiting_handoffs tally observed waiting_prompts"  # noqa: SIM905
        " own_prompts prompt_fetch_waiting handoff_fetch_waiting _cost _jump queue queued_tokens"
        " active _active_left _chunks seqs _finish_heap steps_done _ctx_base _target_sum"
        " kv_reserved arrivals incoming activity _token _t_start _jump_steps _jump_a _jump_b"
        " _drop_pending prefill_tokens_done decode_tokens_done".split()
    )

    def __init__(self, profile: ModelProfile, role: str) -> None:
        self.p = profile
        self.role = role
        self.state = ACTIVE
        self.cache = PrefixCache(profile.kv_capacity_tokens, profile.host_kv_tokens)
        # Role → seconds busy (the simulator shares one dict among engines).
        self.busy_s: dict[str, float] = defaultdict(float)
        self.wake_s: float | None = None  # when the activity in progress ends (None: idle)
        # Handoffs waiting for a decode engine with room, where the driver keeps them in one shared queue (the
        # simulator's router); an engine that decodes pulls at its step boundaries while any wait.
        self.waiting_handoffs: Sized = ()
        # Likewise prompts waiting in the shared prefill queue and in this engine's own (addressed) queue: an engine
        # that prefills pulls at its step boundaries while any wait (`_pull_prompts`).
        self.waiting_prompts: Sized = ()
        self.own_prompts: Sized = ()
        # Whether the driver holds a fetch of this engine waiting at the shared queues (work posted there goes
        # straight to it): while one waits and no work does, a step boundary has nothing to pull.
        self.prompt_fetch_waiting = True
        self.handoff_fetch_waiting = True
        self.tally: StepTally | None = None  # where to count the work done (None: nowhere)
        self.observed = False  # whether the driver wants `_on_decode_started` and `_on_progress`
        self._cost = step_cost(profile)  # the perf model's fast path for this profile
        self._jump = self._cost.jump_s  # bound once: a jump is planned twice per turn
        # Prefill side: queued (not started) and started-but-unfinished (chunked) prompts.
        self.queue: deque[CoreSeq] = deque()
        self.queued_tokens = 0  # Σ est_tokens of `queue`
        self.active: list[CoreSeq] = []
        self._active_left = 0  # Σ (to_compute - computed) of `active`: prefill tokens still to compute
        # Decode side: batch, finish heap of exactly the batch (a sequence that leaves early, migrated or cancelled,
        # is taken out at once: `_forget_finishes`), step counter, context bookkeeping. A heap entry is one int,
        # target_step << _RID_BITS | rid (ints compare faster than (target_step, rid) tuples, in the same order).
        self.seqs: dict[int, CoreSeq] = {}
        self._finish_heap: list[int] = []
        self.steps_done = 0
        self._ctx_base = 0  # Σ (context - start_step): total context = _ctx_base + batch × steps_done
        self._target_sum = 0  # Σ target_step: tokens left = _target_sum - batch × steps_done
        self.kv_reserved = 0
        # Handed-off requests whose KV has arrived, admitted at the next step.
        self.arrivals: list[CoreSeq] = []
        self.incoming = 0  # handoffs accepted, KV in transfer
        # The activity in progress.
        self.activity = IDLE
        self._token = 0  # bumped by every (re)plan: a wake-up carrying an older one is superseded
        self._t_start = 0.0
        self._jump_steps = 0
        self._jump_a = 0.0  # first step time of the jump
        self._jump_b = 0.0  # step time increase per step
        self._chunks: list[tuple[CoreSeq, int]] = []
        self._drop_pending = False  # a cancelled sequence is in the batch
        # Work done, cumulative (the policy view turns them into per-interval rates).
        self.prefill_tokens_done = 0
        self.decode_tokens_done = 0

    # -- hooks: what the driver does with the core's effects -----------------------------------------------------

    def _wake_at(self, t: float, token: int) -> None:
        """Run `on_wake(t)` then (unless a later plan supersedes `token`). Default: remember it in `wake_s`."""
        self.wake_s = t

    def _hand_off(self, seq: CoreSeq, now: float) -> None:
        """`seq` is prefilled here and decodes elsewhere (its KV goes to a decode engine)."""
        raise NotImplementedError

    def _forward_handoff(self, seq: CoreSeq, now: float) -> None:
        """A handoff arrived while this engine drains: send its KV on to another decode engine."""
        self._hand_off(seq, now)

    def _hands_off_while_draining(self) -> bool:
        """Whether a mixed engine that drains sends a prompt it finishes to a decode engine (one exists)."""
        return False

    def _on_prefill_done(self, seq: CoreSeq, now: float) -> None:
        """A prompt is prefilled here (before it is handed on or joins the batch)."""

    def _on_decode_started(self, seq: CoreSeq, now: float) -> None:
        """`seq` joined the decode batch (called only when `observed`)."""

    def _on_progress(self, now: float) -> None:
        """Decode steps ended at `now`; `seqs` hold the batch's progress (called only when `observed`)."""

    def _on_finished(self, seq: CoreSeq, now: float) -> None:
        """`seq` decoded its last token (it has left the batch)."""

    def _pull_handoffs(self, now: float) -> None:
        """At a step boundary on an engine that decodes, with `waiting_handoffs` non-empty or no fetch waiting
        (`handoff_fetch_waiting`): take what its room allows (`accept_handoff`)."""

    def _pull_prompts(self, now: float) -> None:
        """At a step boundary on an engine that prefills, with `waiting_prompts` or `own_prompts` non-empty or no
        fetch waiting (`prompt_fetch_waiting`): take what its room allows (`take_prompt`)."""

    def _drain(self, now: float) -> None:
        """At a step boundary while DRAINING, before planning (the driver migrates long decodes)."""

    def _switching(self, now: float) -> None:
        """At a step boundary while switching in place (handing on what the switch rule says)."""

    def _on_drained(self, now: float) -> None:
        """DRAINING, and nothing is left (`drained()`): the driver reconfigures the engine."""

    # -- what placement and the views read ------------------------------------------------------------------------

    @property
    def accepts_prefill(self) -> bool:
        return self.state == ACTIVE and self.role != "decode"

    def prefill_load_s(self) -> float:
        """Estimated seconds of prefill work ahead of a new prompt, plus a batch-fullness term where its chunks
        share steps with decodes (mixed, or holding both after an in-place switch)."""
        load = (self.queued_tokens + self._active_left) / self.p.prefill_tokens_per_s
        if self.seqs:
            load += len(self.seqs) / self.p.max_batch
        return load

    def decode_load(self) -> int:
        return len(self.seqs) + len(self.arrivals) + self.incoming + len(self.active)

    def has_decode_room(self, kv_tokens: int) -> bool:
        held = self.decode_load()
        if held == 0:  # an empty engine always admits (a request larger than the KV cache must run somewhere)
            return True
        return held < self.p.max_batch and self.kv_reserved + kv_tokens <= self.p.kv_capacity_tokens

    def decode_tokens_left(self) -> int:
        """Output tokens the batch has still to generate (Σ over its sequences of target_step − steps_done)."""
        return self._target_sum - len(self.seqs) * self.steps_done

    def steps_at(self, now: float) -> int:
        """The step counter as of `now`: `steps_done` plus the steps of the decode jump in progress that end at or
        before `now` (within a nanosecond: float rounding) — what a real engine would have streamed by then."""
        done = self.steps_done
        if self.activity != JUMP:
            return done  # idle, or a prefill or mixed step in progress: its one step is not out yet
        dt = now - self._t_start + 1e-9
        a, b, steps = self._jump_a, self._jump_b, self._jump_steps
        if dt <= 0 or steps <= 0:
            return done
        if b > 0:
            c = a - b / 2
            k = int((-c + math.sqrt(c * c + 2 * b * dt)) / b)
        else:
            k = int(dt / a) if a > 0 else 0
        k = max(0, min(k, steps))
        # Fix the float rounding of the root: the largest k whose end is <= dt.
        while k > 0 and k * a + b * k * (k - 1) / 2 > dt:
            k -= 1
        while k < steps and (k + 1) * a + b * (k + 1) * k / 2 <= dt:
            k += 1
        return done + k

    def decoded_so_far(self, seq: CoreSeq) -> int:
        """Output tokens of `seq` (decoding here) out so far: the one its prefill sampled and one per step."""
        return self.steps_done - seq.start_step + 1

    def drained(self) -> bool:
        return not (self.seqs or self.arrivals or self.incoming or self.active or self.queue)

    def set_role(self, role: str) -> None:
        """Serve `role` from now on, in place: one KV layout serves every role (NixlConnector's kv_both), so what
        the engine holds keeps running (see the module docstring) and its prefix cache survives; an engine that
        now only decodes gives that cache up block by block as decodes take its KV. A restart's loss of the cache
        is the driver's (`cache.clear()`)."""
        self.role = role
        self.cache.resize(max(self.p.kv_capacity_tokens - self.kv_reserved, 0))

    # -- work in ------------------------------------------------------------------------------------------------

    def enqueue_prefill(self, seq: CoreSeq, now: float) -> None:
        """Queue a prompt here."""
        hit = self._lookup(seq)
        seq.est_tokens = seq.context_tokens - hit
        if self.cache.host is not None:  # a reload is not prefill work
            seq.est_tokens -= self._host_extra(seq, hit)
        if (
            self.activity == IDLE
            and self.role == "prefill"
            and self.state == ACTIVE
            and seq.remote
            and not (self.queue or self.active or self.seqs or self.arrivals)
            and not (seq.cancelled or self._drop_pending)
        ):
            # Shortcut, the same step as queueing and then `_poke` → `_boundary` → `_plan_prefill_step` would
            # start: a lone prompt on an idle prefill engine (the common case of a tool-heavy workload), whose
            # prefix hit was just looked up (nothing in between changes this engine's cache).
            self._start_prefill(seq, now, hit)
            p = self.p
            n = seq.to_compute_tokens
            if n > p.prefill_batch_tokens:
                n = p.prefill_batch_tokens
            self._chunks = [(seq, n)]
            step_s = self._cost.prefill_step_s(((n, seq.hit_tokens),))
            if seq.reload_tokens:
                step_s = self._with_reloads(step_s)
            self._schedule(PREFILL_STEP, now, step_s)
            return
        self.queue.append(seq)
        self.queued_tokens += seq.est_tokens
        self._poke(now)

    def take_prompt(self, seq: CoreSeq) -> None:
        """Queue a prompt pulled at a step boundary (`_pull_prompts`): the boundary plans next, so no poke."""
        hit = self._lookup(seq)
        seq.est_tokens = seq.context_tokens - hit
        if self.cache.host is not None:  # a reload is not prefill work
            seq.est_tokens -= self._host_extra(seq, hit)
        self.queue.append(seq)
        self.queued_tokens += seq.est_tokens

    def accept_handoff(self, seq: CoreSeq, now: float) -> float:
        """Take a prefilled request: reserve its KV and start the transfer. Returns when its KV arrives (the driver
        calls `on_handoff_arrive` then)."""
        seq.engine = self
        seq.kv_tokens = kv = seq.context_tokens + seq.output_tokens
        self.kv_reserved += kv  # _reserve, inlined (once per turn)
        self.cache.resize(max(self.p.kv_capacity_tokens - self.kv_reserved, 0))
        self.incoming += 1
        return now + self._cost.kv_transfer_s(seq.context_tokens)

    def on_handoff_arrive(self, seq: CoreSeq, now: float) -> None:
        self.incoming -= 1
        if seq.cancelled or self.state == DRAINING or self.state == RECONFIG:
            self._reserve(-seq.kv_tokens)
            seq.engine = None
            if not seq.cancelled:  # draining: forward the KV to another decode engine
                self._forward_handoff(seq, now)
            self._poke(now)
            return
        self.arrivals.append(seq)
        if self.activity == JUMP:  # _poke, inlined for the common case (not RECONFIG here)
            self._interrupt(now)
        elif self.activity == IDLE:
            self._boundary(now)

    def cancel(self, now: float) -> None:
        """A sequence held here was cancelled (`cancelled` set): drop it at the next step boundary."""
        self._drop_pending = True
        self._poke(now)

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
        """The activity in progress ends (the driver has checked the wake-up's token: not superseded)."""
        self.wake_s = None
        activity = self.activity
        if activity == JUMP:  # _complete, inlined for the two most frequent activities
            t0 = self._t_start
            self.activity = IDLE
            self.busy_s[self.role] += now - t0
            self._apply_decode_steps(self._jump_steps, t0, now)
        elif activity == PREFILL_STEP:
            t0 = self._t_start
            self.activity = IDLE
            self.busy_s[self.role] += now - t0
            self._apply_chunks(t0, now)
        else:
            self._complete(now)
        self._boundary(now)

    def _complete(self, now: float) -> None:
        """Apply the effects of the activity that ends at `now`."""
        kind, t0 = self.activity, self._t_start
        self.activity = IDLE
        self.wake_s = None
        self.busy_s[self.role] += now - t0  # busy seconds of the role, once per activity
        if kind == JUMP:
            self._apply_decode_steps(self._jump_steps, t0, now)
        elif kind == MIXED_STEP:
            if self.seqs:
                self._apply_decode_steps(1, t0, now)
            self._apply_chunks(t0, now)
        elif kind == PREFILL_STEP:
            self._apply_chunks(t0, now)

    def _boundary(self, now: float) -> None:
        """Between steps: admit arrivals, drain or pull handoffs, plan the next activity."""
        if self._drop_pending:
            self._drop_pending = False
            self.drop_cancelled(now)
        if self.arrivals:
            for seq in self.arrivals:
                if seq.cancelled:
                    self._reserve(-seq.kv_tokens)
                    seq.engine = None
                else:
                    self._join_batch(seq, now)
            self.arrivals.clear()
        role, state = self.role, self.state
        draining = state == DRAINING
        if draining:
            self._drain(now)
        elif state != ACTIVE:
            self._switching(now)  # in place: it pulls nothing until the switch completes
        else:
            if role != "prefill" and (self.waiting_handoffs or not self.handoff_fetch_waiting):
                self._pull_handoffs(now)
            if role != "decode" and (
                self.waiting_prompts or self.own_prompts or not self.prompt_fetch_waiting
            ):
                self._pull_prompts(now)
        # Plan the next activity. With no prompt started or queued there are no chunks to take; a step that takes
        # none (a prompt waits for KV room) leaves the decodes to jump.
        if self.active or self.queue:
            planned = self._plan_mixed_step(now) if role == "mixed" else self._plan_prefill_step(now)
            if not planned and self.seqs:
                self._plan_jump(now)
        elif self.seqs:
            self._plan_jump(now)
        if draining and self.activity == IDLE and self.drained():
            self._on_drained(now)

    def _plan_prefill_step(self, now: float) -> bool:
        """Start a prefill step if prompts can go in (False: nothing to chunk). Decodes the engine still holds
        after an in-place switch ride along, one token each: the step costs its prefill compute plus their decode
        step (the prefill step's own overhead is the decode step's, in one forward pass)."""
        p = self.p
        self._chunks = chunks = self._take_chunks(p.prefill_batch_tokens, p.prefill_batch_tokens, now)
        if not chunks:
            return False
        priced = [(n, r.hit_tokens + r.computed_tokens) for r, n in chunks]
        step_s = self._cost.prefill_step_s(priced)
        batch = len(self.seqs)
        if batch:
            decode_s = self._cost.decode_step_s(batch, self._ctx_base + batch * self.steps_done)
            step_s = step_s - p.prefill_overhead_s + decode_s
        if self.cache.host is not None:
            step_s = self._with_reloads(step_s)
        self._schedule(MIXED_STEP if batch else PREFILL_STEP, now, step_s)
        return True

    def _plan_mixed_step(self, now: float) -> bool:
        """Start a chunked-prefill step if prompts can go in; False: nothing to chunk (decode only)."""
        per_request = self.p.mixed_chunk_tokens
        self._chunks = self._take_chunks(per_request * self.p.dp_ranks, per_request, now)
        if not self._chunks:
            return False
        step_s = self._mixed_step_s()
        if self.cache.host is not None:
            step_s = self._with_reloads(step_s)
        self._schedule(MIXED_STEP, now, step_s)
        return True

    def _schedule(self, kind: int, now: float, duration_s: float) -> None:
        self.activity = kind
        self._t_start = now
        self._token = token = self._token + 1
        self._wake_at(now + duration_s, token)

    # -- prefill ----------------------------------------------------------------------------------------------------

    def _lookup(self, seq: CoreSeq) -> int:
        """Tokens of `seq`'s context this engine holds (its own prefix or its group's), at most `cacheable_tokens`."""
        context, bound = seq.context_tokens, seq.cacheable_tokens
        if bound < context:
            context = bound
        return self.cache.lookup(seq.key, context, seq.group_key, seq.group_tokens)

    def _host_extra(self, seq: CoreSeq, hit: int) -> int:
        """Tokens of `seq`'s context the host tier holds beyond the device hit `hit` (the reload it would take)."""
        context, bound = seq.context_tokens, seq.cacheable_tokens
        if bound < context:
            context = bound
        extra = self.cache.lookup_host(seq.key, context, seq.group_key, seq.group_tokens) - hit
        return extra if extra > 0 else 0

    def _with_reloads(self, step_s: float) -> float:
        """`step_s` for a step that also loads the host-tier hits of the prompts it starts (their first chunk):
        the load overlaps the step's compute layer by layer, so the step lasts the longer of the two."""
        reloads = [r.reload_tokens for r, _ in self._chunks if r.reload_tokens and r.computed_tokens == 0]
        if not reloads:
            return step_s
        load_s = pm.host_reload_step_s(self.p, reloads)
        return load_s if load_s > step_s else step_s

    def _take_chunks(self, budget: int, per_request: int, now: float) -> list[tuple[CoreSeq, int]]:
        """Chunks for the next step: started prompts first, then new ones from the queue (not while draining)."""
        chunks: list[tuple[CoreSeq, int]] = []
        for seq in self.active:
            if budget <= 0:
                return chunks
            n = min(seq.to_compute_tokens - seq.computed_tokens, per_request, budget)
            chunks.append((seq, n))
            budget -= n
        while budget > 0 and self.queue and self.state != DRAINING:
            seq = self.queue[0]
            if seq.cancelled:
                self.queue.popleft()
                self.queued_tokens -= seq.est_tokens
                continue
            if not seq.remote and not self.has_decode_room(seq.context_tokens + seq.output_tokens):
                break  # FCFS: wait for KV or a batch slot
            self.queue.popleft()
            self.queued_tokens -= seq.est_tokens
            self._start_prefill(seq, now)
            n = min(seq.to_compute_tokens, per_request, budget)
            chunks.append((seq, n))
            budget -= n
        return chunks

    def _start_prefill(self, seq: CoreSeq, now: float, hit: int | None = None) -> None:
        """Start computing `seq` (`hit`: its prefix hit, if just looked up here)."""
        if hit is None:
            hit = self._lookup(seq)
        device = hit  # what the GPUs hold; beyond it, what the host tier holds is reloaded
        if self.cache.host is not None:
            hit += self._host_extra(seq, device)
        context = seq.context_tokens
        if hit >= context:  # the last prompt token is always recomputed (vLLM does)
            hit = context - 1 if context > 0 else 0
        seq.hit_tokens = hit
        seq.reload_tokens = reload = hit - device if hit > device else 0
        seq.to_compute_tokens = to_compute = context - hit
        seq.computed_tokens = 0
        self.active.append(seq)
        self._active_left += to_compute
        seq.started_s = now
        if not seq.remote:  # it decodes here: its KV is reserved from its prefill on
            seq.engine = self
            seq.kv_tokens = context + seq.output_tokens
            self._reserve(seq.kv_tokens)
        tally = self.tally  # prefill starts and prompt tokens (once per turn)
        if tally is not None:
            if seq.migrated:
                tally.migration_hit_tokens += hit
            else:
                tally.prefill_starts += 1
                tally.prompt_tokens += context
                tally.prefix_hit_tokens += hit
                tally.host_hit_tokens += reload

    def _mixed_step_s(self) -> float:
        priced = [(n, r.hit_tokens + r.computed_tokens) for r, n in self._chunks]
        batch = len(self.seqs)
        return self._cost.mixed_chunks_step_s(priced, batch, self._ctx_base + batch * self.steps_done)

    def _apply_chunks(self, t0: float, now: float) -> None:
        computed = recomputed = wasted = sampled = 0
        for seq, n in self._chunks:
            seq.computed_tokens += n
            self._active_left -= n
            if seq.cancelled:
                wasted += n
                self._active_left -= seq.to_compute_tokens - seq.computed_tokens
                self.active.remove(seq)
                if seq.engine is self:
                    self._reserve(-seq.kv_tokens)
                    seq.engine = None
                continue
            if seq.migrated:
                recomputed += n
            else:
                computed += n
            if seq.computed_tokens >= seq.to_compute_tokens:
                self.active.remove(seq)
                sampled += 1
                self._prefill_finished(seq, now)
        self._chunks = []
        done = computed + recomputed + wasted
        self.prefill_tokens_done += done
        tally = self.tally
        if tally is None:
            return
        tally.prefill_computed_tokens += computed
        tally.migration_recompute_tokens += recomputed
        tally.wasted_prefill_tokens += wasted
        # Prompt tokens computed (once per prefill step), with `spread`'s common case inlined: inside one window.
        row, w = tally.computed_row, tally.window_s
        index = int(t0 / w)
        if t0 < now and int(now / w) == index and len(row) > index:
            row[index] += done
        else:
            spread(row, w, t0, now, done)
        if sampled:  # first output tokens, out at the step's end
            tally.decoded_tokens += sampled
            row, index = tally.decode_row, int(now / w)
            if len(row) > index:
                row[index] += sampled
            else:
                spread(row, w, now, now, sampled)

    def _prefill_finished(self, seq: CoreSeq, now: float) -> None:
        self.cache.insert(seq.key, seq.context_tokens, now, seq.group_key, seq.group_tokens)
        self._on_prefill_done(seq, now)
        if seq.output_tokens <= 1:  # the token the prefill step sampled ends the turn: nothing to decode
            if seq.engine is self:
                self._reserve(-seq.kv_tokens)
                seq.engine = None
            if not seq.remote:
                self.cache.insert(
                    seq.key, seq.context_tokens + seq.output_tokens, now, seq.group_key, seq.group_tokens
                )
            self._on_finished(seq, now)
        elif seq.remote or (
            self.state == DRAINING and self._hands_off_while_draining()  # leaving: decode elsewhere
        ):
            if seq.engine is self:  # it reserved its KV to decode here: the decode engine holds it now
                self._reserve(-seq.kv_tokens)
                seq.engine = None
            self._hand_off(seq, now)
        else:
            self._join_batch(seq, now)

    # -- decode -----------------------------------------------------------------------------------------------------

    def _join_batch(self, seq: CoreSeq, now: float) -> None:
        """A prefilled sequence (here, or elsewhere and its KV arrived) starts decoding. Its first output token was
        sampled by the step that completed its prompt, so it is in the context and one fewer step is left."""
        seq.start_step = start = self.steps_done
        seq.target_step = target = start + seq.output_tokens - 1
        self.seqs[seq.rid] = seq
        heappush(self._finish_heap, target << _RID_BITS | seq.rid)
        self._ctx_base += seq.context_tokens + 1 - start
        self._target_sum += target
        if self.observed:
            self._on_decode_started(seq, now)

    def _leave_batch(self, seq: CoreSeq) -> None:
        """Take a sequence out of the batch (its finish heap entry is the caller's: popped, or `_forget_finishes`)."""
        del self.seqs[seq.rid]
        self._ctx_base -= seq.context_tokens + 1 - seq.start_step
        self._target_sum -= seq.target_step
        self.kv_reserved -= seq.kv_tokens  # _reserve(-kv), inlined: once per turn
        self.cache.resize(max(self.p.kv_capacity_tokens - self.kv_reserved, 0))
        seq.engine = None

    def release_decode(self, seq: CoreSeq, now: float) -> int:
        """Stop decoding `seq` here (at a step boundary) and return the output tokens it has so far. Its KV stays
        in the prefix cache (prompt and output so far), as vLLM keeps an aborted request's blocks hashed until they
        are reused; the caller hands it on and then calls `_forget_finishes`."""
        decoded = self.decoded_so_far(seq)
        self._leave_batch(seq)
        self.cache.insert(seq.key, seq.context_tokens + decoded, now, seq.group_key, seq.group_tokens)
        return decoded

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
        self._wake_at(now + (m * a + b * m * (m - 1) / 2), token)

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
        tally = self.tally
        if tally is not None:
            tally.decoded_tokens += tokens
            # Output tokens (once per decode jump), with `spread`'s common case inlined: a jump inside one window.
            row, w = tally.decode_row, tally.window_s
            index = int(t0 / w)
            if t0 < now and int(now / w) == index and len(row) > index:
                row[index] += tokens
            else:
                spread(row, w, t0, now, tokens)
        if self.observed:
            self._on_progress(now)
        heap, bound = self._finish_heap, (steps + 1) << _RID_BITS  # entries below `bound`: finished
        role_caches = self.role != "decode"  # an engine that prefills keeps a finished turn for its next one
        while heap and heap[0] < bound:
            seq = seqs[heappop(heap) & _RID_MASK]
            self._leave_batch(seq)
            if seq.cancelled:  # nobody waits for its tokens
                if tally is not None:
                    tally.wasted_decoded_tokens += seq.output_tokens
                continue
            if role_caches:
                self.cache.insert(
                    seq.key, seq.context_tokens + seq.output_tokens, now, seq.group_key, seq.group_tokens
                )
            self._on_finished(seq, now)

    def drop_cancelled(self, now: float) -> None:
        """Remove decodes of cancelled sequences from the batch, their KV kept cached (`release_decode`): a stream
        stopped to be handed on is prefilled again from it (`switch_rule.hands_on_decodes`)."""
        cancelled = [r for r in self.seqs.values() if r.cancelled]
        for seq in cancelled:
            if self.tally is not None:
                self.tally.wasted_decoded_tokens += self.decoded_so_far(seq)
            self.release_decode(seq, now)
        if cancelled:
            self._forget_finishes()

    # -- helpers ------------------------------------------------------------------------------------------------------

    def _reserve(self, tokens: int) -> None:
        """Change reserved KV; the prefix cache lives in what running work leaves free."""
        self.kv_reserved += tokens
        self.cache.resize(max(self.p.kv_capacity_tokens - self.kv_reserved, 0))
