"""Bands with a bound (issue 32): over adversarial series — steps, silences, bursts, NaN gaps — every quantile every
predictor issues stays in the physically possible range (services/forecaster/bounds.py), and calibration widens a
band by its stated, bounded rule (services/forecaster/calibration.py)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proto import (
    LifecycleSnapshot,
    ProgressItem,
    RequestFinished,
    TokenProgress,
    TrajectoryFeatures,
    TrajectoryStarted,
    TurnSubmitted,
)
from services.forecaster.bounds import MARGIN, PRIOR_RATE_MAX, RATE_MARGIN, Limits, demand_bound
from services.forecaster.calibration import K_MAX, Calibrator
from services.forecaster.core import ForecasterCore
from services.forecaster.series import METRICS, SeriesPoint

H = (5.0, 10.0, 30.0)
KINDS = ("step", "silence", "burst", "nan")
segments = st.lists(
    st.tuples(st.sampled_from(KINDS), st.integers(1, 15), st.floats(0.0, 2e5)), min_size=2, max_size=7
)


class _Run:
    """A small agentic run whose demand follows the segments, told to a ForecasterCore through real proto events
    and snapshots (what the tracker and engines publish), with NaN gaps fed as the bad windows they are."""

    def __init__(self, core: ForecasterCore, n: int) -> None:
        self.core, self.n = core, n
        self.turn = [0] * n
        self.context = [0] * n
        self.decoding = [False] * n
        self.output = [0] * n
        self.started = 0
        self.fastest = 0.0  # the fastest per-sequence decode rate told to the core (tokens/s)
        self.t = 0.0

    def _rid(self, i: int) -> str:
        return f"r{i}-{self.turn[i]}"

    def start(self, prompt: int) -> None:
        for i in range(self.n):
            self.core.observe_event(TrajectoryStarted(traj_id=f"t{i}", ts_s=self.t, task="agent"), self.t)
            self.started += 1
            self._submit(i, prompt, first=True)

    def _submit(self, i: int, new: int, first: bool = False) -> None:
        if not first:
            self.turn[i] += 1
        self.context[i] += new
        ev = TurnSubmitted(
            traj_id=f"t{i}",
            ts_s=self.t,
            turn=self.turn[i],
            request_id=self._rid(i),
            prompt_tokens=self.context[i],
            new_tokens=new,
        )
        self.core.observe_event(ev, self.t)
        self.decoding[i], self.output[i] = True, 0

    def _finish(self, i: int) -> None:
        out = max(self.output[i], 2)
        self.fastest = max(self.fastest, float(out - 1))  # decode took 1 s: rate = (out - 1) / 1 s
        ev = RequestFinished(
            engine_id="e",
            ts_s=self.t,
            request_id=self._rid(i),
            traj_id=f"t{i}",
            turn=self.turn[i],
            prompt_tokens=self.context[i],
            cached_tokens=0,
            output_tokens=out,
            ttft_s=0.5,
            e2e_s=1.5,
        )
        self.core.observe_event(ev, self.t)
        self.context[i] += out
        self.decoding[i] = False

    def window(self, kind: str, level: float, first_of_segment: bool) -> None:
        self.t += 1.0
        if kind == "nan":  # a bad window of the series and a snapshot of garbage: both must be shrugged off
            bad = SeriesPoint(self.t, 1.0, math.nan, -1.0, math.inf, math.nan)
            self.core.predictor.observe(bad, self.t)
            self.t += 3.0  # and a gap in time
        elif kind == "step" or (kind == "burst" and first_of_segment):
            per = int(level / self.n) * (20 if kind == "burst" else 1)
            for i in range(self.n):
                if self.decoding[i]:
                    self._finish(i)
                self._submit(i, max(per, 1))
            items = [
                ProgressItem(request_id=self._rid(i), traj_id=f"t{i}", turn=self.turn[i], output_tokens=k)
                for i, k in ((i, 1 + int(level / 10 / self.n)) for i in range(self.n))
            ]
            for i, it in enumerate(items):
                self.output[i] = it.output_tokens
            self.core.observe_event(TokenProgress(engine_id="e", ts_s=self.t, items=items), self.t)
        feats = [
            TrajectoryFeatures(
                traj_id=f"t{i}",
                task="agent",
                state="decode" if self.decoding[i] else "tool_call",
                time_in_state_s=0.5,
                turn=self.turn[i],
                context_tokens=self.context[i],
                generated_this_turn=self.output[i] if self.decoding[i] else 0,
            )
            for i in range(self.n)
        ]
        bad_totals = kind == "nan"
        decode: Any = math.nan if bad_totals else sum(self.decoding)
        kv: Any = -1.0 if bad_totals else 0
        snap = LifecycleSnapshot(
            ts_s=self.t,
            seq=int(self.t),
            counts={"decode": decode},
            counts_by_task={},
            context_tokens_by_state={"decode": kv},
            trajectories=feats,
        )
        self.core.observe_snapshot(snap, self.t)
        if self.core.refit_due(self.t):
            self.core.refit(self.t)


def _check(run: _Run) -> int:
    """Assert every quantile of the forecast issued now is in range; return the horizons it checked."""
    core, t = run.core, run.t
    fc = core.forecast(t)
    bound = core.predictor.bound(t, H)
    assert bound is not None
    rate = RATE_MARGIN * run.fastest if run.fastest > 0 else PRIOR_RATE_MAX
    for j, hf in enumerate(fc.horizons):
        h = hf.horizon_s
        for m in METRICS:
            q = getattr(hf, m)
            assert all(math.isfinite(v) for v in (q.q10, q.q50, q.q90)), (m, h, q)
            assert 0.0 <= q.q10 <= q.q50 <= q.q90 <= bound[m][j] * (1 + 1e-12), (m, h, q, bound[m][j])
        # Independently of bounds.py's sums: no more sequences decode than the run's trajectories plus as many
        # arriving again (the most arrivals it has shown within h), none faster than the fastest rate it showed
        # (with the margin).
        assert hf.decode_concurrency.q90 <= 2 * run.started
        assert hf.decode_tokens.q90 <= 2 * run.started * rate * h * (1 + 1e-9)
    return len(fc.horizons)


@pytest.mark.parametrize("predictor", ["naive", "ewma", "lifecycle", "ensemble"])
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(segs=segments, n=st.integers(1, 8), prompt=st.integers(1, 50_000))
def test_every_quantile_stays_in_the_physical_range(
    predictor: str, segs: list[tuple[str, int, float]], n: int, prompt: int
) -> None:
    options = {"members": ("naive", "ewma", "lifecycle")} if predictor == "ensemble" else None
    core = ForecasterCore(predictor, horizons_s=H, predictor_options=options, refit_interval_s=10.0)
    run = _Run(core, n)
    run.start(prompt)
    for kind, length, level in segs:
        for k in range(length):
            run.window(kind, level, k == 0)
            # 0 <= q10 <= q50 <= q90 <= the bound (in `_check`), on every horizon of every issued forecast
            assert _check(run) == len(H)


@settings(max_examples=60, deadline=None)
@given(
    segs=segments,
    widths=st.lists(st.tuples(st.floats(0.0, 1e6), st.floats(0.0, 1e6), st.floats(0.0, 1e6)), min_size=1),
)
def test_calibration_widens_by_its_bounded_rule(
    segs: list[tuple[str, int, float]], widths: list[tuple[float, float, float]]
) -> None:
    """Whatever the series (steps, silences, bursts, NaN windows) and the model's bands (zero-width, huge), a
    calibrated half-band is at most K_MAX times the model's half-width or the floor f S, and q50 is untouched."""
    cal = Calibrator((5.0,), 1.0, min_scores=3)
    t = 0
    for kind, length, level in segs:
        for k in range(length):
            t += 1
            v = {"step": level, "silence": 0.0, "burst": level * 50 if k == 0 else 0.0, "nan": math.nan}[kind]
            cal.observe(SeriesPoint(float(t), 1.0, v, v, v, v))
            lo, mid, hi = widths[t % len(widths)]
            raw = {m: [(mid - lo, mid, mid + hi)] for m in METRICS}
            out = cal.adjust(float(t), (5.0,), raw)
            for i, m in enumerate(METRICS):
                q10, q50, q90 = out[m][0]
                floor = max(cal.scale_floor * cal.scale_long[i, 0], 1e-9)
                assert q50 == mid
                assert q50 <= q90 <= mid + K_MAX * max(hi, floor) * (1 + 1e-9) + 1e-6
                assert q50 >= q10 >= mid - K_MAX * max(lo, floor) * (1 + 1e-9) - 1e-6


