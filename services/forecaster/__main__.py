"""`python -m services.forecaster [--nats URL] [--predictor ensemble]`: run the forecaster alone."""

from __future__ import annotations

import argparse

from services.forecaster.service import ForecasterService
from services.runtime.main import run_service_main


def _extend(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--predictor",
        default="ensemble",
        choices=("naive", "ewma", "ets", "arima", "lifecycle", "ensemble", "prorsa"),
        help="which predictor's forecast to publish (prorsa: deprecated alias of ensemble)",
    )
    p.add_argument("--horizons-s", default="5,10,30", help="comma-separated forecast horizons in seconds")
    p.add_argument("--window-s", type=float, default=1.0, help="width of the demand series' windows")
    p.add_argument("--refit-interval-s", type=float, default=30.0, help="seconds between model refits")
    p.add_argument("--seed", type=int, default=0, help="seed of the lifecycle model's Monte Carlo")
    p.add_argument(
        "--forecast-interval-s",
        type=float,
        default=5.0,
        help="seconds between published forecasts (the allocator's cadence; 0: one per snapshot)",
    )
    p.add_argument(
        "--refit-cpu-share",
        type=float,
        default=0.1,
        help="most of one core model refits may use (wall clock; binds only under a compressed clock; 0: no cap)",
    )


def _make(args: argparse.Namespace, url: str, namespace: str) -> ForecasterService:
    return ForecasterService(
        url,
        namespace=namespace,
        instance_id=args.instance_id,
        metrics_port=args.metrics_port,
        predictor=args.predictor,
        horizons_s=tuple(float(h) for h in args.horizons_s.split(",") if h.strip()),
        window_s=args.window_s,
        refit_interval_s=args.refit_interval_s,
        seed=args.seed,
        forecast_interval_s=args.forecast_interval_s,
        refit_cpu_share=args.refit_cpu_share,
    )


def main(argv: list[str] | None = None) -> int:
    return run_service_main(_make, "Prorsa demand forecaster", argv, extend=_extend)


if __name__ == "__main__":
    raise SystemExit(main())
