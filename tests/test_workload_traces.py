"""The trace loaders on the shipped files, on small hand-written files, and on malformed rows."""

from __future__ import annotations

import csv
import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from prorsa.workload import WorkloadError, describe_trajectories
from prorsa.workload.azure_trace import load_azure_trace
from prorsa.workload.mooncake_trace import load_mooncake_trace
from prorsa.workload.swe_trace import load_swe_trace
from prorsa.workload.trace import SWE_FILE, shipped_path
from prorsa.workload.trace_file import load_trace_file

SWE_HEADER = "run,instance,model,turn,prompt_tokens,completion_tokens,tool_latency_s\n"
AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


# --- the shipped files -------------------------------------------------------------------------------------------


def test_swe_trace_sizes_and_figures() -> None:
    trace = load_swe_trace()
    stats = describe_trajectories(trace.trajectories)
    # 23 instances × up to 5 runs = 99 (run, instance) trajectories (the data README's "23" counts instances).
    assert len(trace.trajectories) == 99
    assert len({t.traj_id.split("/", 1)[1] for t in trace.trajectories}) == 23
    assert stats["turns"] == 7957
    assert 74 <= stats["turns_p50"] <= 80  # README: ≈ 77
    assert 85 <= stats["output_tokens_p50"] <= 93  # README: ≈ 89
    assert 0.2 <= stats["tool_latency_s_p50"] <= 0.3  # README: ≈ 0.3
    # The append-only delta, 112 (the README's ≈ 190 is prompt - cached_tokens, the provider's cache misses).
    assert 100 <= stats["new_prompt_tokens_p50"] <= 125
    assert 1.0 < stats["prefill_decode_ratio"] < 1.4
    assert all(t.task == "coding" and t.arrival_s == 0.0 for t in trace.trajectories)


def test_swe_turns_rebuild_every_prompt_of_the_raw_rows() -> None:
    with gzip.open(shipped_path(SWE_FILE), "rt", encoding="utf-8") as handle:
        rows = [r for r in csv.DictReader(handle) if r["run"] == "deepseek_chat_dev"]
    traj_id = "deepseek_chat_dev/marshmallow-code__marshmallow-1343"
    raw = [r for r in rows if r["instance"] == traj_id.split("/")[1]]
    traj = next(t for t in load_swe_trace().trajectories if t.traj_id == traj_id)
    assert len(traj.turns) == len(raw) == 104
    assert [traj.context_before(k) for k in range(len(raw))] == [int(r["prompt_tokens"]) for r in raw]
    assert traj.turns[1].new_prompt_tokens == 2647 - 2036 - 77
    assert traj.turns[0].tool_latency_s == pytest.approx(0.3147)
    assert traj.turns[-1].tool_latency_s == 0.0


def test_mooncake_trace_keeps_every_request_and_prefix() -> None:
    trace = load_mooncake_trace()
    assert trace.timed and sum(len(t.turns) for t in trace.trajectories) == 12031
    arrivals = np.array([t.arrival_s for t in trace.trajectories])
    assert arrivals[0] == 0.0 and np.all(np.diff(arrivals) >= 0) and arrivals[-1] <= 3537
    assert all(t.prefix_blocks and t.task == "conversation" for t in trace.trajectories)
    multi = [t for t in trace.trajectories if len(t.turns) > 1]
    assert 1500 < len(multi) < len(trace.trajectories)  # chaining found conversations, not everything
    # A later turn adds only the user's message on top of the cached history: far less than a first prompt.
    later = np.median([u.new_prompt_tokens for t in multi for u in t.turns[1:]])
    first = np.median([t.turns[0].new_prompt_tokens for t in trace.trajectories])
    assert later < first / 10


@pytest.mark.parametrize(
    ("kind", "rows", "span_s"), [("azure-code", 8819, 3436), ("azure-conv", 19366, 3502)]
)
def test_azure_traces(kind: str, rows: int, span_s: float) -> None:
    trace = load_azure_trace(kind)
    assert len(trace.trajectories) == rows
    assert all(len(t.turns) == 1 and t.task == kind for t in trace.trajectories)
    arrivals = np.array([t.arrival_s for t in trace.trajectories])
    assert arrivals[0] == 0.0 and np.all(np.diff(arrivals) >= 0)
    assert arrivals[-1] == pytest.approx(span_s, abs=1)


# --- small files: the rules -------------------------------------------------------------------------------------


def test_swe_negative_delta_is_clamped_and_counted(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "agent.csv",
        SWE_HEADER + "r,i,m,0,1000,50,0.5\nr,i,m,1,900,10,\nr,j,m,1,300,7,\nr,j,m,0,200,0,1.25\n",
    )
    trace = load_trace_file(path)
    (a, b) = trace.trajectories
    assert [(u.new_prompt_tokens, u.output_tokens, u.tool_latency_s) for u in a.turns] == [
        (1000, 50, 0.5),
        (0, 10, 0.0),
    ]
    # Rows may come out of order; a 0-token completion counts as 1.
    assert [(u.new_prompt_tokens, u.output_tokens) for u in b.turns] == [(200, 1), (100, 7)]
    assert any("1 negative" in note for note in trace.notes)
    assert any("0 completion" in note for note in trace.notes)


