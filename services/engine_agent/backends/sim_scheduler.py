"""The simulated engine's scheduler: continuous batching with chunked prefill, stepped by the performance model.

Pure (no asyncio, no clock: `now` is a parameter; durations come from `perf_model`), so the async shell
(`sim_backend.py`) only waits out each step's modelled `Step.duration_s` between `plan()` and `apply()`. The rules
mirror the discrete-event simulator (`prorsa/sim/engine.py`), so the live simulated system and the simulator agree:

* A step carries prefill chunks and the whole decode batch. In the `prefill` role a step takes queued prompts FIFO
  up to `prefill_batch_tokens` of uncached tokens and costs `prefill_step_time_s` (`prefill_overhead_s + Σ
  prefill_compute_s(chunk, context before it)`); in the other roles chunks are at most `mixed_chunk_tokens` per
  request (and per DP rank) and a step costs `mixed_step_time_s` of `mixed_step_shape(chunks)` (the decode step
  plus the prefill compute; DP attention stalls every rank).
  A step with no prefill costs `decode_step_time_s(batch, total context)`.
* The step that completes a prompt samples its first output token (vLLM does), so a prefill-for-remote-decode
  yields the first token and a local prefill streams it at once.
* Prefix cache: a prompt's hit is `min(cached prefix of its trajectory, sim_cacheable_tokens or the context)`,
  and the last context token is always recomputed. A computed prompt is cached; a local (`generate`) sequence
  caches prompt + output when it finishes; a decode that pulled its KV from elsewhere caches nothing.
* KV: a sequence decoding here reserves context + output tokens on admission (no preemption); the prefix cache
  lives in what reservations leave free. A `generate` prompt waits (FCFS) for a batch slot and KV room.
* Coalescing: a pure decode step (no prefill chunk) may stand for `Step.steps` consecutive decode steps of the same
  batch when `plan` is given a budget. The batch cannot change inside such a block: no chunk is pending, arrivals
  and admissions wait for its end, and `steps` never passes the first sequence to finish (it may finish on the
  last step). The block lasts exactly Σ decode_step_time_s over its steps, each step one token longer per
  sequence, so the virtual time and the tokens are those of stepping one at a time. It exists because a decode step
  is 10-25 ms virtual: at a speed-up of 50+ one step is well under a millisecond of wall time, below the cost of
  one trip through the async engine loop.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from proto import GenerateRequest
from services.engine_agent.backend import BackendStats, PrefillInfo
from services.engine_agent.backends.sim_tokens import SimTokens
from services.engine_agent.prefix_cache import PrefixCache
from services.runtime import perf_model as pm
from services.runtime.perf_model import ModelProfile

SeqMode = Literal["generate", "prefill", "decode"]

DEFAULT_MAX_MODEL_LEN = 131_072  # Qwen3 with YaRN; the SWE trace's contexts reach ~76k tokens at p99


def context_tokens(request: GenerateRequest) -> int:
    """Tokens in the request's context: the prompt plus output already streamed before a migration."""
    return request.prompt_len + len(request.resume_token_ids)


def output_end(request: GenerateRequest, max_model_len: int) -> tuple[int, str]:
    """(whole-turn output length, finish reason): the workload's `sim_output_tokens` (else max_tokens), capped by
    max_tokens and the model length. "length" when a cap ends it, else "stop" (as if the model sampled EOS)."""
    max_tokens = request.sampling.max_tokens
    cap = min(max_tokens, max(0, max_model_len - request.prompt_len))
    want = request.sim_output_tokens if request.sim_output_tokens > 0 else max_tokens
    end = min(want, cap)
    return end, "length" if end == cap else "stop"


