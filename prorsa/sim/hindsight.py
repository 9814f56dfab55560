"""`oracle`: a hindsight search — model-predictive control with perfect foresight, by forking the simulator.

The simulator is deterministic and knows the whole workload, so at each decision the oracle can try every split
for real: it forks the run (`Simulation.fork`, a deep copy), moves the fork's engines to the candidate split, runs
it `lookahead_s` further on the true future workload, and keeps the candidate whose fork did best. No model and no
forecast stand between the oracle and what happens, which makes it the limit any policy is measured against.

What a fork is judged by — the unit Prorsa is judged on, for the trajectories live at the decision:
  Σ completion times of those that finished within the window
  + Σ over the others of (time so far + turns left × the fork's own time per turn over the window),
the last term extrapolating each candidate at its own measured speed (time per turn = live trajectories /
turns completed per second, Little). Trajectories that arrive inside the window are simulated but not scored:
a candidate that ends a step sooner must not pay for the next step it lets in.

Candidates (pruning, as the issue allows): with up to 8 plain splits, every plain split P:D (P, D ≥ 1) and full
colocation; past that, the current split, P ± 1, P ± 2 and colocation, since a split far from the current one is
reached through its neighbours over successive decisions. The current split is always a candidate and wins ties,
so a decision never trades a known result for an equal guess.

Start-up: the initial split is chosen the same way from a fresh run of each candidate, over the first step (its
rollout to the last trajectory) rather than one window, so that the oracle starts where `static:best` would.
The result: holding one split from the start is a schedule too, and hindsight may choose it. So the oracle also
runs every candidate split held for the whole run, and returns the best schedule it knows (the search's, or a fixed
split's, by average trajectory time then rollout time; the JSON's `oracle.chosen` says which). The search alone can
end behind a fixed split when a window's extrapolation misjudges (seen on asynchronous runs, where the next step
arrives inside the window); the limit never does — `tests/test_sim_hindsight.py` checks it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from services.allocator.policies.common import Split, current_split, moves_for_split
from services.allocator.policy import AllocatorPolicy, ClusterView, Plan, PolicyError

if TYPE_CHECKING:
    from prorsa.sim.core import Simulation
    from prorsa.sim.runner import SimConfig, SimResult

FULL_SEARCH_UP_TO = 8  # plain splits scored exhaustively up to this many; beyond, neighbours (module doc)


class _Hold(AllocatorPolicy):
    """The policy of a fork: never moves anything (a fork gets no policy ticks; this is for safety)."""

    def initial_plan(self, engine_ids: Sequence[str]) -> Plan:
        return Plan(roles={})

    def plan(self, view: ClusterView) -> Plan | None:
        return None


@dataclass
class HindsightOracle(AllocatorPolicy):
    """The oracle policy: decides by forking `sim` (set by `run_hindsight` once the simulation exists)."""

    name: str = "oracle"
    interval_s: float = 10.0
    lookahead_s: float = 60.0
    initial: Split | None = None  # chosen before the run by `choose_initial`
    sim: Simulation | None = field(default=None, repr=False)
    forks: int = 0  # forks run (cost accounting, printed by the bench)
    last_scores: dict[str, float] = field(default_factory=dict)

    def initial_plan(self, engine_ids: Sequence[str]) -> Plan:
        split = self.initial or Split(0, 0, len(engine_ids))
        ids = sorted(engine_ids)
        roles = ["prefill"] * split.prefill + ["decode"] * split.decode + ["mixed"] * split.mixed
        return Plan(roles=dict(zip(ids, roles, strict=True)), reason=f"oracle: initial split {split}")

    def plan(self, view: ClusterView) -> Plan | None:
        if self.sim is None:
            raise PolicyError("oracle is a hindsight search over the simulator: simulator only")
        current = current_split(view)
        if not self.sim.driver.live_trajs:
            return None  # nothing live to judge a split by (between steps): keep
        scores = {c: self._try(view, c) for c in candidates(len(view.engines), current)}
        self.last_scores = {str(c): s for c, s in scores.items()}
        best = min(scores, key=lambda c: (scores[c], c != current))
        if best == current:
            return None
        return Plan(roles=moves_for_split(view, best), reason=f"oracle: {current} -> {best} (hindsight)")

    def _try(self, view: ClusterView, split: Split) -> float:
        sim = self.sim
        assert sim is not None
        fork = sim.fork(_Hold())
        fork.now = view.now
        fork.apply_plan(moves_for_split(view, split), view, view.now)
        self.forks += 1
        return judge(sim, fork, view.now, view.now + self.lookahead_s)


def candidates(n: int, current: Split) -> list[Split]:
    """The splits tried at a decision (module doc: pruning)."""
    if n == 1:
        return [Split(0, 0, 1)]
    plain = [Split(p, n - p) for p in range(1, n)]
    if len(plain) > FULL_SEARCH_UP_TO:
        p = current.prefill if not current.mixed else n // 4
        plain = [Split(q, n - q) for q in range(max(1, p - 2), min(n - 1, p + 2) + 1)]
    out = [*plain, Split(0, 0, n)]
    return out if current in out else [current, *out]


def judge(base: Simulation, fork: Simulation, now: float, until: float) -> float:
    """The module doc's score of `fork` (a copy of `base` at `now`) after running it to `until`."""
    live0 = {t.key for t in base.driver.live_trajs.values()}  # unique per trajectory, step and attempt
    done0, turns0 = base.metrics.completion.total, base.metrics.turns_finished
    end = fork.advance(until)
    window = max(end - now, 1e-9)
    left = fork.driver.live_trajs
    still = [t for t in left.values() if t.key in live0]
    turns = fork.metrics.turns_finished - turns0
    population = (len(live0) + len(still)) / 2.0
    per_turn = population * window / turns if turns > 0 else float("inf")
    cost = fork.metrics.completion.total - done0
    for t in still:
        remaining = len(t.spec.turns) - t.turn
        cost += (end - t.start_s) + (remaining * per_turn if remaining else 0.0)
    return cost


