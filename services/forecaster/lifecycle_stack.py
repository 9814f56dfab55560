"""Every trajectory's contribution summed in one vectorised pass over all (task, state) tables.

The tables of `lifecycle_tables` differ in grid length per (task, state); here they are padded to one length
(the last grid point and row repeated, so interpolation beyond the data stays clamped) and stacked, so 10,000
trajectories of any mix of tasks and states cost one searchsorted, a dozen bincounts and one einsum.

Per trajectory i (table t, progress x, next-turn probability p, context c) the coefficients are linear between
grid points and equal base + p * cont; its moments are E[Q] = e0 + e1 c and E[Q^2] = f0 + f1 c + f2 c^2. The sums
of E[Q] and E[Q^2] over trajectories are linear in the coefficients, so they are accumulated per grid row
(bincount of the interpolation weights times 1, c, c^2, p, p c, p c^2) and contracted once; only sum(E[Q]^2),
needed for the variance, takes each trajectory's mean.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from services.forecaster.distributions import POOLED
from services.forecaster.lifecycle_tables import KindTable, TaskTable
from services.forecaster.picture import TOOL_CALL

STATES = 4  # picture state codes 0..3
_OFFSET = 1e12  # separates the tables' grids on one axis (progress values are clipped below it)


@dataclass(frozen=True)
class Stack:
    slots: dict[str, int]  # task -> slot; tasks without their own tables use the pooled slot
    grid: np.ndarray  # (T * G,) each table's padded grid
    grid_key: np.ndarray  # (T * G,) grid + table index * _OFFSET: one sorted axis for all tables
    base: np.ndarray  # (T * G, 3 * 5 * H)
    cont: np.ndarray  # (T * G, 3 * 5 * H)
    q: np.ndarray  # (T * G, 4, 3 * H): e0, e1 of base and cont, for features (1, p, c, p c)
    surv_turn: np.ndarray  # (T * G,) tool_call only (1 elsewhere)
    surv_finish: np.ndarray  # (T * G,)
    hazard: np.ndarray  # (slots, K) padded with each task's last value
    g: int  # padded grid length
    horizons: int

    def slot(self, task: str) -> int:
        return self.slots.get(task, self.slots[POOLED])


def _pad(kind: KindTable, g: int) -> tuple[np.ndarray, ...]:
    n = len(kind.grid)
    extra = g - n
    grid = np.concatenate([kind.grid, kind.grid[-1] + np.arange(1, extra + 1)])
    rep = np.concatenate([np.arange(n), np.full(extra, n - 1)])
    ones = np.ones(n)
    st = kind.surv_turn if kind.surv_turn is not None else ones
    sf = kind.surv_finish if kind.surv_finish is not None else ones
    return grid, kind.base[rep], kind.cont[rep], st[rep], sf[rep]


def build_stack(tables: dict[str, TaskTable]) -> Stack:
    """Stack all tables (their kinds in state-code order) for `stacked_moments`."""
    names = sorted(tables)
    g = max(2, *(len(k.grid) for t in tables.values() for k in t.kinds.values()))
    parts = [_pad(tables[name].kinds[s], g) for name in names for s in range(STATES)]
    grid, base, cont, st, sf = (np.concatenate(x) for x in zip(*parts, strict=True))
    n_rows = len(grid)
    key = grid + np.repeat(np.arange(n_rows // g), g) * _OFFSET
    q = np.stack([base[:, :, 0], cont[:, :, 0], base[:, :, 1], cont[:, :, 1]], axis=1).reshape(n_rows, 4, -1)
    k_max = max(len(tables[n].hazard) for n in names)
    hazard = np.stack(
        [np.pad(tables[n].hazard, (0, k_max - len(tables[n].hazard)), mode="edge") for n in names]
    )
    horizons = base.shape[-1]
    return Stack(
        slots={n: i for i, n in enumerate(names)},
        grid=grid,
        grid_key=key,
        base=base.reshape(n_rows, -1),
        cont=cont.reshape(n_rows, -1),
        q=q,
        surv_turn=st,
        surv_finish=sf,
        hazard=hazard,
        g=g,
        horizons=horizons,
    )


def _interp_rows(
    stack: Stack, pos: np.ndarray, wlo: np.ndarray, whi: np.ndarray, scratch: dict[str, np.ndarray] | None
) -> np.ndarray:
    """The mean's coefficient rows at each trajectory's progress, (n, 4, 3H).

    Written into reusable buffers: a fresh multi-megabyte temporary per term costs several times the arithmetic
    (the allocator hands large blocks back to the OS and faults them in again)."""
    n = len(pos)
    flat = stack.q.reshape(len(stack.grid), -1)
    scratch = {} if scratch is None else scratch
    if scratch.get("a") is None or scratch["a"].shape[0] < n or scratch["a"].shape[1] != flat.shape[1]:
        scratch["a"] = np.empty((max(n, 1024), flat.shape[1]))
        scratch["b"] = np.empty_like(scratch["a"])
    a, b = scratch["a"][:n], scratch["b"][:n]
    np.take(flat, pos, axis=0, out=a)
    a *= wlo[:, None]
    np.take(flat, pos + 1, axis=0, out=b)
    b *= whi[:, None]
    a += b
    return a.reshape(n, 4, flat.shape[1] // 4)


def stacked_moments(
    stack: Stack,
    slot: np.ndarray,
    state: np.ndarray,
    x: np.ndarray,
    turn: np.ndarray,
    ctx: np.ndarray,
    scratch: dict[str, np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Summed mean and variance, each (3 quantities, H), of the trajectories given as parallel arrays.

    `scratch`: a dict the caller keeps between calls, holding reusable buffers (optional)."""
    n, g = len(x), stack.g
    table = slot.astype(np.int64) * STATES + state
    first = table * g
    x = np.clip(x, 0.0, _OFFSET / 10)
    pos = np.searchsorted(stack.grid_key, x + table * _OFFSET, side="right") - 1
    pos = np.clip(pos, first, first + g - 2)
    # The offset keys carry ~1e-4 of rounding: a progress that close to a grid point may land one bracket off.
    pos -= (x < stack.grid[pos]) & (pos > first)
    pos += (x >= stack.grid[pos + 1]) & (pos < first + g - 2)
    lo, hi = stack.grid[pos], stack.grid[pos + 1]
    whi = np.clip((x - lo) / np.where(hi > lo, hi - lo, 1.0), 0.0, 1.0)
    wlo = 1.0 - whi
    p = 1.0 - stack.hazard[slot, np.minimum(turn, stack.hazard.shape[1] - 1)]
    tool = state == TOOL_CALL
    if tool.any():  # Bayes on the time already spent: a gap that ends a trajectory is usually short
        st = wlo * stack.surv_turn[pos] + whi * stack.surv_turn[pos + 1]
        sf = wlo * stack.surv_finish[pos] + whi * stack.surv_finish[pos + 1]
        den = p * st + (1.0 - p) * sf
        p = np.where(tool & (den > 0.0), p * st / np.where(den > 0.0, den, 1.0), p)
    rows = len(stack.grid)
    cc = ctx * ctx
    s = np.stack(
        [
            np.bincount(pos, wlo * f, rows) + np.bincount(pos + 1, whi * f, rows)
            for f in (np.ones(n), ctx, cc, p, p * ctx, p * cc)
        ]
    )  # (6, rows)
    shape = (rows, 3, 5, stack.horizons)
    b, k = stack.base.reshape(shape), stack.cont.reshape(shape)
    mean = s[0] @ b[:, :, 0].reshape(rows, -1) + s[1] @ b[:, :, 1].reshape(rows, -1)
    mean += s[3] @ k[:, :, 0].reshape(rows, -1) + s[4] @ k[:, :, 1].reshape(rows, -1)
    second = sum(s[i] @ b[:, :, 2 + i].reshape(rows, -1) for i in range(3))
    second += sum(s[3 + i] @ k[:, :, 2 + i].reshape(rows, -1) for i in range(3))
    v = np.stack([np.ones(n), p, ctx, p * ctx], axis=1)  # (n, 4)
    qi = _interp_rows(stack, pos, wlo, whi, scratch)  # (n, 4, 3H)
    m = np.einsum("na,nak->nk", v, qi)
    out = (3, stack.horizons)
    return mean.reshape(out), np.maximum(second - (m * m).sum(axis=0), 0.0).reshape(out)
