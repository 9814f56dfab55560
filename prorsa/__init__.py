"""Prorsa: forecast-guided prefill/decode disaggregation for agentic RL rollout (user-facing package)."""

from prorsa import native

__version__ = "0.1.0"

# The simulator's hot path runs compiled when a current mypyc build exists (`prorsa.native`); else the source.
native.install()
