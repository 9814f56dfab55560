"""Deterministic discrete-event simulator of agentic-RL rollout on prefill / decode / mixed engines.

`run_simulation(SimConfig(...)) -> SimResult`. The names are loaded on first use, so importing a submodule (the
CLI's argument parser) stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prorsa.sim.runner import SimConfig, SimResult, run_simulation

__all__ = ["SimConfig", "SimResult", "run_simulation"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from prorsa.sim import runner

        return getattr(runner, name)
    raise AttributeError(f"module 'prorsa.sim' has no attribute {name!r}")
