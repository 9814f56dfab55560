"""The live trajectories of one tracker snapshot as numpy arrays, plus the hints a caller may add.

Built once per snapshot and shared by every predictor, from either form of a snapshot:
  - `build_picture(LifecycleSnapshot)`: the wire message, one object per trajectory (10,000 trajectories convert
    in several milliseconds: one C-level attribute pass per field);
  - `build_picture_columns(SnapshotColumns)`: the tracker's columns, in process (a few array copies).
Both give the same picture: task codes in order of first appearance among the live trajectories, states outside
the four the picture models left out.

Bad input from a peer is counted and skipped here, once (`Picture.rejected`, by reason), so no predictor sees it:
a row with a non-finite or negative number, or an absurd one (beyond `LIMITS`: more context than any model holds,
a state lasting longer than a run), and every repeat of a trajectory id after its first row. A task never seen
before needs nothing special: predictors fall back to the pooled task's distributions. Negative or non-finite
snapshot totals (decode count, KV tokens) become 0.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import attrgetter
from typing import Any, Protocol

import numpy as np

from proto import LifecycleSnapshot
from services.forecaster.distributions import Distributions

STATE_CODES: dict[str, int] = {"queued": 0, "prefill": 1, "decode": 2, "tool_call": 3}
# Largest plausible values per row (larger ones are rejected as absurd): 2^24 tokens is 16x the longest context of
# today's models; a week in one state, or 2^20 turns, is no rollout.
LIMITS: dict[str, float] = {
    "context_tokens": float(2**24),
    "generated": float(2**24),
    "time_in_state_s": 7 * 86400.0,
    "turn": float(2**20),
}
QUEUED, PREFILL, DECODE, TOOL_CALL = 0, 1, 2, 3


@dataclass(frozen=True, slots=True)
class PendingArrival:
    """A first turn the driver will submit: `prompt_tokens` at `at_s` (caller's clock).

    With `traj_id` of a queued trajectory it replaces the learned queue-wait estimate for that trajectory;
    without, it is a trajectory not started yet."""

    at_s: float
    prompt_tokens: int
    traj_id: str = ""
    task: str = ""


@dataclass(frozen=True)
class Picture:
    ts_s: float
    task_names: tuple[str, ...]  # task code -> name
    task: np.ndarray  # int32 task code per trajectory
    state: np.ndarray  # int8 STATE_CODES (queued, prefill, decode, tool_call)
    time_in_state_s: np.ndarray  # float64
    generated: np.ndarray  # float64 output tokens of the current turn
    context: np.ndarray  # float64 prompt + generated tokens
    turn: np.ndarray  # int64 current turn index (0-based)
    features: Sequence[Any]  # the snapshot's TrajectoryFeatures in array order (empty for a columnar picture)
    decode_concurrency: float  # sequences decoding (snapshot counts)
    kv_tokens: float  # context tokens of decoding sequences (snapshot totals)
    distributions: Distributions | None = None  # live object: read on the caller's thread only
    pending: tuple[PendingArrival, ...] = ()
    decode_rate_tokens_per_s: float | None = None  # caller's override of the learned per-sequence rate
    ids: Sequence[str] | None = None  # traj ids in array order (None: read them from `features` when needed)
    rejected: Mapping[str, int] | None = None  # rows skipped as bad input, by reason (module header)
    started_total: int = 0  # trajectories the tracker had seen start (its snapshot's counter)

    @property
    def n(self) -> int:
        return len(self.task)

    @property
    def traj_ids(self) -> list[str]:
        if self.ids is not None:
            return list(self.ids)
        return list(map(_get_id, self.features))


_get_id = attrgetter("traj_id")
_get_task = attrgetter("task")
_get_state = attrgetter("state")
_get_tis = attrgetter("time_in_state_s")
_get_gen = attrgetter("generated_this_turn")
_get_ctx = attrgetter("context_tokens")
_get_turn = attrgetter("turn")


def _total(x: float) -> float:
    return float(x) if math.isfinite(x) and x > 0 else 0.0


def _bad_rows(ids: Sequence[str], columns: dict[str, np.ndarray]) -> tuple[np.ndarray | None, dict[str, int]]:
    """Row indices to keep (None: all) and the rejected rows by reason (module header)."""
    n = len(ids)
    bad = np.zeros(n, dtype=bool)
    reasons: dict[str, int] = {}
    for name, a in columns.items():
        with np.errstate(invalid="ignore"):
            invalid = ~np.isfinite(a) | (a < 0)
            absurd = ~invalid & (a > LIMITS[name])
        for reason, mask in (("invalid", invalid), ("absurd", absurd)):
            k = int((mask & ~bad).sum())
            if k:
                reasons[f"{reason}_{name}"] = reasons.get(f"{reason}_{name}", 0) + k
                bad |= mask
    if len(set(ids)) < n:  # a trajectory listed twice: keep its first row
        seen: set[str] = set()
        for i, tid in enumerate(ids):
            if tid in seen and not bad[i]:
                bad[i] = True
                reasons["duplicate_traj"] = reasons.get("duplicate_traj", 0) + 1
            seen.add(tid)
    return (np.flatnonzero(~bad) if bad.any() else None), reasons


def build_picture(
    snapshot: LifecycleSnapshot,
    distributions: Distributions | None = None,
    pending: tuple[PendingArrival, ...] = (),
    decode_rate_tokens_per_s: float | None = None,
) -> Picture:
    """Arrays of the snapshot's live trajectories (terminal or unknown states, and bad rows, are left out)."""
    feats = snapshot.trajectories
    codes = list(map(STATE_CODES.get, map(_get_state, feats), repeat(-1)))
    if -1 in codes:  # a state the picture does not model (none today): leave those trajectories out
        feats = [f for f, c in zip(feats, codes, strict=True) if c >= 0]
        codes = [c for c in codes if c >= 0]
    n = len(feats)
    cols = {
        "time_in_state_s": np.fromiter(map(_get_tis, feats), dtype=np.float64, count=n),
        "generated": np.fromiter(map(_get_gen, feats), dtype=np.float64, count=n),
        "context_tokens": np.fromiter(map(_get_ctx, feats), dtype=np.float64, count=n),
        "turn": np.fromiter(map(_get_turn, feats), dtype=np.float64, count=n),
    }
    ids = list(map(_get_id, feats))
    keep, rejected = _bad_rows(ids, cols)
    if keep is not None:
        rows = keep.tolist()
        feats = [feats[i] for i in rows]
        codes = [codes[i] for i in rows]
        cols = {k: v[keep] for k, v in cols.items()}
        n = len(feats)
    states = np.array(codes, dtype=np.int8)
    tasks = list(map(_get_task, feats))
    task_names = {name: i for i, name in enumerate(dict.fromkeys(tasks))}
    task = np.fromiter(map(task_names.__getitem__, tasks), dtype=np.int32, count=n)
    return Picture(
        ts_s=snapshot.ts_s,
        task_names=tuple(task_names),
        task=task,
        state=states,
        time_in_state_s=cols["time_in_state_s"],
        generated=cols["generated"],
        context=cols["context_tokens"],
        turn=cols["turn"].astype(np.int64),
        features=feats,
        decode_concurrency=_total(snapshot.counts.get("decode", 0)),
        kv_tokens=_total(snapshot.context_tokens_by_state.get("decode", 0)),
        distributions=distributions,
        pending=tuple(pending),
        decode_rate_tokens_per_s=decode_rate_tokens_per_s,
        rejected=rejected,
        started_total=snapshot.started_total,
    )


class SnapshotColumnsLike(Protocol):
    """The columnar snapshot the forecaster reads (the tracker's `SnapshotColumns` has these fields; the
    forecaster does not import the tracker service). Arrays are (n,), row i one live trajectory."""

    ts_s: float
    state_names: tuple[str, ...]  # state code -> name
    task_names: tuple[str, ...]  # task code -> name
    traj_ids: Sequence[str]
    task: np.ndarray  # integer codes into task_names
    state: np.ndarray  # integer codes into state_names
    time_in_state_s: np.ndarray
    generated_this_turn: np.ndarray
    context_tokens: np.ndarray
    turn: np.ndarray
    counts: Mapping[str, int]
    context_tokens_by_state: Mapping[str, int]
    started_total: int


def _as_float(a: np.ndarray) -> np.ndarray:
    return np.array(a, dtype=np.float64)  # a copy: the tracker's columns change after the call


def build_picture_columns(
    cols: SnapshotColumnsLike,
    distributions: Distributions | None = None,
    pending: tuple[PendingArrival, ...] = (),
    decode_rate_tokens_per_s: float | None = None,
) -> Picture:
    """The picture of a columnar snapshot: the same arrays `build_picture` makes of its wire form."""
    lut = np.array([STATE_CODES.get(name, -1) for name in cols.state_names] or [-1], dtype=np.int8)
    states = lut[np.asarray(cols.state, dtype=np.int64)]
    keep = None if bool((states >= 0).all()) else np.flatnonzero(states >= 0)

    def rows(a: Any) -> np.ndarray:
        a = np.asarray(a)
        return a if keep is None else a[keep]

    ids = cols.traj_ids if keep is None else [cols.traj_ids[i] for i in keep.tolist()]
    values = {
        "time_in_state_s": _as_float(rows(cols.time_in_state_s)),
        "generated": _as_float(rows(cols.generated_this_turn)),
        "context_tokens": _as_float(rows(cols.context_tokens)),
        "turn": _as_float(rows(cols.turn)),
    }
    good, rejected = _bad_rows(ids, values)
    if good is not None:
        keep = good if keep is None else keep[good]
        values = {k: v[good] for k, v in values.items()}
        ids = [ids[i] for i in good.tolist()]
    states = rows(states)
    # Task codes renumbered in order of first appearance (what `build_picture` does with names): predictors
    # iterate over `task_names`, so a task with no live trajectory must not be listed.
    task_in = rows(cols.task).astype(np.int64)
    uniq, first, inverse = np.unique(task_in, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")
    rank = np.empty(len(uniq), dtype=np.int32)
    rank[order] = np.arange(len(uniq), dtype=np.int32)
    return Picture(
        ts_s=float(cols.ts_s),
        task_names=tuple(cols.task_names[c] for c in uniq[order].tolist()),
        task=rank[inverse.ravel()],
        state=states,
        time_in_state_s=values["time_in_state_s"],
        generated=values["generated"],
        context=values["context_tokens"],
        turn=values["turn"].astype(np.int64),
        features=(),
        decode_concurrency=_total(cols.counts.get("decode", 0)),
        kv_tokens=_total(cols.context_tokens_by_state.get("decode", 0)),
        distributions=distributions,
        pending=tuple(pending),
        decode_rate_tokens_per_s=decode_rate_tokens_per_s,
        ids=ids,
        rejected=rejected,
        started_total=int(cols.started_total),
    )