def test_the_bound_counts_live_trajectories_announced_prompts_and_the_arrivals_the_run_has_shown() -> None:
    lim = Limits()
    for t in (0.0, 0.1, 0.2, 50.0):  # three starts within 0.2 s, one later
        lim.started(t)
    lim.turn(4000.0, first=True, cycle_s=None)
    lim.turn(300.0, first=False, cycle_s=4.0)
    lim.output(500.0)
    lim.decode_rate(80.0)
    u = demand_bound(lim, 2, np.array([100.0]), 9000.0, [(3.0, 7000.0), (20.0, 1.0)], (5.0,))
    n, f, turns = 2 + 1 + 3, MARGIN * 4000.0, 1 + 1  # live + due + A(5 s); turns within 5 s at a 4 s cycle
    assert u["decode_concurrency"] == [n]
    assert u["decode_tokens"] == [pytest.approx(n * RATE_MARGIN * 80.0 * 5.0)]
    assert u["prefill_tokens"] == [pytest.approx(f + 7000.0 + 3 * f + n * turns * MARGIN * 300.0)]
    assert u["kv_tokens"] == [pytest.approx(9000.0 + 7000.0 + 3 * f + n * turns * MARGIN * 800.0)]


@settings(max_examples=100, deadline=None)
@given(
    gaps=st.lists(st.floats(0.0, 20.0), min_size=1, max_size=60),
    asks=st.lists(st.integers(0, 60), max_size=5),
    h=st.sampled_from([5.0, 10.0, 30.0]),
)
def test_arrivals_within_is_the_most_starts_in_any_span(gaps: list[float], asks: list[int], h: float) -> None:
    """A(h), kept as a sliding window and asked at any time, equals the brute-force count."""
    times = np.cumsum(gaps)
    lim = Limits()
    for k, t in enumerate(times):
        lim.started(float(t))
        if k in asks:  # asked midway: later starts must still be counted
            seen = times[: k + 1]
            assert lim.arrivals_within(h) == max(int(((seen >= x - h) & (seen <= x)).sum()) for x in seen)
    assert lim.arrivals_within(h) == max(int(((times >= x - h) & (times <= x)).sum()) for x in times)
