"""Least-squares calibration fits: they recover the coefficients that generated the timings, the profile file they
write loads and predicts what was fitted, and samples that cannot determine a fit are refused."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from prorsa.calibrate.fit import DecodeSample, PrefillSample, fit_decode, fit_prefill, profile_json
from services.runtime import perf_model as pm
from services.runtime.model_profiles import BUILTIN_PROFILES, profile_from_json

TRUE = dataclasses.replace(
    BUILTIN_PROFILES["cpu-tiny"],
    prefill_overhead_s=0.03,
    prefill_tokens_per_s=12_000.0,
    attn_global_s_per_pair=2e-7,
    decode_overhead_s=0.015,
    weight_dense_read_s=0.0,
    decode_per_seq_s=0.004,
    kv_global_read_s_per_token=1.5e-6,
)
PREFILL_POINTS = [(64, 0), (256, 0), (512, 0), (1024, 0), (2048, 0), (128, 1024), (512, 1024), (256, 2048)]
DECODE_POINTS = [(b, c) for c in (128, 1536) for b in (1, 2, 4, 8)]


def prefill_samples(noise: float, seed: int = 0) -> list[PrefillSample]:
    rng = np.random.default_rng(seed)
    return [
        PrefillSample(n, c, pm.prefill_time_s(TRUE, n, c) * (1 + rng.uniform(-noise, noise)))
        for n, c in PREFILL_POINTS
    ]


def decode_samples(noise: float, seed: int = 0) -> list[DecodeSample]:
    rng = np.random.default_rng(seed)
    return [
        DecodeSample(b, b * c, pm.decode_step_time_s(TRUE, b, b * c) * (1 + rng.uniform(-noise, noise)))
        for b, c in DECODE_POINTS
    ]


def test_exact_timings_give_back_the_coefficients() -> None:
    prefill = fit_prefill(prefill_samples(0.0))
    decode = fit_decode(decode_samples(0.0))
    assert prefill.coefficients == pytest.approx(
        {"prefill_overhead_s": 0.03, "prefill_tokens_per_s": 12_000.0, "attn_global_s_per_pair": 2e-7},
        rel=1e-6,
    )
    assert decode.coefficients == pytest.approx(
        {"decode_overhead_s": 0.015, "decode_per_seq_s": 0.004, "kv_global_read_s_per_token": 1.5e-6},
        rel=1e-6,
    )
    assert prefill.rel_rmse < 1e-9 and decode.max_rel_error < 1e-9


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_noisy_timings_give_close_coefficients(seed: int) -> None:
    prefill = fit_prefill(prefill_samples(0.03, seed)).coefficients
    decode = fit_decode(decode_samples(0.03, seed)).coefficients
    assert prefill["prefill_tokens_per_s"] == pytest.approx(12_000.0, rel=0.15)
    assert prefill["attn_global_s_per_pair"] == pytest.approx(2e-7, rel=0.15)
    assert decode["decode_per_seq_s"] == pytest.approx(0.004, rel=0.15)
    assert decode["kv_global_read_s_per_token"] == pytest.approx(1.5e-6, rel=0.25)


def test_coefficients_stay_non_negative() -> None:
    # Decode steps that get *faster* with context: the least-squares slope would be negative; NNLS clamps it.
    samples = [DecodeSample(b, b * c, 0.01 + 0.002 * b - 1e-7 * b * c) for b, c in DECODE_POINTS]
    fit = fit_decode(samples)
    assert all(v >= 0 for v in fit.coefficients.values())
    assert fit.coefficients["kv_global_read_s_per_token"] == 0.0


def test_profile_file_loads_and_predicts_the_fitted_times() -> None:
    prefill, decode = fit_prefill(prefill_samples(0.0)), fit_decode(decode_samples(0.0))
    engine = {"chunk_tokens": 2048, "max_batch": 64, "kv_capacity_tokens": 131_072}
    data = profile_json("calibrated", "test", prefill, decode, engine)
    assert data["base"] == "cpu-tiny"
    p = profile_from_json(data)
    assert (p.name, p.max_batch, p.kv_capacity_tokens, p.mixed_chunk_tokens) == (
        "calibrated",
        64,
        131_072,
        2048,
    )
    assert (p.experts_total, p.experts_per_token, p.weight_dense_read_s, p.weight_experts_read_s) == (
        1,
        1,
        0,
        0,
    )
    assert p.kv_transfer_latency_s == BUILTIN_PROFILES["cpu-tiny"].kv_transfer_latency_s  # from the base
    for n, c in PREFILL_POINTS:
        assert pm.prefill_time_s(p, n, c) == pytest.approx(pm.prefill_time_s(TRUE, n, c), rel=1e-6)
    for b, c in DECODE_POINTS:
        assert pm.decode_step_time_s(p, b, b * c) == pytest.approx(
            pm.decode_step_time_s(TRUE, b, b * c), rel=1e-6
        )


def test_predicted_times_follow_the_samples() -> None:
    samples = prefill_samples(0.05)
    fit = fit_prefill(samples)
    assert len(fit.predicted_s) == len(samples)
    worst = max(abs(p / s.seconds - 1) for s, p in zip(samples, fit.predicted_s, strict=True))
    assert worst == pytest.approx(fit.max_rel_error)


@pytest.mark.parametrize(
    ("samples", "message"),
    [
        ([PrefillSample(100, 0, 0.1), PrefillSample(200, 0, 0.2)], "cannot fit"),
        ([PrefillSample(100, 0, 0.1), PrefillSample(100, 50, 0.2), PrefillSample(100, 90, 0.3)], "distinct"),
        ([PrefillSample(100, 0, 0.1), PrefillSample(200, 0, 0.0), PrefillSample(300, 0, 0.3)], "seconds > 0"),
    ],
)
def test_prefill_samples_that_cannot_determine_a_fit_are_refused(samples: list, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        fit_prefill(samples)


def test_decode_samples_that_cannot_determine_a_fit_are_refused() -> None:
    with pytest.raises(ValueError, match="cannot fit"):
        fit_decode([DecodeSample(1, 100, 0.01)])
    with pytest.raises(ValueError, match="batch > 0"):
        fit_decode([DecodeSample(1, 100, 0.01), DecodeSample(0, 0, 0.01), DecodeSample(2, 200, 0.02)])