@dataclass(eq=False, slots=True)
class SimSeq:
    """One request inside the simulated engine."""

    request_id: str
    traj_id: str
    mode: SeqMode
    context_tokens: int  # tokens in KV once prefilled (decode mode: prompt + the handed-off first token)
    pos: int  # next output position to sample (whole-turn index)
    end: int  # output stops before this position
    end_reason: str  # finish reason when `end` is reached
    tokens: SimTokens
    want_logprobs: bool
    cacheable_tokens: int = 0  # prefix-cache lookup bound
    hit_tokens: int = 0
    to_compute: int = 0
    computed: int = 0
    kv_tokens: int = 0  # reserved KV
    prefill_started_s: float = 0.0
    out_ids: list[int] = field(default_factory=list)
    out_lps: list[float] = field(default_factory=list)
    prefill_info: PrefillInfo | None = None
    first: tuple[int, float] | None = None  # prefill mode: the sampled first token
    done: bool = False
    aborted: bool = False
    finish_reason: str = ""

    def take(self) -> tuple[list[int], list[float] | None]:
        """The tokens produced since the last take."""
        ids, lps = self.out_ids, self.out_lps
        self.out_ids, self.out_lps = [], []
        return ids, (lps if self.want_logprobs else None)


@dataclass(frozen=True, slots=True)
class Step:
    duration_s: float  # modelled (virtual) seconds, over all `steps`
    chunks: list[tuple[SimSeq, int]]  # prefill chunks: (sequence, tokens)
    batch: list[SimSeq]  # sequences decoding one token per step
    steps: int = 1  # consecutive engine steps this stands for (> 1 only for a coalesced pure-decode block)


