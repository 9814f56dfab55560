"""load_workload: spec forms, determinism, resampling, windows, groups, mixes, errors, speed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from prorsa.workload import VALID_FORMS, WorkloadError, describe, load_workload
from prorsa.workload.mooncake_trace import load_mooncake_trace

SWE_HEADER = "run,instance,model,turn,prompt_tokens,completion_tokens,tool_latency_s\n"


def _tiny_swe(tmp_path: Path) -> Path:
    path = tmp_path / "runs" / "swe.csv"  # a "/swe" inside the path must not split a mix
    path.parent.mkdir()
    rows = [f"r,i{n},m,{k},{100 * (k + 1) + n * 1000},{5 + k},0.5\n" for n in range(3) for k in range(4)]
    path.write_text(SWE_HEADER + "".join(rows), encoding="utf-8")
    return path


def _shape(batch: list) -> list:
    """Everything but the ids: what a step prescribes."""
    return [(t.task, t.turns, t.arrival_s, t.prefix_blocks) for t in batch]


@pytest.mark.parametrize(
    "spec",
    ["swe", "mooncake", "azure-code", "azure-conv", "profile:general", "profile:coding", "profile:math"],
)
def test_steps_are_deterministic_per_seed_and_index(spec: str) -> None:
    a = load_workload(spec, batch_size=16, seed=3)
    b = load_workload(spec, batch_size=16, seed=3)
    assert a.step(2) == b.step(2)  # same (spec, sizes, seed, index): identical, ids included
    assert _shape(a.step(2)) != _shape(load_workload(spec, batch_size=16, seed=4).step(2))
    assert _shape(a.step(2)) != _shape(a.step(3))
    ids = [t.traj_id for index in range(3) for t in a.step(index)]
    assert len(ids) == len(set(ids)) == 48 and ids[0] == "s0-0"
    assert len(a.step(0)) == 16 and a.notes


def test_swe_draws_without_replacement_then_resamples() -> None:
    small = load_workload("swe", batch_size=64)
    assert any("99 trajectories" in n and "without replacement" in n for n in small.notes)
    assert len({t.turns for t in small.step(0)}) == 64  # 64 distinct trajectories
    big = load_workload("swe", batch_size=256, seed=7)
    assert any("resamples them with replacement" in n and "seed 7" in n for n in big.notes)
    batch = big.step(0)
    assert len(batch) == 256 and len({t.turns for t in batch}) <= 99
    assert len({t.traj_id for t in batch}) == 256
    assert all(t.arrival_s == 0.0 for t in batch)


def test_trace_path_resamples_a_small_file(tmp_path: Path) -> None:
    workload = load_workload(f"trace:{_tiny_swe(tmp_path)}", batch_size=8)
    assert any("3 trajectories" in n and "resamples" in n for n in workload.notes)
    batch = workload.step(0)
    assert len(batch) == 8 and {t.task for t in batch} == {"coding"}
    assert len({t.turns for t in batch}) <= 3


def test_timed_trace_steps_take_consecutive_windows() -> None:
    pool = load_mooncake_trace().trajectories
    workload = load_workload("mooncake", batch_size=32)
    step0, step1 = workload.step(0), workload.step(1)
    start = next(
        i
        for i, t in enumerate(pool)
        if t.turns == step0[0].turns and t.prefix_blocks == step0[0].prefix_blocks
    )
    assert [t.turns for t in step0 + step1] == [t.turns for t in pool[start : start + 64]]
    for batch in (step0, step1):
        arrivals = np.array([t.arrival_s for t in batch])
        assert arrivals[0] == 0.0 and np.all(np.diff(arrivals) >= 0)
    assert step1[0].arrival_s == 0.0  # relative to its own window


def test_timed_trace_shorter_than_a_window_is_bootstrapped(tmp_path: Path) -> None:
    path = tmp_path / "conv_trace.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        + "".join(f"2023-11-16 18:17:0{n}.5,{100 + n},{n + 1}\n" for n in range(4)),
        encoding="utf-8",
    )
    workload = load_workload(f"trace:{path}", batch_size=10, seed=1)
    assert any("fewer than a step's 10" in n for n in workload.notes)
    arrivals = np.array([t.arrival_s for t in workload.step(0)])
    assert arrivals[0] == 0.0 and np.all(np.isin(np.diff(arrivals), [1.0]))  # gaps drawn from the trace's 1 s


@pytest.mark.parametrize("spec", ["swe", "mooncake", "profile:coding", "profile:math"])
def test_group_members_share_turn_zero(spec: str) -> None:
    batch = load_workload(spec, batch_size=16, group_size=4, seed=2).step(5)
    groups: dict[str, list] = {}
    for traj in batch:
        groups.setdefault(traj.group, []).append(traj)
    assert len(groups) == 4 and all(len(m) == 4 for m in groups.values())
    for members in groups.values():
        head = members[0]
        assert {m.turns[0].new_prompt_tokens for m in members} == {head.turns[0].new_prompt_tokens}
        assert {(m.arrival_s, m.prefix_blocks) for m in members} == {(head.arrival_s, head.prefix_blocks)}
    # Later turns are drawn independently; with 4 groups at least one group differs beyond turn 0.
    assert any(len({m.turns[1:] for m in members}) > 1 for members in groups.values())
    assert len({m[0].turns[0].new_prompt_tokens for m in groups.values()}) > 1


def test_mix_within_a_step(tmp_path: Path) -> None:
    batch = load_workload("mix:swe+profile:math", batch_size=8).step(0)
    assert [t.task for t in batch] == ["coding"] * 4 + ["math"] * 4
    weighted = load_workload("mix:swe*3+profile:math", batch_size=16, group_size=2)
    assert [t.task for t in weighted.step(1)].count("coding") == 12
    assert "12 swe + 4 profile:math" in weighted.notes[0]
    three = load_workload(f"mix:trace:{_tiny_swe(tmp_path)}+profile:general+azure-conv", batch_size=7).step(0)
    assert [t.task for t in three] == ["coding"] * 3 + ["general"] * 2 + ["azure-conv"] * 2
    assert len({t.traj_id for t in three}) == 7
    # More parts than prompts: the last part gets none this step.
    two = load_workload("mix:swe+mooncake+profile:math", batch_size=2).step(0)
    assert [t.task for t in two] == ["coding", "conversation"]


def test_mix_alternating_by_step() -> None:
    workload = load_workload("mix:profile:coding/profile:math", batch_size=4)
    assert [{t.task for t in workload.step(i)} for i in range(4)] == [{"coding"}, {"math"}] * 2
    # Each part counts its own steps: step 2 is the coding part's second step, not a repeat of step 0.
    assert _shape(workload.step(0)) != _shape(workload.step(2))
    assert workload.step(3)[0].traj_id == "s3-0"


@pytest.mark.parametrize(
    ("spec", "kwargs", "match"),
    [
        ("sweep", {}, "valid forms: swe, mooncake"),
        ("profile:poetry", {}, "profile:math"),
        ("trace:", {}, "valid forms"),
        ("mix:swe", {}, "two or more parts"),
        ("mix:swe+profile:math/mooncake", {}, "all by"),
        ("mix:swe*2/profile:math", {}, "weights"),
        ("mix:swe*0+profile:math", {}, "must be > 0"),
        ("swe", {"batch_size": 10, "group_size": 4}, "multiple of group_size"),
        ("swe", {"seed": -1}, "seed"),
    ],
)
def test_bad_specs(spec: str, kwargs: dict, match: str) -> None:
    with pytest.raises(WorkloadError, match=match):
        load_workload(spec, **kwargs)


def test_negative_step_index() -> None:
    with pytest.raises(WorkloadError, match="≥ 0"):
        load_workload("profile:math").step(-1)


def test_valid_forms_are_listed_in_the_error() -> None:
    with pytest.raises(WorkloadError) as info:
        load_workload("nope")
    assert all(form.split(" ")[0] in str(info.value) for form in VALID_FORMS)


def test_describe() -> None:
    stats = describe(load_workload("swe", batch_size=32), steps=2)
    assert stats["trajectories"] == 64
    assert stats["turns_p50"] > 40 and stats["output_tokens_p99"] > stats["output_tokens_p50"]
    assert stats["tool_latency_s_p99"] > stats["tool_latency_s_p50"] > 0
    single = describe(load_workload("azure-code", batch_size=8))
    assert single["tool_calls"] == 0 and single["tool_latency_s_p50"] == 0.0


@pytest.mark.parametrize("spec", ["swe", "mooncake", "azure-conv"])
def test_a_4096_step_has_unique_ids_and_groups(spec: str) -> None:
    # Speed is a benchmark figure, not a test bound (these machines are noisy): this checks the large step's shape.
    load_workload(spec).step(0)  # parse and memoise the trace
    batch = load_workload(spec, batch_size=4096, group_size=8).step(1)
    assert len(batch) == 4096 and len({t.traj_id for t in batch}) == 4096
    assert len({t.group for t in batch}) == 4096 // 8