def choose_initial(
    build: Callable[[Split], Simulation], n: int, lookahead_s: float
) -> tuple[Split, dict[str, float]]:
    """The split to start with: each candidate run from scratch over the first step's rollout (module doc).
    `build(split)` returns a fresh, not yet started Simulation that starts with `split`."""
    scores: dict[Split, float] = {}
    for split in candidates(n, Split(0, 0, n)):
        sim = build(split)
        sim.driver.start(0.0)
        t = 0.0
        cap = sim.config.duration_s if sim.config.duration_s is not None else float("inf")
        while sim.driver.live.get(0) and sim.driver.finished_s is None and t < cap:
            reached = sim.advance(min(t + lookahead_s, cap))
            if reached <= t:
                break  # nothing left to happen
            t = reached
        scores[split] = sim.metrics.completion.total + sum(
            (t - tr.start_s) for tr in sim.driver.live_trajs.values() if tr.step == 0
        )
    best = min(scores, key=lambda c: scores[c])
    return best, {str(c): s for c, s in scores.items()}


def run_hindsight(config: SimConfig) -> SimResult:
    """Run `config` (policy `oracle[:options]`) as the hindsight search; the JSON's `oracle` key gives the
    initial choice's scores and the number of forks. Raises what `run_simulation` raises on a bad config."""
    import dataclasses
    import time

    from prorsa.sim.core import Simulation
    from prorsa.sim.runner import SimResult, _load_workload
    from services.allocator.registry import make_policy

    profile = config.model_profile()
    spec = make_policy(config.policy, config.engines, profile=profile)
    workload = _load_workload(config)
    oracle = HindsightOracle(interval_s=spec.interval_s, lookahead_s=getattr(spec, "lookahead_s", 60.0))
    quiet = dataclasses.replace(config, observer=None)
    t0 = time.perf_counter()

    def build(split: Split) -> Simulation:
        return Simulation(quiet, workload, profile, HindsightOracle(initial=split))

    oracle.initial, initial_scores = choose_initial(build, config.engines, oracle.lookahead_s)
    sim = Simulation(config, workload, profile, oracle, observer=config.observer)
    oracle.sim = sim
    end = sim.run()
    best = SimResult(config=config, sim=sim, end_s=end, wall_s=0.0)
    schedules = {"search": _score(best)}
    # Holding one split from the start is a schedule too, and hindsight may pick it: the limit is the best
    # schedule known in hindsight, so a search whose window misjudged never ends behind a fixed split.
    chosen = "search"
    for split in candidates(config.engines, Split(0, 0, config.engines)):
        spec = "colocated" if split.mixed else f"static:{split.prefill}:{split.decode}"
        run = Simulation(quiet, workload, profile, make_policy(spec, config.engines))
        result = SimResult(config=config, sim=run, end_s=run.run(), wall_s=0.0)
        name = spec
        schedules[name] = _score(result)
        if schedules[name] < schedules[chosen]:
            best, chosen = result, name
    if chosen != "search" and config.observer is not None:  # the user's observer sees the run returned
        run = Simulation(
            config, workload, profile, make_policy(chosen, config.engines), observer=config.observer
        )
        best = SimResult(config=config, sim=run, end_s=run.run(), wall_s=0.0)
    best.wall_s = time.perf_counter() - t0
    best.extra["oracle"] = {
        "method": "hindsight search (forked simulator), or a fixed split where that was better",
        "lookahead_s": oracle.lookahead_s,
        "interval_s": oracle.interval_s,
        "initial": str(oracle.initial),
        "initial_scores": initial_scores,
        "forks": oracle.forks,
        "search_switches": sim.metrics.role_switches,
        "schedules": {k: list(v) for k, v in schedules.items()},
        "chosen": chosen,
    }
    return best


def _score(result: SimResult) -> tuple[float, float]:
    """What the oracle ranks schedules by: average trajectory time, then rollout time."""
    return (result.sim.metrics.completion.mean(), result.end_s)