def _jsonl(path: Path, requests: list[dict]) -> Path:
    return _write(path, "".join(json.dumps(r) + "\n" for r in requests))


def test_mooncake_chaining_rule(tmp_path: Path) -> None:
    path = _jsonl(
        tmp_path / "conv.jsonl",
        [
            {"timestamp": 0, "input_length": 1200, "output_length": 300, "hash_ids": [0, 1, 2]},
            {"timestamp": 500, "input_length": 900, "output_length": 10, "hash_ids": [0, 7]},
            # Extends request 1's two complete blocks [0, 1]: its next turn, 200 new tokens after 1500 cached.
            {"timestamp": 4000, "input_length": 1700, "output_length": 20, "hash_ids": [0, 1, 2, 3]},
            # Continues the same first turn again: a fork, so a new conversation.
            {"timestamp": 5000, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 9]},
        ],
    )
    trace = load_trace_file(path)
    assert [len(t.turns) for t in trace.trajectories] == [2, 1, 1]
    conv = trace.trajectories[0]
    assert [(u.new_prompt_tokens, u.output_tokens, u.tool_latency_s) for u in conv.turns] == [
        (1200, 300, 4.0),
        (200, 20, 0.0),
    ]
    assert conv.prefix_blocks == (0, 1, 2) and conv.arrival_s == 0.0
    assert [t.arrival_s for t in trace.trajectories] == [0.0, 0.5, 5.0]


def test_trace_file_detects_format_and_gzip(tmp_path: Path) -> None:
    azure = tmp_path / "my_code_trace.csv.gz"
    with gzip.open(azure, "wt", encoding="utf-8") as handle:
        handle.write(AZURE_HEADER + "2023-11-16 18:17:03.9799600,4808,10\n2023-11-16 18:17:05.5,31,0\n")
    trace = load_trace_file(azure)
    assert trace.task == "azure-code" and trace.timed
    assert [t.arrival_s for t in trace.trajectories] == pytest.approx([0.0, 1.52004])
    assert trace.trajectories[1].turns[0].output_tokens == 1
    generic = _write(tmp_path / "requests.csv", AZURE_HEADER + "2023-11-16 18:17:03,10,1\n")
    assert load_trace_file(generic).task == "azure"


# --- malformed input ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "text", "where", "what"),
    [
        ("a.csv", SWE_HEADER + "r,i,m,0,100,5,0.1\nr,i,m,1,lots,5,\n", ":3:", "prompt_tokens"),
        ("b.csv", SWE_HEADER + "r,i,m,0,100,5,0.1\nr,i,m,1,200,-5,\n", ":3:", "completion_tokens"),
        ("c.csv", SWE_HEADER + "r,i,m,0,100,5,-0.1\n", ":2:", "tool_latency_s"),
        ("d.csv", SWE_HEADER + "r,i,m,0,100,5,0.1\nr,i,m,0,120,5,\n", ":3:", "duplicate turn 0"),
        ("e.csv", SWE_HEADER + "r,i,m,0,100,5,0.1\nr,i,m,2,120,5,\n", ":3:", "missing turn 1"),
        ("f.csv", SWE_HEADER + "r,i,m,0,100,5\n", ":2:", "number of fields"),
        ("g.csv", "run,instance,turn\nr,i,0\n", ":1:", "matches neither"),
        ("h.csv", AZURE_HEADER + "2023-11-16 18:17:03.1,10,1\nyesterday,10,1\n", ":3:", "TIMESTAMP"),
        (
            "i.csv",
            AZURE_HEADER + "2023-11-16 18:17:03.1,10,1\n2023-11-16 18:17:04.1,10,2.5\n",
            ":3:",
            "Generated",
        ),
        ("j.csv", SWE_HEADER, ":2:", "no rows"),
        (
            "k.jsonl",
            '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}\n{oops\n',
            ":2:",
            "JSON",
        ),
        ("l.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 1}\n', ":1:", "hash_ids"),
        (
            "m.jsonl",
            '\n\n{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": ["x"]}\n',
            ":3:",
            "hash",
        ),
        (
            "n.jsonl",
            '{"timestamp": 0.5, "input_length": 5, "output_length": 1, "hash_ids": [0]}\n',
            ":1:",
            "timestamp",
        ),
        ("o.jsonl", "[1, 2]\n", ":1:", "JSON object"),
    ],
)
def test_malformed_rows_name_file_and_line(
    tmp_path: Path, name: str, text: str, where: str, what: str
) -> None:
    path = _write(tmp_path / name, text)
    with pytest.raises(WorkloadError) as info:
        load_trace_file(path)
    message = str(info.value)
    assert str(path) in message and where in message and what in message


def test_missing_or_unknown_files(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError, match="no such trace file"):
        load_trace_file(tmp_path / "absent.csv")
    with pytest.raises(WorkloadError, match="unknown trace format"):
        load_trace_file(_write(tmp_path / "trace.parquet", "x"))
    with pytest.raises(WorkloadError, match="unknown Azure trace"):
        load_azure_trace("azure-chat")
