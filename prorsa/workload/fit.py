"""Log-normal mixtures: fitted to a trace by EM on log-values, then sampled with a numpy Generator.

Token counts and latencies in agent traces are heavy-tailed and often bimodal (a short tool call vs a long reasoning
reply; a template-only observation vs a file dump), which one log-normal misses (two-sample KS ≈ 0.1–0.2 on the SWE
trace). A mixture of a few Gaussians on log-values captures the modes with a handful of parameters, and an optional
*atom* holds a single value that repeats far more than any other (the SWE agent's fixed 30-token empty-observation
template is 20 % of its later turns: no continuous density fits a point mass).

The fit is deterministic (initialised at quantiles, fixed stopping rule) and runs on a 512-bin histogram of the
log-values, so fitting a profile at first use costs milliseconds whatever the trace's size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

_MIN_SIGMA = 0.05  # floor on a component's log-scale, so a narrow cluster cannot collapse EM
_MAX_ITERATIONS = 500
_TOLERANCE = 1e-7  # stop when the mean log-likelihood gains less than this per iteration
_BINS = 512
_ATOM_MIN_SHARE = 0.05  # a value is an atom when it is at least this share of all values


@dataclass(frozen=True, slots=True)
class LogMixture:
    """With probability atom_weight the value `atom`; otherwise exp(X), X ~ Σ w_i · N(mu_i, sigma_i²), in [low, high]."""

    weights: tuple[float, ...]  # of the continuous components, summing to 1
    mus: tuple[float, ...]  # natural-log units
    sigmas: tuple[float, ...]
    low: float  # smallest value drawn (the observed minimum for a fitted mixture)
    high: float  # largest value drawn (the observed maximum for a fitted mixture)
    atom: float = 0.0
    atom_weight: float = 0.0

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        """`size` floats drawn from the mixture (shape (size,))."""
        component = rng.choice(len(self.weights), size=size, p=np.asarray(self.weights))
        logs = rng.normal(np.asarray(self.mus)[component], np.asarray(self.sigmas)[component])
        values = np.clip(np.exp(logs), self.low, self.high)
        if self.atom_weight > 0:
            values[rng.random(size) < self.atom_weight] = self.atom
        return values

    def sample_int(self, rng: np.random.Generator, size: int) -> np.ndarray:
        """`size` integers (token counts), rounded from `sample` (shape (size,), int64)."""
        return np.rint(self.sample(rng, size)).astype(np.int64)

    def describe(self) -> str:
        """The parameters in one line, for notes and docs."""
        parts = [
            f"{w:.2f}·LN(median {np.exp(m):.4g}, σ {s:.2f})"
            for w, m, s in zip(self.weights, self.mus, self.sigmas, strict=True)
        ]
        text = " + ".join(parts)
        if self.atom_weight > 0:
            text = f"{self.atom_weight:.2f}·[{self.atom:.4g}] + {1 - self.atom_weight:.2f}·({text})"
        return f"{text} in [{self.low:.4g}, {self.high:.4g}]"


def lognormal(median: float, sigma: float, low: float, high: float) -> LogMixture:
    """A single log-normal given by its median and log-scale, clipped to [low, high]."""
    return LogMixture((1.0,), (float(np.log(median)),), (sigma,), low, high)


def fit_log_mixture(
    values: Sequence[float] | np.ndarray, components: int, *, atom: bool = False
) -> LogMixture:
    """Fit a `components`-Gaussian mixture to log(values) by EM (plus an atom at the modal value if `atom`).

    Raises ValueError for fewer values than components or a non-positive value.
    """
    x = np.asarray(values, dtype=float)
    if x.size < components or np.any(x <= 0):
        raise ValueError(f"need ≥ {components} positive values, got {x.size} (min {x.min(initial=0)})")
    atom_value, atom_weight = 0.0, 0.0
    if atom:
        uniques, counts = np.unique(x, return_counts=True)
        if counts.max() >= _ATOM_MIN_SHARE * x.size:
            atom_value = float(uniques[counts.argmax()])
            atom_weight = float(counts.max() / x.size)
            x = x[x != atom_value]
    weights, mus, sigmas = _em(*_histogram(np.log(x)), components)
    order = np.argsort(mus)
    return LogMixture(
        weights=tuple(float(w) for w in weights[order]),
        mus=tuple(float(m) for m in mus[order]),
        sigmas=tuple(float(s) for s in sigmas[order]),
        low=float(x.min()),
        high=float(x.max()),
        atom=atom_value,
        atom_weight=atom_weight,
    )


def _histogram(logs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(bin centres, counts) of the non-empty bins; exact when there are fewer distinct values than bins."""
    uniques, counts = np.unique(logs, return_counts=True)
    if uniques.size <= _BINS:
        return uniques, counts.astype(float)
    counts_binned, edges = np.histogram(logs, bins=_BINS)
    centres = 0.5 * (edges[:-1] + edges[1:])
    keep = counts_binned > 0
    return centres[keep], counts_binned[keep].astype(float)


def _em(points: np.ndarray, counts: np.ndarray, components: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Weighted EM for a 1-D Gaussian mixture over `points` with multiplicities `counts`."""
    cdf = np.cumsum(counts) / counts.sum()
    mus = points[np.searchsorted(cdf, (np.arange(components) + 0.5) / components)].astype(float)
    mean = np.average(points, weights=counts)
    spread = np.sqrt(np.average((points - mean) ** 2, weights=counts))
    sigmas = np.full(components, max(spread, _MIN_SIGMA))
    weights = np.full(components, 1.0 / components)
    previous = -np.inf
    for _ in range(_MAX_ITERATIONS):
        resp, loglik = _e_step(points, counts, weights, mus, sigmas)
        mass = resp.sum(axis=0) + 1e-12
        weights = mass / mass.sum()
        mus = (resp * points[:, None]).sum(axis=0) / mass
        sigmas = np.sqrt((resp * (points[:, None] - mus) ** 2).sum(axis=0) / mass)
        sigmas = np.maximum(sigmas, _MIN_SIGMA)
        if loglik - previous < _TOLERANCE:
            break
        previous = loglik
    return weights, mus, sigmas


def _e_step(
    points: np.ndarray, counts: np.ndarray, weights: np.ndarray, mus: np.ndarray, sigmas: np.ndarray
) -> tuple[np.ndarray, float]:
    """Count-weighted responsibilities (shape (n, components)) and the mean log-likelihood (up to a constant)."""
    z = (points[:, None] - mus) / sigmas
    log_p = np.log(weights) - np.log(sigmas) - 0.5 * z**2
    top = log_p.max(axis=1, keepdims=True)
    p = np.exp(log_p - top)
    total = p.sum(axis=1, keepdims=True)
    loglik = float(np.sum(counts * (np.log(total[:, 0]) + top[:, 0])) / counts.sum())
    return p / total * counts[:, None], loglik


def ks_statistic(a: Sequence[float] | np.ndarray, b: Sequence[float] | np.ndarray) -> float:
    """Two-sample Kolmogorov–Smirnov statistic: the largest gap between the two empirical CDFs."""
    a_sorted = np.sort(np.asarray(a, dtype=float))
    b_sorted = np.sort(np.asarray(b, dtype=float))
    both = np.concatenate([a_sorted, b_sorted])
    cdf_a = np.searchsorted(a_sorted, both, side="right") / a_sorted.size
    cdf_b = np.searchsorted(b_sorted, both, side="right") / b_sorted.size
    return float(np.max(np.abs(cdf_a - cdf_b)))
