"""Offline scoring of the demand predictors on a simulated rollout (`prorsa forecast-eval`).

bridge.py (simulator events -> proto messages), ledger.py (exact realised demand), hints.py (the driver's upcoming
first turns), bank.py (the predictors' cores), scoring.py (WAPE, coverage), evaluate.py (`run_forecast_eval`).
"""
