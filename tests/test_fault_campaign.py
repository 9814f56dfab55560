"""Issue 14: the fault campaign's short version — one try of each fault on a small live system (real nats-server,
services and simulated engines, supervised). Nothing lost, no wrong result, recovery within 5 s of an engine kill
or of the server being back, no service crashed or stuck, every hostile message counted."""

from __future__ import annotations

import asyncio

import pytest

from prorsa.bench.fault_load import LoadShape
from prorsa.bench.faults import Campaign, CampaignConfig, format_table, scenario_names

pytestmark = pytest.mark.timeout(300)

SHORT = (
    "engine-sigkill",
    "engine-sigterm",
    "trajectory_tracker-sigkill",
    "allocator-sigkill",
    "forecaster-sigkill",
    "nats-sigkill",
    "hostile-flood",
)


def test_short_campaign(tmp_path) -> None:  # noqa: ANN001
    config = CampaignConfig(
        engines=2,
        speedup=10.0,
        load=LoadShape(concurrency=6, turns=2, output_tokens=100),
        tries={name: int(name in SHORT) for name in scenario_names()},
        hostile_messages=150,
        settle_s=0.5,
        log_dir=str(tmp_path),
    )
    report = asyncio.run(Campaign(config, say=print).run())
    print(format_table(report))
    rows = {r["fault"]: r for r in report["rows"]}
    assert sorted(rows) == sorted(SHORT)
    totals = report["totals"]
    assert totals["trajectories_lost"] == 0 and totals["turns_lost"] == 0, totals
    assert totals["wrong_results"] == 0, totals
    for name, row in rows.items():
        assert row["crashed"] == 0 and row["stuck"] == 0, row
        if name.startswith(("engine-", "nats-")) and row["recovery_max_s"] is not None:
            # Recovered, and far inside the old 120 s retry: the ≤ 5 s target itself is a benchmark figure
            # (docs/benchmarks.md, "Fault campaign"), not a timed test on a shared machine.
            assert row["recovery_max_s"] <= 30.0, row
    flood = rows["hostile-flood"]
    # Every message is accounted for: taken, refused (a full queue), or unconfirmed (no ack in time on a loaded
    # machine; the server may have stored it). A refusal is rare, not the rule.
    assert flood["hostile_sent"] + flood["hostile_refused"] + flood["hostile_unconfirmed"] == 150, flood
    assert flood["hostile_sent"] >= 135, flood
    # Each taken message is counted once by each service that receives it; an unconfirmed one at most once each.
    expected, slack = flood["hostile_expected"], flood["hostile_slack"]
    assert expected > 135 and expected <= flood["hostile_counted"] <= expected + slack, flood
