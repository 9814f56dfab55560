"""Prorsa: forecast-guided prefill/decode disaggregation for agentic RL rollout (user-facing package)."""

__version__ = "0.1.0"
