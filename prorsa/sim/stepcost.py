"""The decode step time of `perf_model.decode_step_time_s` with its per-batch terms precomputed.

A decode engine prices two steps every time its batch changes (the ends of a jump), which makes the model the
simulator's most frequent call. The terms that depend only on the batch (weight reads with the experts a batch
touches, per-sequence compute) are tabulated once per profile; the result is bit-identical to the model's, because
the sum is formed in the model's order: ((overhead + weights) + kv) + per_sequence × batch.
"""

from __future__ import annotations

from services.runtime import perf_model as pm
from services.runtime.perf_model import ModelProfile


class DecodeCost:
    """`step_s(batch, context)` == `pm.decode_step_time_s(profile, batch, context)`, for valid inputs."""

    __slots__ = ("_p", "_head", "_tail", "_kv_global", "_kv_local", "_window")

    def __init__(self, profile: ModelProfile) -> None:
        self._p = profile
        self._head: list[float] = [0.0]  # index batch: overhead + weights (index 0 unused: empty batch)
        self._tail: list[float] = [0.0]  # index batch: per-sequence compute
        self._kv_global = profile.kv_global_read_s_per_token
        self._kv_local = profile.kv_local_read_s_per_token
        self._window = profile.attn_local_window_tokens
        self._grow(profile.max_batch)

    def _grow(self, batch: int) -> None:
        p = self._p
        for n in range(len(self._head), batch + 1):
            weights = p.weight_dense_read_s + p.weight_experts_read_s * pm.experts_touched_fraction(p, n)
            self._head.append(p.decode_overhead_s + weights)
            self._tail.append(p.decode_per_seq_s * n)

    def step_s(self, batch: int, context_tokens: int) -> float:
        """Seconds of one decode step of `batch` sequences holding `context_tokens` in all (0.0 if batch is 0)."""
        if batch <= 0 or context_tokens < 0:
            return pm.decode_step_time_s(self._p, batch, context_tokens)  # the model's answer or its error
        if batch >= len(self._head):
            self._grow(batch)  # a batch above max_batch: an empty engine admits whatever comes
        kv = self._kv_global * context_tokens
        if self._window > 0:
            kv += self._kv_local * min(context_tokens, batch * self._window)
        return self._head[batch] + kv + self._tail[batch]
