"""The lifecycle predictor on synthetic populations whose truth is known, and the turn-count hazard."""

from __future__ import annotations

import numpy as np
import pytest

from proto import LifecycleSnapshot, TrajectoryFeatures
from services.forecaster.distributions import Distributions
from services.forecaster.lifecycle import LifecyclePredictor
from services.forecaster.lifecycle_model import turn_hazard
from services.forecaster.picture import PendingArrival, build_picture

H = (5.0, 10.0, 30.0)
MEAN_GAP_S = 10.0


def _snapshot(states: list[tuple[str, float, int, int]], ts: float = 100.0) -> LifecycleSnapshot:
    """(state, time in state, generated, context) per trajectory, all task "t", turn 0."""
    feats = [
        TrajectoryFeatures(
            traj_id=f"x{i}",
            task="t",
            state=s,
            time_in_state_s=tis,
            turn=0,
            context_tokens=ctx,
            generated_this_turn=g,
        )
        for i, (s, tis, g, ctx) in enumerate(states)
    ]
    counts = {s: sum(f.state == s for f in feats) for s in ("queued", "prefill", "decode", "tool_call")}
    ctx = {s: sum(f.context_tokens for f in feats if f.state == s) for s in counts}
    return LifecycleSnapshot(
        ts_s=ts,
        seq=1,
        counts=counts,
        counts_by_task={"t": counts},
        context_tokens_by_state=ctx,
        trajectories=feats,
    )


def _learned(rng: np.random.Generator, n: int = 4000, out_tokens: float = 1e7) -> Distributions:
    """Exponential gaps (all followed by a turn), lognormal new tokens, outputs far longer than any horizon."""
    d = Distributions(capacity=n)
    for gap in rng.exponential(MEAN_GAP_S, n):
        d.add("t", "gap_s", float(gap), True)
    for tok in rng.lognormal(np.log(200.0), 0.5, n):
        d.add("t", "new_tokens", float(tok))
    for _ in range(50):
        d.add("t", "output_tokens", out_tokens)
    d.add_decode_rate(30.0)
    return d


def _fit(d: Distributions, snap: LifecycleSnapshot, seed: int = 0, **kw: object) -> LifecyclePredictor:
    p = LifecyclePredictor(horizons_s=H, seed=seed, min_task_samples=20)
    p.observe(build_picture(snap, d, **kw), snap.ts_s)  # type: ignore[arg-type]
    p.refit(snap.ts_s)
    return p


def test_tool_call_population_expected_arrivals_and_calibration() -> None:
    """1,000 trajectories in tool calls with exponential latency (mean 10 s), spent 0-20 s so far."""
    rng = np.random.default_rng(0)
    d = _learned(rng)
    n = 1000
    spent = rng.uniform(0.0, 20.0, n)
    snap = _snapshot([("tool_call", float(s), 0, 5000) for s in spent])
    fc = _fit(d, snap).predict(snap.ts_s)
    learned = d.freeze().tasks["t"]
    gaps, new_tokens = np.sort(learned.gap_s), learned.new_tokens
    first_above = np.searchsorted(gaps, spent, side="right")
    seeds = 400
    for hf in fc.horizons:
        h, q = hf.horizon_s, hf.prefill_tokens
        # Expected arrivals: memoryless, so the time already spent does not matter.
        expected = n * (1.0 - np.exp(-h / MEAN_GAP_S)) * new_tokens.mean()
        assert q.q50 == pytest.approx(expected, rel=0.03), h
        # Realisations of the learned process (the gap given the time spent, new tokens per turn), many seeds.
        below90 = above10 = inside = 0
        for s in range(seeds):
            r = np.random.default_rng(1000 + s)
            idx = first_above + (r.random(n) * (len(gaps) - first_above)).astype(int)
            arrived = gaps[idx] - spent <= h
            actual = r.choice(new_tokens, size=int(arrived.sum())).sum()
            below90 += actual <= q.q90
            above10 += actual >= q.q10
            inside += q.q10 <= actual <= q.q90
        assert 0.86 <= below90 / seeds <= 0.94, (h, below90 / seeds)
        assert 0.86 <= above10 / seeds <= 0.94, (h, above10 / seeds)
        assert 0.74 <= inside / seeds <= 0.86, (h, inside / seeds)


