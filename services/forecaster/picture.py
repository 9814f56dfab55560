"""The live trajectories of one tracker snapshot as numpy arrays, plus the hints a caller may add.

Built once per snapshot and shared by every predictor (10,000 trajectories convert in a few milliseconds:
one C-level attribute pass per field). Negative or non-finite numbers are clipped to 0 here, once.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import repeat
from operator import attrgetter

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
    features: list  # the snapshot's TrajectoryFeatures, in array order (ids are read from here when needed)
    decode_concurrency: float  # sequences decoding (snapshot counts)
    kv_tokens: float  # context tokens of decoding sequences (snapshot totals)
    distributions: Distributions | None = None  # live object: read on the caller's thread only
    pending: tuple[PendingArrival, ...] = ()
    decode_rate_tokens_per_s: float | None = None  # caller's override of the learned per-sequence rate

    @property
    def n(self) -> int:
        return len(self.task)

    @property
    def traj_ids(self) -> list[str]:
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
