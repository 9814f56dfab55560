"""Agentic RL rollout over the live system: the driver, its metrics and the `prorsa rollout` report."""
