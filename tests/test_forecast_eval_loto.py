"""Leave-one-trace-out (issue 32): the left-out trace gives nothing to its prior, the prior yields to the run's own
observations as they come, and `prorsa forecast-eval --leave-one-out` prints and writes one row per trace."""

from __future__ import annotations

import json

import numpy as np
import pytest

from prorsa.cli import main
from prorsa.forecast_eval.loto import misses, prior_without, trace_samples
from services.forecaster.distributions import Distributions
from services.forecaster.lifecycle_model import PRIOR_POINTS, PriorSamples, make_inputs


def test_the_left_out_trace_gives_nothing_to_its_prior() -> None:
    math_only = prior_without("azure-code", traces=("azure-code", "profile:math"))
    alone = trace_samples("profile:math")
    for kind in ("gap_s", "output_tokens", "new_tokens"):
        assert np.array_equal(getattr(math_only, kind), getattr(alone, kind))
    # single-turn traces have outputs but no tool latencies or later turns
    azure = trace_samples("azure-code")
    assert len(azure.output_tokens) and not len(azure.gap_s) and not len(azure.new_tokens)
    with pytest.raises(ValueError, match="no trace left"):
        prior_without("swe", traces=("swe",))


def test_a_prior_stands_for_a_kind_until_its_first_own_observation() -> None:
    """The other traces' distribution of a kind, until the run observes the kind once; then the run's own alone."""
    prior = PriorSamples(
        gap_s=np.linspace(1.0, 30.0, 50), output_tokens=np.full(50, 2000.0), new_tokens=np.full(50, 900.0)
    )
    cold = make_inputs(None, 50.0, prior)
    assert len(cold.out) == PRIOR_POINTS and np.all(cold.out == 2000.0) and cold.mu_new == 900.0
    assert cold.gap_turn.min() > 1.0 and cold.gap_turn.max() < 30.0 and cold.gap_is_turn.all()
    assert np.all(make_inputs(None, 50.0).out == 256.0)  # no prior: the round stand-in
    d = Distributions()
    d.add("t", "output_tokens", 40.0)
    warm = make_inputs(d.freeze().for_task("t"), 50.0, prior)
    assert list(warm.out) == [40.0]  # the first own output replaces the prior's
    assert warm.mu_new == 900.0  # new tokens: none observed yet, still the prior's


def test_misses_name_each_target_missed() -> None:
    ok = {"prefill_wape_vs_naive": 0.5, "decode_wape_vs_naive": 0.8, "coverage80": 0.8}
    assert misses(ok) == []
    bad = {"prefill_wape_vs_naive": 0.75, "decode_wape_vs_naive": 1.2, "coverage80": 0.9}
    assert misses(bad) == ["prefill 0.75x naive", "decode 1.20x naive", "coverage80 0.900"]


def test_cli_leave_one_out_prints_and_writes_one_row_per_trace(tmp_path, capsys) -> None:
    out = tmp_path / "loto.json"
    code = main(
        [
            "forecast-eval",
            "--leave-one-out",
            *("--traces", "profile:math,azure-code", "--engines", "2", "--batch-size", "6", "--steps", "1"),
            *("--predictors", "naive,lifecycle", "--json", str(out)),
        ]
    )
    assert code == 0
    data = json.loads(out.read_text())
    assert data["horizon_s"] == 10.0 and list(data["traces"]) == ["profile:math", "azure-code"]
    printed = capsys.readouterr().out
    for trace, result in data["traces"].items():
        assert result["run"]["prior"] == "other traces"
        assert result["run"]["config"]["workload"] == trace
        assert result["run"]["bound_exceeded"]["decode_share"] == 0.0
        row = result["predictors"]["lifecycle"]
        assert f"{row['coverage80']:.3f}" in printed and trace in printed
    assert main(["forecast-eval", "--leave-one-out", "--traces", "nope", "--steps", "1"]) == 2
