"""The `prorsa` command line. Each subcommand lives in its own module exposing
`add_arguments(parser)` and `run(args) -> int`; modules are imported only when their command runs, so
`prorsa status` does not pay for matplotlib or statsmodels."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Sequence

# (command, module, one-line help)
COMMANDS: tuple[tuple[str, str, str], ...] = (
    ("up", "prorsa.commands.up", "start embedded NATS + every service + engines; Ctrl-C stops"),
    ("gateway", "prorsa.commands.gateway", "the HTTP front door: OpenAI chat/completions and /generate"),
    ("status", "prorsa.commands.status", "list live services and engines from their health replies"),
    ("secrets", "prorsa.commands.secrets", "write bus credentials and permissions for a cluster (compose)"),
    ("top", "prorsa.commands.top", "a live view of a running cluster: engines, demand, plan, trajectories"),
    ("demo", "prorsa.commands.demo", "the main job on the embedded default"),
    ("sim", "prorsa.sim.cli", "discrete-event simulation of one policy on a workload"),
    ("bench", "prorsa.commands.bench", "every allocator policy on the same workload and seed"),
    (
        "forecast-eval",
        "prorsa.commands.forecast_eval",
        "score every demand predictor on a simulated workload",
    ),
    ("rollout", "prorsa.commands.rollout", "agentic RL rollout over the live system"),
    ("profile", "prorsa.commands.profile", "measure a real engine and write a simulator profile"),
    (
        "tiny-model",
        "prorsa.commands.tiny_model",
        "write the small random test model for --model (no hub needed)",
    ),
    (
        "chaos",
        "prorsa.commands.chaos",
        "fault campaign: kill engines, services, nats-server; flood hostile input",
    ),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prorsa", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module, help_text in COMMANDS:
        if importlib.util.find_spec(module) is None:
            continue
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        # Arguments are declared by the module; importing it here is cheap because modules import heavy
        # dependencies inside their `run`.
        importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
