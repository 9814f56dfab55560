"""Importing this module registers every predictor under its name (see `base.make_predictor`)."""

from services.forecaster import ensemble, lifecycle, simple, statespace

__all__ = ["ensemble", "lifecycle", "simple", "statespace"]
