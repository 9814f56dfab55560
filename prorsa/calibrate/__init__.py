"""Calibration of the engine performance model against a real engine: measure (`measure`), fit (`fit`), replay a
workload through the fitted model (`replay`)."""
