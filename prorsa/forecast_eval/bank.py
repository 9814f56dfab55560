"""ForecastBank: every predictor under evaluation, fed the same events and snapshots, asked at the same ticks.

The `ensemble` runs its members (`ensemble.DEFAULT_MEMBERS`) on exactly the inputs a standalone
core would give them, and refits them all on its core's schedule. So when `ensemble` is evaluated, its members are
scored from inside it (`EnsemblePredictor.member_forecasts`) instead of running a second copy of each: one event
learner, one statsmodels refit per schedule, the same forecasts. A requested predictor that is not a member, and
any injected predictor instance, gets a `ForecasterCore` of its own. Refits run synchronously on each core's
schedule (offline evaluation: virtual time does not move while a model fits).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from proto import LifecycleSnapshot
from services.forecaster.base import MetricForecast, Predictor, clean_triple, make_predictor, resolve_name
from services.forecaster.core import ForecasterCore
from services.forecaster.ensemble import DEFAULT_MEMBERS, EnsemblePredictor
from services.forecaster.lifecycle_model import PriorSamples
from services.forecaster.picture import PendingArrival

PREDICTORS: tuple[str, ...] = ("naive", "ewma", "ets", "arima", "lifecycle", "ensemble")
SCORED_METRICS: tuple[str, ...] = ("prefill_tokens", "decode_tokens")


class ForecastBank:
    """Cores for `names` (+ `extra` predictor instances by name); `observe_event`, then `tick` once per tick."""

    def __init__(
        self,
        names: Sequence[str] = PREDICTORS,
        horizons_s: Sequence[float] = (5.0, 10.0, 30.0),
        window_s: float = 1.0,
        refit_interval_s: float = 30.0,
        seed: int = 0,
        extra: dict[str, Predictor] | None = None,
        prior: PriorSamples | None = None,
    ) -> None:
        self.horizons_s = tuple(float(h) for h in horizons_s)
        names = [resolve_name(n) for n in names]  # `prorsa` (deprecated) is the ensemble
        self.names = list(dict.fromkeys([*names, *(extra or {})]))
        kw: dict[str, Any] = {"horizons_s": self.horizons_s, "window_s": window_s}
        # lifecycle's own options: its Monte Carlo seed and what a new workload starts from (`prior`)
        life: dict[str, Any] = {"seed": seed, "prior": prior}
        self.cores: dict[str, ForecasterCore] = {}  # core name -> core
        self._members: dict[str, str] = {}  # member name -> core of the ensemble that runs it
        if "ensemble" in names:
            members = [make_predictor(m, **kw, **(life if m == "lifecycle" else {})) for m in DEFAULT_MEMBERS]
            ens = EnsemblePredictor(members=members, seed=seed, **kw)
            self.cores["ensemble"] = ForecasterCore(ens, refit_interval_s=refit_interval_s, seed=seed, **kw)
            self._members = {m: "ensemble" for m in DEFAULT_MEMBERS if m in names}
        for name in names:
            if name not in self.cores and name not in self._members:
                opts = {"prior": prior} if name == "lifecycle" else None
                self.cores[name] = ForecasterCore(
                    name, refit_interval_s=refit_interval_s, seed=seed, predictor_options=opts, **kw
                )
        for name, predictor in (extra or {}).items():
            self.cores[name] = ForecasterCore(predictor, refit_interval_s=refit_interval_s, seed=seed, **kw)
        self.refits = 0
        # Wall seconds per core: refitting, and observing snapshots + forecasting.
        self.refit_s: dict[str, float] = dict.fromkeys(self.cores, 0.0)
        self.forecast_s: dict[str, float] = dict.fromkeys(self.cores, 0.0)
        # The demand bound every forecast was kept within, per tick: (horizon, scored metric) (services/forecaster/
        # bounds.py; every core learns it from the same events, so the first core's stands for all)
        self.bounds: list[np.ndarray] = []

    def observe_event(self, event: Any, now: float) -> None:
        for core in self.cores.values():
            core.observe_event(event, now)

    def tick(
        self, snapshot: LifecycleSnapshot, now: float, pending: Sequence[PendingArrival] = ()
    ) -> dict[str, np.ndarray]:
        """Every predictor's forecast at `now`: name -> array (horizon, scored metric, q10/q50/q90)."""
        out: dict[str, np.ndarray] = {}
        for name, core in self.cores.items():
            t0 = time.perf_counter()
            core.observe_snapshot(snapshot, now, pending=pending)
            fc = core.predictor.predict(now, self.horizons_s)
            out[name] = np.array(
                [[[q.q10, q.q50, q.q90] for q in (hf.prefill_tokens, hf.decode_tokens)] for hf in fc.horizons]
            )
            self.forecast_s[name] += time.perf_counter() - t0
        first = next(iter(self.cores.values()))
        bound = first.predictor.bound(now, self.horizons_s)
        self.bounds.append(
            np.full((len(self.horizons_s), len(SCORED_METRICS)), np.inf)
            if bound is None
            else np.array([[bound[m][j] for m in SCORED_METRICS] for j in range(len(self.horizons_s))])
        )
        for name, core_name in self._members.items():
            ens = self.cores[core_name].predictor
            assert isinstance(ens, EnsemblePredictor)
            out[name] = _array(ens.member_forecasts[name])
        for name, core in self.cores.items():
            job = core.refit_job(now) if core.refit_due(now) else None
            if job is not None:
                t0 = time.perf_counter()
                core.install(job())
                self.refit_s[name] += time.perf_counter() - t0
                self.refits += 1
        return {name: out[name] for name in self.names}


def _array(fc: MetricForecast) -> np.ndarray:
    return np.array(
        [[clean_triple(*fc[m][j]) for m in SCORED_METRICS] for j in range(len(fc[SCORED_METRICS[0]]))]
    )