def test_decode_demand_is_capped_by_the_per_sequence_rate() -> None:
    d = _learned(np.random.default_rng(1), out_tokens=10_000.0)
    snap = _snapshot([("decode", 1.0, 100, 3000)] * 10)
    fc = _fit(d, snap).predict(snap.ts_s)
    for hf in fc.horizons:
        h = hf.horizon_s
        assert hf.decode_tokens.q50 == pytest.approx(10 * 30.0 * h, rel=0.01)  # not 10 x 9,900 remaining
        assert hf.decode_concurrency.q50 == pytest.approx(10.0, rel=0.01)
        assert hf.kv_tokens.q50 == pytest.approx(10 * (3000 + 30.0 * h), rel=0.01)
        assert hf.prefill_tokens.q50 == pytest.approx(0.0, abs=1.0)


def test_decode_remaining_is_conditional_on_progress() -> None:
    d = Distributions()
    for L in np.random.default_rng(5).uniform(100.0, 400.0, 2000):
        d.add("t", "output_tokens", float(L))
    for _ in range(100):
        d.add("t", "gap_s", 1e6, True)  # nobody comes back within the horizon
        d.add("t", "new_tokens", 10.0)
    d.add_decode_rate(1000.0)  # fast: every remaining output completes within 5 s
    for g, expected in ((0, 250.0), (250, 75.0), (350, 25.0)):  # E[L - g | L > g], L ~ U(100, 400)
        snap = _snapshot([("decode", 0.0, g, 1000)])
        fc = _fit(d, snap).predict(snap.ts_s)
        assert fc.horizons[0].decode_tokens.q50 == pytest.approx(expected, rel=0.05), g


def test_pending_first_turns_arrive_at_their_time() -> None:
    d = _learned(np.random.default_rng(2))
    snap = _snapshot([("decode", 0.0, 0, 100)])
    pending = (
        PendingArrival(at_s=103.0, prompt_tokens=2000),
        PendingArrival(at_s=108.0, prompt_tokens=3000),
        PendingArrival(at_s=150.0, prompt_tokens=9999),
    )
    fc = _fit(d, snap, pending=pending).predict(snap.ts_s)
    got = [hf.prefill_tokens.q50 for hf in fc.horizons]
    assert got == pytest.approx([2000.0, 5000.0, 5000.0], abs=1.0)


def test_hinted_queued_trajectory_follows_the_hint() -> None:
    d = _learned(np.random.default_rng(3))
    snap = _snapshot([("queued", 0.0, 0, 1500)])
    unhinted = _fit(d, snap).predict(snap.ts_s)
    assert unhinted.horizons[0].prefill_tokens.q50 == pytest.approx(1500.0)  # no queue waits seen: at once
    hinted = _fit(d, snap, pending=(PendingArrival(at_s=120.0, prompt_tokens=1500, traj_id="x0"),))
    got = [hf.prefill_tokens.q50 for hf in hinted.predict(snap.ts_s).horizons]
    assert got == pytest.approx([0.0, 0.0, 1500.0], abs=1.0)


def test_turn_hazard_uses_live_trajectories_as_censored() -> None:
    ended = np.array([1, 2, 2, 3] * 10)
    h = turn_hazard(ended, np.zeros(0, dtype=np.int64), 0.0, min_at_risk=5)
    assert h[:3] == pytest.approx([0.25, 2 / 3, 1.0])
    # 40 more trajectories still live at turn 5: nobody at risk at turns 0..4 ended among them
    h2 = turn_hazard(ended, np.full(40, 5), 0.0, min_at_risk=5)
    assert h2[:3] == pytest.approx([10 / 80, 20 / 70, 10 / 50])
    assert turn_hazard(np.zeros(0), np.zeros(0, dtype=np.int64), 0.2).tolist() == [0.2]


