"""The performance model's hot formulas for one engine, with what depends only on the profile precomputed.

A simulated engine prices a decode step at both ends of every jump, a prefill chunk every step and a KV transfer
every handoff, which makes these the simulator's most frequent calls. `StepCost` gives the same numbers as
`services.runtime.perf_model` — bit-identical, because every sum is formed in the model's order, e.g. a decode
step as ((overhead + weights) + kv) + per_sequence × batch — with the per-batch terms of a decode step (weight
reads with the experts a batch touches, per-sequence compute) tabulated once and no per-call validation.
Inputs the model would reject are handed to the model itself, so errors stay the model's.
`tests/test_sim_stepcost.py` checks the equality on random inputs for every built-in profile.
"""

from __future__ import annotations

from functools import lru_cache

from services.runtime import perf_model as pm
from services.runtime.perf_model import ModelProfile


class StepCost:
    """Decode step, prefill chunk, mixed step and KV transfer times of one profile (see the module docstring)."""

    __slots__ = ("_p", "_head", "_tail", "_kv_global", "_kv_local", "_window", "_prefill_rate")
    __slots__ += ("_attn_global", "_attn_local", "_latency_s", "_bytes_global", "_bytes_local", "_bandwidth")

    def __init__(self, profile: ModelProfile) -> None:
        p = self._p = profile
        self._head: list[float] = [0.0]  # index batch: overhead + weights (index 0 unused: empty batch)
        self._tail: list[float] = [0.0]  # index batch: per-sequence compute
        self._kv_global = p.kv_global_read_s_per_token
        self._kv_local = p.kv_local_read_s_per_token
        self._window = p.attn_local_window_tokens
        self._prefill_rate = p.prefill_tokens_per_s
        self._attn_global = p.attn_global_s_per_pair
        # Local attention counts only with a window and a cost (as in `pm.prefill_compute_s`).
        self._attn_local = p.attn_local_s_per_pair if p.attn_local_window_tokens > 0 else 0.0
        self._latency_s = p.kv_transfer_latency_s
        self._bytes_global = p.kv_transfer_bytes_per_token
        self._bytes_local = p.kv_transfer_local_bytes_per_token
        self._bandwidth = p.kv_transfer_bytes_per_s
        self._grow(p.max_batch)

    def _grow(self, batch: int) -> None:
        p = self._p
        for n in range(len(self._head), batch + 1):
            weights = p.weight_dense_read_s + p.weight_experts_read_s * pm.experts_touched_fraction(p, n)
            self._head.append(p.decode_overhead_s + weights)
            self._tail.append(p.decode_per_seq_s * n)

    def decode_terms(self) -> tuple[list[float], list[float], float, float, int]:
        """What `jump_s` prices with, for a caller that inlines it: the per-batch tables (head: overhead + weights,
        tail: per-sequence compute; the lists themselves, which grow in place), KV read cost per global and per
        local-window token, and the local window (0: none)."""
        return self._head, self._tail, self._kv_global, self._kv_local, self._window

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        """`pm.decode_step_time_s(profile, batch, context_tokens)`."""
        if batch <= 0 or context_tokens < 0:
            return pm.decode_step_time_s(self._p, batch, context_tokens)
        if batch >= len(self._head):
            self._grow(batch)  # a batch above max_batch: an empty engine admits whatever comes
        kv = self._kv_global * context_tokens
        if self._window > 0:
            kv += self._kv_local * min(context_tokens, batch * self._window)
        return self._head[batch] + kv + self._tail[batch]

    def jump_s(self, batch: int, context_tokens: int, steps: int) -> tuple[float, float]:
        """(a, b) of a decode jump: `steps` steps of `batch` sequences from `context_tokens` in all, the context
        growing by `batch` a step; a = the first step's time, b = (last step's - a) / (steps - 1), 0 for one step.

        Both ends are `decode_step_s` (inlined: a jump is planned at every change of a decode batch).
        """
        if batch <= 0 or context_tokens < 0 or batch >= len(self._head):
            a = self.decode_step_s(batch, context_tokens)
            if steps <= 1:
                return a, 0.0
            return a, (self.decode_step_s(batch, context_tokens + (steps - 1) * batch) - a) / (steps - 1)
        head, tail, window = self._head[batch], self._tail[batch], self._window
        kv = self._kv_global * context_tokens
        if window > 0:
            kv += self._kv_local * min(context_tokens, batch * window)
        a = head + kv + tail
        if steps <= 1:
            return a, 0.0
        last = context_tokens + (steps - 1) * batch
        kv = self._kv_global * last
        if window > 0:
            kv += self._kv_local * min(last, batch * window)
        return a, (head + kv + tail - a) / (steps - 1)

    def prefill_compute_s(self, new_tokens: int, cached_tokens: int) -> float:
        """`pm.prefill_compute_s(profile, new_tokens, cached_tokens)`."""
        if new_tokens <= 0:
            return 0.0
        linear = new_tokens / self._prefill_rate
        attn = self._attn_global * (new_tokens * cached_tokens + new_tokens * (new_tokens - 1) / 2.0)
        if self._attn_local > 0:
            attn += self._attn_local * pm.attention_pairs(new_tokens, cached_tokens, self._window)
        return linear + attn

    def mixed_step_s(
        self,
        prefill_tokens: int,
        batch: int,
        context_tokens: int,
        cached_tokens: int,
        largest_rank_tokens: int,
    ) -> float:
        """`pm.mixed_step_time_s(profile, prefill_tokens, batch, context_tokens, prefill_cached_tokens=cached_tokens,
        largest_rank_prefill_tokens=largest_rank_tokens)`."""
        p = self._p
        if prefill_tokens < 0 or cached_tokens < 0 or batch < 0:
            return pm.mixed_step_time_s(
                p,
                prefill_tokens,
                batch,
                context_tokens,
                prefill_cached_tokens=cached_tokens,
                largest_rank_prefill_tokens=largest_rank_tokens,
            )
        decode = self.decode_step_s(batch, context_tokens) if batch > 0 else 0.0
        if prefill_tokens == 0:
            return decode
        base = decode if batch > 0 else p.prefill_overhead_s
        if p.dp_ranks == 1:
            return base + self.prefill_compute_s(prefill_tokens, cached_tokens)
        rank_tokens = min(max(largest_rank_tokens, 0), prefill_tokens)
        return base + p.dp_ranks * self.prefill_compute_s(rank_tokens, cached_tokens)

    def kv_transfer_s(self, tokens: int) -> float:
        """`pm.kv_transfer_time_s(profile, tokens)`."""
        if tokens <= 0:
            return pm.kv_transfer_time_s(self._p, tokens)
        local = (tokens if tokens < self._window else self._window) * self._bytes_local
        return self._latency_s + (tokens * self._bytes_global + local) / self._bandwidth


@lru_cache(maxsize=16)
def step_cost(profile: ModelProfile) -> StepCost:
    """The `StepCost` of `profile`, shared by every engine with that profile (its tables hold ~2 floats per batch
    size: one copy per engine would cost tens of MB at hundreds of engines and crowd the CPU caches)."""
    return StepCost(profile)
