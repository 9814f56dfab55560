"""structlog JSON logs, one line per event, tagged with the service and instance that wrote them."""

from __future__ import annotations

import logging
import os
import sys

import structlog


def configure_logging(level: str | None = None, json: bool | None = None) -> None:
    """Configure structlog once per process. JSON by default; `PRORSA_LOG_FORMAT=console` for humans."""
    level_name = (level or os.environ.get("PRORSA_LOG_LEVEL", "INFO")).upper()
    use_json = json if json is not None else os.environ.get("PRORSA_LOG_FORMAT", "json") != "console"
    renderer = (
        structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level_name, logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


def get_logger(service: str, instance_id: str) -> structlog.stdlib.BoundLogger:
    return structlog.get_logger().bind(service=service, instance=instance_id)
