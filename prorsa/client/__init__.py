"""Client SDK for trainers: trajectories, turns, tool calls, exactly-once token streams."""

from prorsa.client.client import GenerateError, RolloutClient, Trajectory
from prorsa.client.stream import GenerateResult, StreamAssembler

__all__ = ["GenerateError", "GenerateResult", "RolloutClient", "StreamAssembler", "Trajectory"]
