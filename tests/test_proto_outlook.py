"""The forecast's demand outlook on the wire: it round-trips, an older forecast without one still decodes, and
hostile figures (NaN, negative, absurd, out of order) are refused with an error naming the field."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

import proto
from proto import DemandForecast, Estimate, ProtoError, TaskOutlook
from proto.examples import EXAMPLES

SUBJECT = "prorsa.forecast"


def payload() -> dict[str, Any]:
    return json.loads(proto.encode(EXAMPLES[DemandForecast]))


def test_the_outlook_round_trips_and_an_older_forecast_decodes_without_one() -> None:
    fc = EXAMPLES[DemandForecast]
    assert fc.outlook and fc.outlook_horizon_s > 0  # the example carries one
    assert proto.decode_as(proto.encode(fc), DemandForecast, SUBJECT) == fc
    old = payload()
    for name in ("outlook", "outlook_horizon_s", "started_total"):
        del old[name]  # what a forecaster before the outlook sends
    back = proto.decode_as(json.dumps(old).encode(), DemandForecast, SUBJECT)
    assert (back.outlook, back.outlook_horizon_s, back.started_total) == ([], 0.0, 0)
    assert back.horizons == fc.horizons
    task = fc.outlook[0]
    assert task.live == task.queued + task.prefill + task.decode + task.tool_call == 64


def _set(p: dict[str, Any], path: str, value: Any) -> None:
    *head, last = path.split(".")
    node: Any = p
    for key in head:
        node = node[int(key)] if key.isdigit() else node[key]
    node[last] = value


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        ("outlook.0.tool_s.mean", -1.0, "outlook[0].tool_s.mean"),  # negative
        ("outlook.0.decode", -3, "outlook[0].decode"),  # a negative count
        ("outlook.0.decode", 2.5, "outlook[0].decode"),  # not a count
        ("outlook.0.turns.observed", -1, "outlook[0].turns.observed"),
        ("outlook.0.new_tokens.q10", 900.0, "outlook[0].new_tokens"),  # q10 above q50: out of order
        ("outlook.0.context_tokens.q90", 1e30, "outlook[0]"),  # more context than any model holds
        ("outlook.0.tool_s.mean", 1e9, "outlook[0]"),  # a tool call of 30 years
        ("outlook.0.finished.q90", 1e12, "outlook[0]"),  # more trajectories than a cluster holds
        ("outlook.0.task", "x" * 201, "outlook[0].task"),
        ("outlook_horizon_s", 0.0, ""),  # an outlook over no horizon
        ("outlook_horizon_s", -5.0, "outlook_horizon_s"),
        ("started_total", -1, "started_total"),
    ],
)
def test_hostile_outlook_figures_are_refused_naming_the_field(path: str, value: Any, field: str) -> None:
    p = payload()
    _set(p, path, value)
    with pytest.raises(ProtoError) as info:
        proto.decode(json.dumps(p).encode(), SUBJECT)
    assert info.value.field == field, str(info.value)
    assert SUBJECT in str(info.value)


def test_nan_and_infinity_are_refused_and_so_is_a_task_listed_twice() -> None:
    raw = proto.encode(EXAMPLES[DemandForecast]).replace(b'"mean":1.9', b'"mean":NaN')
    with pytest.raises(ProtoError):
        proto.decode(raw, SUBJECT)
    raw = proto.encode(EXAMPLES[DemandForecast]).replace(b'"q90":38000.0', b'"q90":1e400')  # overflows to inf
    with pytest.raises(ProtoError) as info:
        proto.decode(raw, SUBJECT)
    assert info.value.field == "outlook[0].context_tokens.q90"
    p = payload()
    p["outlook"].append(p["outlook"][0])
    with pytest.raises(ProtoError) as info:
        proto.decode(json.dumps(p).encode(), SUBJECT)
    assert "task twice" in str(info.value)


def test_an_invalid_outlook_cannot_be_built_in_process_either() -> None:
    """The simulator builds forecasts without a decode: the same checks run on construction."""
    with pytest.raises(ValueError, match="finite"):
        Estimate(mean=math.nan, q10=0.0, q50=0.0, q90=0.0)
    with pytest.raises(ValueError, match="order"):
        Estimate(mean=1.0, q10=2.0, q50=1.0, q90=3.0)
    with pytest.raises(ValueError, match="absurd"):
        TaskOutlook(task="t", tool_s=Estimate(mean=1e9, q10=0.0, q50=0.0, q90=1e9))
    with pytest.raises(ValueError, match="outlook_horizon_s"):
        DemandForecast(ts_s=0.0, predictor="x", horizons=[], outlook=[TaskOutlook(task="t")])
    # The mean of a heavy tail may lie beyond q90: that is no error.
    assert Estimate(mean=5.0, q10=0.1, q50=0.3, q90=4.0).mean == 5.0