class SimScheduler:
    """Queues, batch and KV of one simulated engine. `plan()` picks the next step, `apply()` performs it."""

    def __init__(self, profile: ModelProfile, role: str, max_model_len: int) -> None:
        self.p = profile
        self.role = role
        self.max_model_len = max_model_len
        self.cache = PrefixCache(profile.kv_capacity_tokens)
        self.queue: deque[SimSeq] = deque()  # prompts not started
        self.active: list[SimSeq] = []  # prompts being prefilled (chunked)
        self.running: dict[str, SimSeq] = {}  # decoding
        self.arrivals: deque[SimSeq] = deque()  # decodes whose KV arrived, joining at the next step
        self.incoming: dict[str, SimSeq] = {}  # decodes whose KV is in transfer
        self.kv_reserved = 0
        self._ctx_total = 0  # Σ context of `running`

    # -- work in and out -----------------------------------------------------------------------------------------

    def add_prefill(self, seq: SimSeq) -> None:
        self.queue.append(seq)

    def add_incoming(self, seq: SimSeq) -> None:
        """A handoff pulled: reserve its KV while it transfers."""
        seq.kv_tokens = seq.context_tokens + (seq.end - seq.pos)
        self._reserve(seq.kv_tokens)
        self.incoming[seq.request_id] = seq

    def arrive(self, request_id: str) -> bool:
        """The KV of an incoming decode arrived; False if it was aborted meanwhile."""
        seq = self.incoming.pop(request_id, None)
        if seq is None:
            return False
        self.arrivals.append(seq)
        return True

    def remove(self, request_id: str) -> SimSeq | None:
        """Take a request out wherever it is (abort); frees its KV. Returns it, or None if unknown."""
        for seq in list(self.queue) + self.active + list(self.arrivals):
            if seq.request_id == request_id:
                self._drop(seq)
                return seq
        seq = self.running.get(request_id) or self.incoming.get(request_id)
        if seq is not None:
            self._drop(seq)
        return seq

    def set_role(self, role: str) -> None:
        """Reconfigured for `role`. The prefix cache survives between the roles that prefill (no restart: one KV
        layout serves every role); a decode-only engine gives its KV to handed-off decodes."""
        self.role = role
        if role == "decode":
            self.cache.clear()
        self.cache.resize(max(self.p.kv_capacity_tokens - self.kv_reserved, 0))

    def stats(self) -> BackendStats:
        return BackendStats(
            running=len(self.running) + len(self.active),
            waiting=len(self.queue) + len(self.arrivals) + len(self.incoming),
            kv_used_tokens=self.kv_reserved,
            kv_capacity_tokens=self.p.kv_capacity_tokens,
            max_batch=self.p.max_batch,
            prefix_cache_tokens=self.cache.used_tokens,
        )

    # -- stepping ------------------------------------------------------------------------------------------------

    def plan(self, now: float, coalesce_s: float = 0.0) -> Step | None:
        """The next step (None when idle). Admits arrivals and starts queued prompts as room allows.

        With no prefill chunk to run, the decode steps that fit in `coalesce_s` virtual seconds (at least one)
        become one `Step` (see "Coalescing" in the module docstring); `coalesce_s = 0` plans one step at a time.
        """
        while self.arrivals and len(self.running) < self.p.max_batch:
            self._join(self.arrivals.popleft())
        if self.role == "prefill":
            chunks = self._take_chunks(self.p.prefill_batch_tokens, self.p.prefill_batch_tokens, now)
        else:
            per_request = self.p.mixed_chunk_tokens
            chunks = self._take_chunks(per_request * self.p.dp_ranks, per_request, now)
        batch = list(self.running.values())
        if not chunks and not batch:
            return None
        if chunks:
            return Step(self._duration_s(chunks, len(batch)), chunks, batch)
        steps, duration_s = self._decode_block(batch, coalesce_s)
        return Step(duration_s, chunks, batch, steps)

    def apply(self, step: Step, now: float) -> list[SimSeq]:
        """Perform a planned step at its end time `now`; returns the sequences that produced output or ended."""
        touched: list[SimSeq] = []
        for seq, n in step.chunks:
            if seq.done:
                continue  # aborted during the step
            seq.computed += n
            if seq.computed >= seq.to_compute:
                self._prefilled(seq, now)
                touched.append(seq)
        for seq in step.batch:
            if seq.done:
                continue  # aborted during the step
            for _ in range(step.steps):
                self._sample(seq)
            if seq.pos >= seq.end:
                self._finish(seq, now)
            touched.append(seq)
        return touched

    # -- internals -----------------------------------------------------------------------------------------------

    def _decode_block(self, batch: list[SimSeq], budget_s: float) -> tuple[int, float]:
        """(steps, virtual seconds) of the longest run of pure decode steps lasting at most `budget_s` (at least
        one step), that no sequence of `batch` outlives: it stops at the first sequence's last token."""
        size = len(batch)
        max_steps = max(1, min(seq.end - seq.pos for seq in batch))
        # Step i reads the context left by the i steps before it: every sequence grew by one token per step.
        # Summed step by step (cheap: ~1 µs a step) so the total is the one-step-at-a-time sum to rounding.
        total_s = pm.decode_step_time_s(self.p, size, self._ctx_total)
        steps = 1
        while steps < max_steps:
            next_s = pm.decode_step_time_s(self.p, size, self._ctx_total + steps * size)
            if total_s + next_s > budget_s:
                break
            total_s += next_s
            steps += 1
        return steps, total_s

    def _take_chunks(self, budget: int, per_request: int, now: float) -> list[tuple[SimSeq, int]]:
        chunks: list[tuple[SimSeq, int]] = []
        for seq in self.active:
            if budget <= 0:
                return chunks
            n = min(seq.to_compute - seq.computed, per_request, budget)
            chunks.append((seq, n))
            budget -= n
        while budget > 0 and self.queue:
            seq = self.queue[0]
            if seq.mode == "generate" and not self._decode_room(seq.context_tokens + seq.end - seq.pos):
                break  # FCFS: wait for KV or a batch slot
            self.queue.popleft()
            self._start(seq, now)
            n = min(seq.to_compute, per_request, budget)
            chunks.append((seq, n))
            budget -= n
        return chunks

    def _decode_room(self, kv_tokens: int) -> bool:
        held = len(self.running) + len(self.arrivals) + len(self.incoming) + len(self.active)
        if held == 0:
            return (
                True  # an empty engine always admits: a request larger than the KV cache must run somewhere
            )
        return held < self.p.max_batch and self.kv_reserved + kv_tokens <= self.p.kv_capacity_tokens

    def _start(self, seq: SimSeq, now: float) -> None:
        hit = self.cache.lookup(seq.traj_id, seq.cacheable_tokens or seq.context_tokens)
        seq.hit_tokens = max(
            0, min(hit, seq.context_tokens - 1)
        )  # the last prompt token is always recomputed
        seq.to_compute = seq.context_tokens - seq.hit_tokens
        seq.prefill_started_s = now
        if seq.mode == "generate":
            seq.kv_tokens = seq.context_tokens + (seq.end - seq.pos)
            self._reserve(seq.kv_tokens)
        self.active.append(seq)

    def _duration_s(self, chunks: list[tuple[SimSeq, int]], batch: int) -> float:
        if not chunks:
            return pm.decode_step_time_s(self.p, batch, self._ctx_total)
        priced = [(n, s.hit_tokens + s.computed) for s, n in chunks]
        if self.role == "prefill" and batch == 0:
            return pm.prefill_step_time_s(self.p, priced)
        total, cached, largest = pm.mixed_step_shape(self.p, priced)
        return pm.mixed_step_time_s(
            self.p,
            total,
            batch,
            self._ctx_total,
            prefill_cached_tokens=cached,
            largest_rank_prefill_tokens=largest,
        )

    def _prefilled(self, seq: SimSeq, now: float) -> None:
        self.active.remove(seq)
        self.cache.insert(seq.traj_id, seq.context_tokens, now)
        info = PrefillInfo(
            new_tokens=seq.to_compute, cached_tokens=seq.hit_tokens, prefill_s=now - seq.prefill_started_s
        )
        if seq.mode == "prefill":
            seq.first = seq.tokens.at(seq.pos)
            seq.prefill_info = info
            seq.done = True
            seq.finish_reason = seq.end_reason if seq.pos + 1 >= seq.end else ""
            return
        seq.prefill_info = info
        self._sample(seq)
        if seq.pos >= seq.end:
            self._finish(seq, now)
        else:
            self._join(seq)

    def _join(self, seq: SimSeq) -> None:
        self.running[seq.request_id] = seq
        self._ctx_total += seq.context_tokens

    def _sample(self, seq: SimSeq) -> None:
        tok, lp = seq.tokens.at(seq.pos)
        seq.out_ids.append(tok)
        if seq.want_logprobs:
            seq.out_lps.append(lp)
        if seq.request_id in self.running:
            self._ctx_total += 1
        seq.context_tokens += 1
        seq.pos += 1

    def _finish(self, seq: SimSeq, now: float) -> None:
        seq.done = True
        seq.finish_reason = seq.end_reason
        if seq.request_id in self.running:
            del self.running[seq.request_id]
            self._ctx_total -= seq.context_tokens
        self._reserve(-seq.kv_tokens)
        seq.kv_tokens = 0
        if seq.mode == "generate":
            self.cache.insert(seq.traj_id, seq.context_tokens, now)

    def _drop(self, seq: SimSeq) -> None:
        if seq in self.queue:
            self.queue.remove(seq)
        if seq in self.active:
            self.active.remove(seq)
        if seq in self.arrivals:
            self.arrivals.remove(seq)
        self.incoming.pop(seq.request_id, None)
        if self.running.get(seq.request_id) is seq:
            del self.running[seq.request_id]
            self._ctx_total -= seq.context_tokens
        self._reserve(-seq.kv_tokens)
        seq.kv_tokens = 0
        seq.done = True
        seq.aborted = True

    def _reserve(self, tokens: int) -> None:
        self.kv_reserved += tokens
        self.cache.resize(max(self.p.kv_capacity_tokens - self.kv_reserved, 0))
