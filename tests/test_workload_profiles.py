"""Task profiles against the trace they are fitted to, and against the shape each promises; the fitter itself."""

from __future__ import annotations

import numpy as np
import pytest

from prorsa.workload import describe, load_workload
from prorsa.workload.fit import fit_log_mixture, ks_statistic
from prorsa.workload.profiles import coding_profile, get_profile
from prorsa.workload.swe_trace import load_swe_trace


def _columns(trajectories: list) -> dict[str, np.ndarray]:
    """Per-trajectory turn counts and per-turn figures, as the coding fit splits them."""
    return {
        "turns": np.array([len(t.turns) for t in trajectories], dtype=float),
        "first prompt": np.array([t.turns[0].new_prompt_tokens for t in trajectories], dtype=float),
        "new prompt": np.array([u.new_prompt_tokens for t in trajectories for u in t.turns[1:]], dtype=float),
        "output": np.array([u.output_tokens for t in trajectories for u in t.turns], dtype=float),
        "tool latency": np.array([u.tool_latency_s for t in trajectories for u in t.turns[:-1]], dtype=float),
    }


@pytest.fixture(scope="module")
def coding_vs_trace() -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    generated = load_workload("profile:coding", batch_size=512, seed=11).step(0)
    return _columns(generated), _columns(list(load_swe_trace().trajectories))


@pytest.mark.parametrize(
    ("column", "ks_bound", "p90_rel"),
    # Per-turn columns hold thousands of values, so a KS statistic over 0.05 is a real misfit. The two
    # per-trajectory columns come from 99 trajectories, and the runs of one instance share a first prompt, so that
    # column has 23 distinct values: its sampling noise alone reaches ≈ 0.15. Its p90 is loose too: 10 % of first
    # prompts are one 3.4k-token instance, so p90 sits on that cluster's edge.
    [
        ("turns", 0.15, 0.25),
        ("first prompt", 0.2, 0.35),
        ("new prompt", 0.05, 0.1),
        ("output", 0.05, 0.1),
        ("tool latency", 0.05, 0.1),
    ],
)
def test_coding_profile_matches_the_swe_trace(
    coding_vs_trace: tuple, column: str, ks_bound: float, p90_rel: float
) -> None:
    generated, trace = (c[column] for c in coding_vs_trace)
    assert np.median(generated) == pytest.approx(np.median(trace), rel=0.25)
    assert np.percentile(generated, 90) == pytest.approx(np.percentile(trace, 90), rel=p90_rel)
    assert ks_statistic(np.log(generated), np.log(trace)) < ks_bound


def test_coding_profile_notes_show_the_fit() -> None:
    notes = load_workload("profile:coding").notes
    assert "fitted to the SWE trace" in notes[0]
    assert any("[30]" in n for n in notes)  # the 30-token empty-observation atom
    assert coding_profile() is coding_profile()  # fitted once


def test_math_is_decode_heavy_and_general_prefill_heavy() -> None:
    math = describe(load_workload("profile:math", batch_size=256))
    general = describe(load_workload("profile:general", batch_size=256))
    assert math["prefill_decode_ratio"] < 0.1
    assert (
        math["output_tokens_p50"] > max(1000, 10 * math["new_prompt_tokens_p50"]) and math["turns_p50"] <= 4
    )
    assert general["prefill_decode_ratio"] > 5
    assert general["new_prompt_tokens_p50"] > 5 * general["output_tokens_p50"] and general["turns_p50"] >= 15


def test_profiles_keep_their_invariants() -> None:
    rng = np.random.default_rng(0)
    for name in ("general", "coding", "math"):
        groups = get_profile(name).sample_groups(rng, n_prompts=20, group_size=3)
        trajectories = [t for g in groups for t in g]
        assert len(groups) == 20 and len(trajectories) == 60
        assert all(t.turns[-1].tool_latency_s == 0.0 and t.task == name for t in trajectories)
        assert all(len({t.turns[0].new_prompt_tokens for t in g}) == 1 for g in groups)


def test_fit_recovers_a_known_mixture() -> None:
    rng = np.random.default_rng(5)
    values = np.concatenate([np.exp(rng.normal(3.0, 0.3, 6000)), np.exp(rng.normal(6.0, 0.5, 4000))])
    fit = fit_log_mixture(values, 2)
    assert fit.weights == pytest.approx((0.6, 0.4), abs=0.02)
    assert fit.mus == pytest.approx((3.0, 6.0), abs=0.05)
    assert fit.sigmas == pytest.approx((0.3, 0.5), abs=0.05)
    resampled = fit.sample(rng, 10000)
    assert ks_statistic(np.log(values), np.log(resampled)) < 0.03


def test_fit_finds_an_atom() -> None:
    rng = np.random.default_rng(6)
    values = np.concatenate([np.full(300, 30.0), np.exp(rng.normal(5.0, 1.0, 700))])
    fit = fit_log_mixture(values, 1, atom=True)
    assert fit.atom == 30.0 and fit.atom_weight == pytest.approx(0.3, abs=0.005)
    assert np.mean(fit.sample(rng, 20000) == 30.0) == pytest.approx(0.3, abs=0.02)
    with pytest.raises(ValueError, match="positive"):
        fit_log_mixture([1.0, 0.0, 2.0], 1)


def test_ks_statistic() -> None:
    assert ks_statistic([1, 2, 3], [1, 2, 3]) == 0.0
    assert ks_statistic([1, 2], [5, 6]) == 1.0
    assert ks_statistic([1, 2, 3, 4], [3, 4, 5, 6]) == pytest.approx(0.5)
