"""Client SDK for trainers: trajectories, turns, tool calls, exactly-once token streams.

The exports load on first use (PEP 562), so the pure parts (`prorsa.client.directory`, which the simulator's
placement shares) import without the bus client and its dependencies."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prorsa.client.client import GenerateError, RolloutClient, Trajectory
    from prorsa.client.stream import GenerateResult, StreamAssembler
    from prorsa.client.weights import PauseError, WeightsAck, WeightUpdateError

__all__ = [
    "GenerateError",
    "GenerateResult",
    "PauseError",
    "RolloutClient",
    "StreamAssembler",
    "Trajectory",
    "WeightUpdateError",
    "WeightsAck",
]

_HOME = {
    "GenerateError": "prorsa.client.client",
    "RolloutClient": "prorsa.client.client",
    "Trajectory": "prorsa.client.client",
    "GenerateResult": "prorsa.client.stream",
    "StreamAssembler": "prorsa.client.stream",
    "PauseError": "prorsa.client.weights",
    "WeightsAck": "prorsa.client.weights",
    "WeightUpdateError": "prorsa.client.weights",
}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'prorsa.client' has no attribute {name!r}")
    return getattr(import_module(_HOME[name]), name)
