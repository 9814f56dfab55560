"""Least-squares fits of the performance model's coefficients to timings measured on a real engine (pure).

The model (`services.runtime.perf_model`) is linear in its coefficients, so each fit is a non-negative least
squares on the model's own features:

* prefill of `new` tokens after `cached` ones:
      t = prefill_overhead_s + new / prefill_tokens_per_s + attn_global_s_per_pair × pairs(new, cached)
  features [1, new, pairs]; `prefill_tokens_per_s` is the inverse of the `new` coefficient.
* a decode step of `batch` sequences holding `T` context tokens in all:
      t = decode_overhead_s + decode_per_seq_s × batch + kv_global_read_s_per_token × T
  features [1, batch, T]. A fitted (dense-like) profile has no separate weight-streaming or expert term: the
  intercept is all of it, so `weight_dense_read_s = weight_experts_read_s = 0` and `experts_total =
  experts_per_token = 1`.

Residuals are relative: each row is divided by its measured time, so a 20 ms point counts as much as a 2 s one
(short prefills and small decode steps are what an RL rollout runs most, and plain least squares would let the
longest points decide everything). Coefficients are kept non-negative, as `ModelProfile` requires.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.optimize import nnls

from services.runtime.model_profiles import PROFILE_SCHEMA, PROFILE_SCHEMA_VERSION
from services.runtime.perf_model import attention_pairs

# Below this a fitted rate coefficient counts as zero: an engine faster than 1e9 tokens/s is not a measurement.
_MIN_S_PER_TOKEN = 1e-9


@dataclass(frozen=True, slots=True)
class PrefillSample:
    new_tokens: int  # prompt tokens computed
    cached_tokens: int  # prompt tokens served from the prefix cache
    seconds: float  # submit -> first token of a request generating one token


@dataclass(frozen=True, slots=True)
class DecodeSample:
    batch: int  # sequences in each decode step
    total_context_tokens: float  # KV tokens held by the batch (mean over the measured steps)
    step_s: float  # seconds per decode step


@dataclass(frozen=True, slots=True)
class Fit:
    """Fitted coefficients by profile field name, and how well they explain the samples."""

    coefficients: dict[str, float]
    rel_rmse: float  # root mean square of (model - measured) / measured
    max_rel_error: float  # worst |model - measured| / measured
    samples: int
    predicted_s: tuple[float, ...] = ()  # the model's time for each sample, in the order given


def _solve(features: np.ndarray, seconds: np.ndarray) -> tuple[np.ndarray, float, float, tuple[float, ...]]:
    """Non-negative least squares on relative residuals; returns (coefficients, rel RMSE, max rel error,
    predicted seconds)."""
    weights = 1.0 / seconds
    scale = np.maximum(
        np.abs(features).max(axis=0), 1e-300
    )  # columns of very different sizes: condition them
    coef_scaled, _ = nnls((features / scale) * weights[:, None], seconds * weights)
    coef = coef_scaled / scale
    predicted = features @ coef
    rel = predicted / seconds - 1.0
    return (
        coef,
        float(np.sqrt(np.mean(rel**2))),
        float(np.max(np.abs(rel))),
        tuple(float(p) for p in predicted),
    )


def _check(samples: list[Any], columns: int, what: str) -> None:
    if len(samples) < columns:
        raise ValueError(f"{what}: {len(samples)} samples cannot fit {columns} coefficients")


def fit_prefill(samples: list[PrefillSample]) -> Fit:
    """Fit prefill_overhead_s, prefill_tokens_per_s and attn_global_s_per_pair. Raises ValueError when the samples
    cannot determine them (too few, non-positive times, or no two distinct prompt lengths)."""
    _check(samples, 3, "prefill")
    if any(s.seconds <= 0 or s.new_tokens <= 0 for s in samples):
        raise ValueError("prefill: every sample needs new_tokens > 0 and seconds > 0")
    if len({s.new_tokens for s in samples}) < 2:
        raise ValueError("prefill: need at least two distinct new-token counts")
    x = np.array(
        [[1.0, s.new_tokens, attention_pairs(s.new_tokens, s.cached_tokens)] for s in samples], dtype=float
    )
    y = np.array([s.seconds for s in samples], dtype=float)
    coef, rmse, worst, predicted = _solve(x, y)
    per_token_s = max(float(coef[1]), _MIN_S_PER_TOKEN)
    return Fit(
        coefficients={
            "prefill_overhead_s": float(coef[0]),
            "prefill_tokens_per_s": 1.0 / per_token_s,
            "attn_global_s_per_pair": float(coef[2]),
        },
        rel_rmse=rmse,
        max_rel_error=worst,
        samples=len(samples),
        predicted_s=predicted,
    )


def fit_decode(samples: list[DecodeSample]) -> Fit:
    """Fit decode_overhead_s, decode_per_seq_s and kv_global_read_s_per_token. Raises ValueError when the samples
    cannot determine them (too few, non-positive times or batches)."""
    _check(samples, 3, "decode")
    if any(s.step_s <= 0 or s.batch <= 0 for s in samples):
        raise ValueError("decode: every sample needs batch > 0 and step_s > 0")
    x = np.array([[1.0, s.batch, s.total_context_tokens] for s in samples], dtype=float)
    y = np.array([s.step_s for s in samples], dtype=float)
    coef, rmse, worst, predicted = _solve(x, y)
    return Fit(
        coefficients={
            "decode_overhead_s": float(coef[0]),
            "decode_per_seq_s": float(coef[1]),
            "kv_global_read_s_per_token": float(coef[2]),
        },
        rel_rmse=rmse,
        max_rel_error=worst,
        samples=len(samples),
        predicted_s=predicted,
    )


def profile_json(
    name: str,
    description: str,
    prefill: Fit,
    decode: Fit,
    engine: dict[str, int],
    base: str = "cpu-tiny",
) -> dict[str, Any]:
    """The profile file (`model_profiles` schema) of the fitted coefficients on top of the built-in `base`.

    `engine` holds what the engine reports rather than what is fitted: kv_capacity_tokens, max_batch and
    chunk_tokens (vLLM's max_num_batched_tokens, the prefill budget of one step in every role)."""
    chunk = int(engine["chunk_tokens"])
    return {
        "schema": PROFILE_SCHEMA,
        "schema_version": PROFILE_SCHEMA_VERSION,
        "base": base,
        "name": name,
        "description": description,
        "dp_ranks": 1,
        "max_batch": int(engine["max_batch"]),
        "kv_capacity_tokens": int(engine["kv_capacity_tokens"]),
        "prefill_batch_tokens": chunk,
        "mixed_chunk_tokens": chunk,
        **prefill.coefficients,
        "attn_local_s_per_pair": 0.0,
        "attn_local_window_tokens": 0,
        **decode.coefficients,
        # The intercept of the decode fit is the whole fixed cost of a step (see the module docstring).
        "weight_dense_read_s": 0.0,
        "weight_experts_read_s": 0.0,
        "experts_total": 1,
        "experts_per_token": 1,
        "kv_local_read_s_per_token": 0.0,
    }
