"""The performance model's fast path: `perf_model` bound to one profile, with its per-batch terms tabulated.

A simulated engine prices a decode step at both ends of every jump, a prefill chunk every step and a KV transfer
every handoff, which makes these the simulator's most frequent calls. `StepCost` writes no formula of its own:
the per-batch terms of a decode step (`perf_model.decode_fixed_s`: overhead + the weight reads of the experts a
batch touches, a power per call; `perf_model.decode_per_seq_total_s`) are tabulated once from the model's
functions, the context term is the model's `decode_kv_read_s`, and everything else is handed to the model
(`prefill_compute_s`, `prefill_step_time_s`, `mixed_step_shape`, `mixed_step_from_decode_s`,
`kv_transfer_time_s`). The terms are added in the model's order,
so the results are bit-identical to `perf_model`'s; inputs the model would reject go to the model itself, so the
errors stay the model's. `tests/test_step_cost.py` checks the equality on random inputs for every built-in profile.

Pure, like the model: no clock, no randomness, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache, partial

from mypy_extensions import mypyc_attr

from services.runtime import perf_model as pm
from services.runtime.perf_model import ModelProfile


@mypyc_attr(allow_interpreted_subclasses=True)  # deep-copied by `Simulation.fork` (see `prorsa.native`)
class StepCost:
    """Decode step, decode jump, prefill chunk, mixed step and KV transfer times of one profile (see above)."""

    __slots__ = ("profile", "_fixed", "_per_seq", "_kv_read", "kv_transfer_s")

    def __init__(self, profile: ModelProfile) -> None:
        self.profile = profile
        self._kv_read = pm.decode_kv_read_s  # looked up once: two calls per decode jump
        # `pm.kv_transfer_time_s(profile, tokens)` (a partial: no frame of its own, once per handoff).
        self.kv_transfer_s: Callable[[int], float] = partial(pm.kv_transfer_time_s, profile)
        # Index batch: pm.decode_fixed_s and pm.decode_per_seq_total_s (index 0, the empty batch, is never priced).
        self._fixed: list[float] = []
        self._per_seq: list[float] = []
        self._grow(profile.max_batch)

    def _grow(self, batch: int) -> None:
        p = self.profile
        for n in range(len(self._fixed), batch + 1):
            self._fixed.append(pm.decode_fixed_s(p, n))
            self._per_seq.append(pm.decode_per_seq_total_s(p, n))

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        """`pm.decode_step_time_s(profile, batch, context_tokens)`."""
        if batch <= 0 or context_tokens < 0:
            return pm.decode_step_time_s(self.profile, batch, context_tokens)
        if batch >= len(self._fixed):
            self._grow(batch)  # a batch above max_batch: an empty engine admits whatever comes
        kv = pm.decode_kv_read_s(self.profile, batch, context_tokens)
        return self._fixed[batch] + kv + self._per_seq[batch]

    def jump_s(self, batch: int, context_tokens: int, steps: int) -> tuple[float, float]:
        """(a, b) of a decode jump: `steps` steps of `batch` sequences from `context_tokens` in all, the context
        growing by `batch` a step; a = the first step's time, b = (last step's - a) / (steps - 1), 0 for one step.
        The simulator takes step k (from 0) as a + k·b, so k steps as k·a + b·k(k-1)/2: exact where the step time
        is linear in context, the chord where a jump crosses the local window's bend (`pm.decode_kv_read_s`).
        """
        if batch <= 0 or context_tokens < 0 or batch >= len(self._fixed):
            a = self.decode_step_s(batch, context_tokens)
            if steps <= 1:
                return a, 0.0
            return a, (self.decode_step_s(batch, context_tokens + (steps - 1) * batch) - a) / (steps - 1)
        p, fixed, per_seq, kv_read = self.profile, self._fixed[batch], self._per_seq[batch], self._kv_read
        a = fixed + kv_read(p, batch, context_tokens) + per_seq
        if steps <= 1:
            return a, 0.0
        last = context_tokens + (steps - 1) * batch
        return a, (fixed + kv_read(p, batch, last) + per_seq - a) / (steps - 1)

    def prefill_compute_s(self, new_tokens: int, cached_tokens: int) -> float:
        """`pm.prefill_compute_s(profile, new_tokens, cached_tokens)`."""
        return pm.prefill_compute_s(self.profile, new_tokens, cached_tokens)

    def prefill_step_s(self, chunks: Sequence[tuple[int, int]]) -> float:
        """`pm.prefill_step_time_s(profile, chunks)`: a prefill-role step, chunks (new tokens, cached before)."""
        return pm.prefill_step_time_s(self.profile, chunks)

    def mixed_chunks_step_s(
        self, chunks: Sequence[tuple[int, int]], batch: int, context_tokens: int
    ) -> float:
        """A chunked-prefill step carrying `chunks` (new tokens, cached before; at least one) and a decode batch:
        `mixed_step_s` of `pm.mixed_step_shape(profile, chunks)`."""
        total, cached, largest = pm.mixed_step_shape(self.profile, chunks)
        return self.mixed_step_s(total, batch, context_tokens, cached, largest)

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
        p = self.profile
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
        return pm.mixed_step_from_decode_s(
            p, decode, batch, prefill_tokens, cached_tokens, largest_rank_tokens
        )


@lru_cache(maxsize=16)
def step_cost(profile: ModelProfile) -> StepCost:
    """The `StepCost` of `profile`, shared by every engine with that profile (its tables hold ~2 floats per batch
    size: one copy per engine would cost tens of MB at hundreds of engines and crowd the CPU caches)."""
    return StepCost(profile)
