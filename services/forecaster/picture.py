"""The live trajectories of one tracker snapshot as numpy arrays, plus the hints a caller may add.

Built once per snapshot and shared by every predictor, from either form of a snapshot:
  - `build_picture(LifecycleSnapshot)`: the wire message, one object per trajectory (10,000 trajectories convert
    in several milliseconds: one C-level attribute pass per field);
  - `build_picture_columns(SnapshotColumns)`: the tracker's columns, in process (a few array copies).
Both give the same picture: task codes in order of first appearance among the live trajectories, states outside
the four the picture models left out. Negative or non-finite numbers are clipped to 0 here, once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import attrgetter
from typing import Any, Protocol

import numpy as np

from proto import LifecycleSnapshot
from services.forecaster.distributions import Distributions

STATE_CODES: dict[str, int] = {"queued": 0, "prefill": 1, "decode": 2, "tool_call": 3}
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


def _clean(a: np.ndarray) -> np.ndarray:
    a[~np.isfinite(a)] = 0.0
    np.maximum(a, 0.0, out=a)
    return a


def build_picture(
    snapshot: LifecycleSnapshot,
    distributions: Distributions | None = None,
    pending: tuple[PendingArrival, ...] = (),
    decode_rate_tokens_per_s: float | None = None,
) -> Picture:
    """Arrays of the snapshot's live trajectories (terminal or unknown states are left out)."""
    feats = snapshot.trajectories
    codes = list(map(STATE_CODES.get, map(_get_state, feats), repeat(-1)))
    if -1 in codes:  # a state the picture does not model (none today): leave those trajectories out
        feats = [f for f, c in zip(feats, codes, strict=True) if c >= 0]
        codes = [c for c in codes if c >= 0]
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
        time_in_state_s=_clean(np.fromiter(map(_get_tis, feats), dtype=np.float64, count=n)),
        generated=_clean(np.fromiter(map(_get_gen, feats), dtype=np.float64, count=n)),
        context=_clean(np.fromiter(map(_get_ctx, feats), dtype=np.float64, count=n)),
        turn=np.maximum(np.fromiter(map(_get_turn, feats), dtype=np.int64, count=n), 0),
        features=feats,
        decode_concurrency=float(max(0, snapshot.counts.get("decode", 0))),
        kv_tokens=float(max(0, snapshot.context_tokens_by_state.get("decode", 0))),
        distributions=distributions,
        pending=tuple(pending),
        decode_rate_tokens_per_s=decode_rate_tokens_per_s,
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


def _as_float(a: np.ndarray) -> np.ndarray:
    return _clean(np.array(a, dtype=np.float64))  # always a copy: `_clean` writes in place


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

    states = rows(states)
    # Task codes renumbered in order of first appearance (what `build_picture` does with names): predictors
    # iterate over `task_names`, so a task with no live trajectory must not be listed.
    task_in = rows(cols.task).astype(np.int64)
    uniq, first, inverse = np.unique(task_in, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")
    rank = np.empty(len(uniq), dtype=np.int32)
    rank[order] = np.arange(len(uniq), dtype=np.int32)
    ids = cols.traj_ids
    return Picture(
        ts_s=float(cols.ts_s),
        task_names=tuple(cols.task_names[c] for c in uniq[order].tolist()),
        task=rank[inverse.ravel()],
        state=states,
        time_in_state_s=_as_float(rows(cols.time_in_state_s)),
        generated=_as_float(rows(cols.generated_this_turn)),
        context=_as_float(rows(cols.context_tokens)),
        turn=np.maximum(rows(cols.turn).astype(np.int64), 0),
        features=(),
        decode_concurrency=float(max(0, cols.counts.get("decode", 0))),
        kv_tokens=float(max(0, cols.context_tokens_by_state.get("decode", 0))),
        distributions=distributions,
        pending=tuple(pending),
        decode_rate_tokens_per_s=decode_rate_tokens_per_s,
        ids=ids if keep is None else [ids[i] for i in keep.tolist()],
    )