def test_the_turn_count_decides_whether_a_trajectory_comes_back() -> None:
    """Every trajectory ends after its third turn: one at turn 0 comes back, one at turn 2 does not."""
    rng = np.random.default_rng(4)
    d = Distributions()
    for L in rng.uniform(10.0, 20.0, 200):
        d.add("t", "output_tokens", float(L))  # 0.1-0.2 s of decode at 100 tokens/s
    for g in rng.uniform(1.0, 2.0, 200):
        d.add("t", "gap_s", float(g), True)
        d.add("t", "new_tokens", 100.0)
    for _ in range(200):
        d.add("t", "turns", 3.0)
    d.add_decode_rate(100.0)

    def prefill_within_5s(turn: int) -> float:
        feats = [
            TrajectoryFeatures(
                traj_id="y",
                task="t",
                state="decode",
                time_in_state_s=0.0,
                turn=turn,
                context_tokens=100,
                generated_this_turn=0,
            )
        ]
        snap = LifecycleSnapshot(
            ts_s=0.0, seq=1, counts={}, counts_by_task={}, context_tokens_by_state={}, trajectories=feats
        )
        return _fit(d, snap).predict(0.0).horizons[0].prefill_tokens.q50

    assert prefill_within_5s(0) == pytest.approx(200.0, rel=0.05)  # turns 1 and 2 arrive, then it ends
    assert prefill_within_5s(1) == pytest.approx(100.0, rel=0.05)
    assert prefill_within_5s(2) == pytest.approx(0.0, abs=1.0)


def test_the_vectorised_sum_equals_a_per_trajectory_loop() -> None:
    """stacked_moments against the model written out one trajectory at a time."""
    from services.forecaster.lifecycle_stack import build_stack, stacked_moments

    rng = np.random.default_rng(9)
    d = Distributions()
    for task in ("a", "b"):
        for L in rng.lognormal(5.0, 1.0, 300):
            d.add(task, "output_tokens", float(L))
        for i, g in enumerate(rng.exponential(2.0, 300)):
            d.add(task, "gap_s", float(g), i % 9 != 0)
            d.add(task, "new_tokens", float(rng.integers(50, 500)))
        for t in rng.integers(1, 12, 100):
            d.add(task, "turns", float(t))
        for w in rng.exponential(0.5, 100):
            d.add(task, "queue_wait_s", float(w))
    d.add_decode_rate(40.0)
    n = 400
    states = ("queued", "prefill", "decode", "tool_call")
    feats = [
        TrajectoryFeatures(
            traj_id=f"z{i}",
            task=("a", "b", "new")[i % 3],
            state=states[i % 4],
            time_in_state_s=float(rng.uniform(0, 10)),
            turn=int(rng.integers(0, 15)),
            context_tokens=int(rng.integers(100, 5000)),
            generated_this_turn=int(rng.integers(0, 900)),
        )
        for i in range(n)
    ]
    snap = LifecycleSnapshot(
        ts_s=0.0, seq=1, counts={}, counts_by_task={}, context_tokens_by_state={}, trajectories=feats
    )
    p = _fit(d, snap)
    pic = p.picture
    assert pic is not None
    stack = build_stack(p.tables)
    slot = np.array([stack.slot(t) for t in pic.task_names])[pic.task]
    state = pic.state.astype(np.int64)
    x = np.where(state == 2, pic.generated, pic.time_in_state_s)
    mean, var = stacked_moments(stack, slot, state, x, pic.turn, pic.context)
    exp_mean = np.zeros_like(mean)
    exp_var = np.zeros_like(var)
    for i in range(n):
        table = p.tables.get(pic.task_names[pic.task[i]]) or p.tables["*"]
        kind = table.kinds[int(state[i])]
        xi = min(max(x[i], kind.grid[0]), kind.grid[-1])
        prob = 1.0 - table.hazard[min(int(pic.turn[i]), len(table.hazard) - 1)]
        if state[i] == 3:
            st = np.interp(xi, kind.grid, kind.surv_turn)
            sf = np.interp(xi, kind.grid, kind.surv_finish)
            prob = prob * st / (prob * st + (1 - prob) * sf)
        co = _coef_at(kind.grid, kind.base, xi) + prob * _coef_at(kind.grid, kind.cont, xi)  # (3, 5, H)
        c = pic.context[i]
        m = co[:, 0] + co[:, 1] * c
        exp_mean += m
        exp_var += co[:, 2] + co[:, 3] * c + co[:, 4] * c * c - m * m
    assert mean == pytest.approx(exp_mean, rel=1e-9)
    assert var == pytest.approx(np.maximum(exp_var, 0.0), rel=1e-6)


def _coef_at(grid: np.ndarray, table: np.ndarray, x: float) -> np.ndarray:
    return np.apply_along_axis(lambda col: np.interp(x, grid, col), 0, table)
