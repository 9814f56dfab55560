"""`--report DIR` of `prorsa bench`, `prorsa rollout` and `prorsa demo`: gather each command's runs as
`prorsa.report.RunData`, write the page, say where it is and what a reader should know first."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

    from prorsa.report import RunData
    from prorsa.rollout.live import LiveResult


def bench_report(
    console: Console,
    directory: str,
    title: str,
    rows: list[dict[str, Any]],
    full: dict[str, dict],
    config: dict,
) -> str:
    """One run per bench row (static:best as the split it chose)."""
    from prorsa.report import from_error, from_sim_json

    runs = []
    for r in rows:
        if "error" in r:
            runs.append(from_error(r["policy"], r["error"]))
            continue
        spec = r.get("chosen", r["policy"])
        name = r["policy"] + (f" → {spec}" if "chosen" in r else "")
        runs.append(from_sim_json(name, full[spec]))
    return write(console, directory, "bench.html", title, runs, [_config_line(config)])


def live_runs(results: dict[str, LiveResult], profile: str | None) -> list[RunData]:
    from prorsa.report import from_live

    return [from_live(name, result, profile) for name, result in results.items()]


def write(
    console: Console, directory: str, filename: str, title: str, runs: list[RunData], lines: list[str]
) -> str:
    """Write the page; print what a reader should know first, then where it is. Returns its path."""
    from prorsa.report import write_report

    report = write_report(directory, filename, title, runs, lines)
    for note in report.notices:
        console.print(f"[yellow]report: {note}[/yellow]", soft_wrap=True)
    console.print(f"report: {report.path}", soft_wrap=True, highlight=False)  # one line: a path to copy
    return report.path


def _config_line(config: dict[str, Any]) -> str:
    return " · ".join(f"{k} {v}" for k, v in config.items() if v is not None and k != "policy")
