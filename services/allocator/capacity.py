"""Per-engine capacity for the allocator's policies: the performance model's rates, corrected online.

Pure: arithmetic on a `ModelProfile`, plus two correction factors that follow what engines report.

Rates (all per engine, tokens per second):
* prefill: a prefill-role engine with a backlog fills each step with `prefill_batch_tokens` new tokens. A request of
  `isl` new tokens after `cached` prefix tokens costs its compute (linear + attention over the prefix) plus its share
  of the step overhead: isl / B of a step when isl < B (several requests share a step), ⌈isl / B⌉ steps when larger.
* decode: `b` sequences of `ctx` context each produce b tokens per `decode_step_time_s(b, b·ctx)`; b is capped by
  `max_batch` and by the KV cache (⌊kv_capacity / ctx⌋). A cluster with C sequences on D engines runs them at C / D
  each; with fewer sequences than engines each runs alone (batch 1) and more engines add nothing.
* mixed: a chunked-prefill step carries every rank's chunk and the decode batch (`mixed_step_time_s`, which charges
  the DP-attention stall), so a mixed engine gives prefill and decode at once, each slower than a dedicated engine.

Online correction (why: a profile is a model, the engines are the truth): each decision compares what engines report
(`EngineView.prefill_tokens_per_s` of a backlogged prefill engine, `decode_tokens_per_s` of a decoding engine) with
what the model says for the same work, and keeps an EWMA of the ratio, clamped to [1/4, 4] so one odd report cannot
swing a decision. Rates returned by the `*_tokens_per_s` methods include the correction.

A miss's price is measured the same way (`miss_share`): a turn placement sends away from the engine holding its
prefix recomputes, where another engine takes it, not the mean context but what the engines report such turns
computing (`PrefillDone.away`) — about half of it on the general agent: the turns sent away are the shorter ones
(a turn's patience grows with its context, `services.runtime.affinity`) and the taker holds part of each (its GRPO
group's shared prompt at least). Pricing each at the whole mean context made a loaded split's prefill look ~2×
dearer than the engines ran it (docs/benchmarks.md, "The allocator at high concurrency").

This module is the allocator's one import of the engine agent's pure performance model (`perf_model`,
`model_profiles`): the policies need the same model the simulator and the simulated engines use.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.runtime import perf_model as pm
from services.runtime.model_profiles import BUILTIN_PROFILES, load_profile
from services.runtime.perf_model import ModelProfile

DEFAULT_PROFILE = "qwen3-235b"
# Used when a view carries no request-level means (ClusterView.recent_* = 0): a mid-sized prompt, no prefix hit.
DEFAULT_ISL_TOKENS = 2048.0
DEFAULT_OSL_TOKENS = 512.0
DEFAULT_CONTEXT_TOKENS = 8192.0
# Weight of `CapacityModel.miss_share`'s prior (a miss recomputes the whole context), in misses: one miss's
# recompute ranges several-fold with its context (2k–100k tokens on the general agent), so until a few such turns
# have been measured the prior dominates; a few windows of a loaded split report dozens.
MISS_PRIOR_COUNT = 8.0

if TYPE_CHECKING:  # a runtime import would close a cycle: policy.py imports the policies, which import this
    from services.allocator.policy import ClusterView

__all__ = ["DEFAULT_PROFILE", "CapacityModel", "ModelProfile", "load_profile", "resolve_profile"]


def resolve_profile(profile: object | None) -> ModelProfile:
    """A ModelProfile from None (the default), a built-in name or a profile file path, or a ModelProfile.

    Raises ValueError if it is none of these (an unknown name, a bad file).
    """
    if profile is None:
        return BUILTIN_PROFILES[DEFAULT_PROFILE]
    if isinstance(profile, ModelProfile):
        return profile
    if isinstance(profile, str):
        return load_profile(profile)
    raise ValueError(f"not a model profile: {profile!r}")


def request_means(view: ClusterView) -> tuple[float, float, float]:
    """(mean new prompt tokens, mean cached prefix tokens, mean output tokens) per request, or the defaults."""
    isl = view.recent_mean_isl_tokens if view.recent_mean_isl_tokens > 0 else DEFAULT_ISL_TOKENS
    cached = max(view.recent_mean_cached_tokens, 0.0)
    osl = view.recent_mean_osl_tokens if view.recent_mean_osl_tokens > 0 else DEFAULT_OSL_TOKENS
    return isl, cached, osl


@dataclass
class CapacityModel:
    """Rates of one engine of `profile`, times the online corrections."""

    profile: ModelProfile
    ewma_alpha: float = 0.2  # weight of the newest observation
    prefill_correction: float = 1.0  # observed / modelled prefill rate (EWMA)
    decode_correction: float = 1.0  # observed / modelled decode rate (EWMA)
    # Tokens a turn sent away from its cache computes, as a share of the mean context (module doc): the prior is
    # the whole context, which the engines' reports replace as they come (`_fold_misses`).
    miss_share: float = 1.0
    _miss_sums: tuple[float, float] = (0.0, 0.0)  # decayed (Σ misses, Σ misses × share)

    # --- modelled rates ---------------------------------------------------------------------------------------
    def modelled_prefill_tokens_per_s(self, isl_tokens: float, cached_tokens: float = 0.0) -> float:
        p = self.profile
        isl = max(1, round(isl_tokens))
        cached = max(0, round(cached_tokens))
        budget = p.prefill_batch_tokens
        steps = isl / budget if isl < budget else math.ceil(isl / budget)
        seconds = pm.prefill_compute_s(p, isl, cached) + p.prefill_overhead_s * steps
        return isl / seconds

    def decode_batch_limit(self, context_per_seq_tokens: float) -> int:
        """Most sequences one engine decodes at once at this context (max_batch, then KV room)."""
        ctx = max(1.0, context_per_seq_tokens)
        return max(1, min(self.profile.max_batch, int(self.profile.kv_capacity_tokens // ctx)))

    def modelled_decode_tokens_per_s(self, batch: float, context_per_seq_tokens: float) -> float:
        """Output tokens/s of one engine decoding `batch` sequences (capped at its limit) of the given context."""
        if batch <= 0:
            return 0.0
        p = self.profile
        ctx = context_per_seq_tokens if context_per_seq_tokens > 1.0 else 1.0
        limit = (
            min(p.max_batch, int(p.kv_capacity_tokens // ctx)) or 1
        )  # inlined decode_batch_limit: hot path
        b = min(math.ceil(batch), limit)
        step = pm.decode_step_time_s(p, b, round(b * ctx))
        return min(batch, b) / step

    def modelled_decode_tokens_per_s_within(self, max_step_s: float, context_per_seq_tokens: float) -> float:
        """Best output tokens/s of one engine whose decode step stays within `max_step_s` (batch 1 if none does)."""
        p = self.profile
        ctx = max(1.0, context_per_seq_tokens)
        lo, hi = 1, self.decode_batch_limit(ctx)
        while lo < hi:  # step time grows with the batch: binary search for the largest batch within the bound
            mid = (lo + hi + 1) // 2
            if pm.decode_step_time_s(p, mid, round(mid * ctx)) <= max_step_s:
                lo = mid
            else:
                hi = mid - 1
        return lo / pm.decode_step_time_s(p, lo, round(lo * ctx))

    # --- corrected rates --------------------------------------------------------------------------------------
    def prefill_tokens_per_s(self, isl_tokens: float, cached_tokens: float = 0.0) -> float:
        """Prompt tokens/s one prefill-role engine computes with a backlog of such requests."""
        return self.modelled_prefill_tokens_per_s(isl_tokens, cached_tokens) * self.prefill_correction

    def decode_cluster_tokens_per_s(
        self, engines: int, sequences: float, context_per_seq_tokens: float
    ) -> float:
        """Output tokens/s of `engines` decode engines sharing `sequences` evenly (0 with no engine or no work)."""
        if engines <= 0 or sequences <= 0:
            return 0.0
        per_engine = sequences / engines
        if per_engine <= 1.0:  # each sequence alone on an engine: more engines add nothing
            return (
                sequences
                * self.modelled_decode_tokens_per_s(1, context_per_seq_tokens)
                * self.decode_correction
            )
        return (
            engines
            * self.modelled_decode_tokens_per_s(per_engine, context_per_seq_tokens)
            * self.decode_correction
        )

    def mixed_tokens_per_s(
        self,
        decode_batch: float,
        context_per_seq_tokens: float,
        cached_tokens: float = 0.0,
        prompt_tokens: float | None = None,
    ) -> tuple[float, float, float]:
        """One mixed engine: (prefill tok/s while chunking, decode tok/s while chunking, decode tok/s otherwise).

        `prompt_tokens` (uncached tokens per prompt; None = a backlog on every rank): with DP attention a prompt
        lives on one rank, so a step carries one prompt's chunk and every rank waits for it — the chunk then
        costs dp_ranks times its compute (perf_model.mixed_step_time_s). With no DP attention it changes nothing
        but the chunk size."""
        p = self.profile
        ctx = max(1.0, context_per_seq_tokens)
        b = min(max(0, math.ceil(decode_batch)), self.decode_batch_limit(ctx))
        if prompt_tokens is None or p.dp_ranks == 1:
            chunk = p.mixed_chunk_tokens * p.dp_ranks  # every rank carries a chunk
        else:
            chunk = max(1, min(round(prompt_tokens), p.mixed_chunk_tokens))
        step = pm.mixed_step_time_s(p, chunk, b, round(b * ctx), prefill_cached_tokens=round(cached_tokens))
        pure = self.modelled_decode_tokens_per_s(b, ctx) if b else 0.0
        return (
            chunk / step * self.prefill_correction,
            b / step * self.decode_correction,
            pure * self.decode_correction,
        )

    def drain_s(
        self,
        role: str,
        in_flight_tokens: int,
        decode_batch: int,
        kv_used_tokens: int,
        prefill_tokens_per_s: float | None = None,
    ) -> float:
        """Seconds an engine needs to finish the work it holds in `role` (corrected rates, no cap); a prefill
        engine drains at `prefill_tokens_per_s` (default: the rate at the default prompt length)."""
        if in_flight_tokens <= 0:
            return 0.0
        if role == "prefill":
            rate = prefill_tokens_per_s or self.prefill_tokens_per_s(DEFAULT_ISL_TOKENS)
            return in_flight_tokens / rate
        batch = max(1, decode_batch)
        rate = self.modelled_decode_tokens_per_s(batch, kv_used_tokens / batch if kv_used_tokens else 1.0)
        return in_flight_tokens / max(rate * self.decode_correction, 1e-9)

    # --- online correction ------------------------------------------------------------------------------------
    def observe(self, view: ClusterView) -> None:
        """Fold the engines' reported rates into the corrections (engines that report nothing are skipped)."""
        isl, cached, _ = request_means(view)
        prefill_ratios: list[float] = []
        decode_ratios: list[float] = []
        modelled_prefill = self.modelled_prefill_tokens_per_s(isl, cached)
        for e in view.engines:
            if e.switching:
                continue
            backlog = max(view.recent_window_s, 1.0) * modelled_prefill  # what it could compute in the window
            if e.role == "prefill" and e.prefill_tokens_per_s > 0 and e.queued_prefill_tokens >= backlog:
                # Only an engine that was busy the whole window measured its capacity: one with a short queue
                # at the sampling instant may have idled most of the window, and its rate would read low.
                prefill_ratios.append(e.prefill_tokens_per_s / modelled_prefill)
            if e.role == "decode" and e.decode_tokens_per_s > 0 and e.decode_batch > 0:
                ctx = e.kv_used_tokens / e.decode_batch if e.kv_used_tokens else 1.0
                modelled = self.modelled_decode_tokens_per_s(e.decode_batch, ctx)
                decode_ratios.append(e.decode_tokens_per_s / modelled)
        self.prefill_correction = self._ewma(self.prefill_correction, prefill_ratios)
        self.decode_correction = self._ewma(self.decode_correction, decode_ratios)
        self._fold_misses(view, isl + cached)

    def _fold_misses(self, view: ClusterView, mean_context: float) -> None:
        """Fold the window's misses into `miss_share`: what they computed over the mean context of the window's
        prefills, averaged over the misses reported with the weight of older windows decaying as the corrections'
        does (1 − `ewma_alpha` a decision), and a prior of the whole context worth `MISS_PRIOR_COUNT` misses."""
        n, s = (v * (1.0 - self.ewma_alpha) for v in self._miss_sums)
        misses = view.recent_away_prefills
        if misses > 0 and view.recent_requests > 0 and mean_context > 0:
            n += misses
            s += misses * min(4.0, view.recent_mean_away_new_tokens / mean_context)  # as `_ewma`, bounded
        self._miss_sums = (n, s)
        self.miss_share = (s + MISS_PRIOR_COUNT) / (n + MISS_PRIOR_COUNT)

    def _ewma(self, current: float, ratios: list[float]) -> float:
        finite = [r for r in ratios if math.isfinite(r) and r > 0]
        if not finite:
            return current
        ratio = min(4.0, max(0.25, sum(finite) / len(finite)))
        return (1 - self.ewma_alpha) * current + self.ewma_alpha * ratio
