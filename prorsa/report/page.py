"""The report as one self-contained HTML file: a comparison table, the distribution of trajectory times, and per
run the engines' roles, demand against capacity and forecast against what happened. Plots are inline SVG; the
page loads nothing (no scripts, fonts or images from anywhere), so it opens offline and can be mailed as is.

Every plot is a `<figure class="plot" data-plot="RUN:KIND">`; a plot that cannot be drawn is replaced by a
`<p class="missing" data-plot="RUN:KIND">` saying why, so a reader (and the test) sees which is which.
"""

from __future__ import annotations

import html
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from prorsa.report import figures
from prorsa.report.model import RunData, band_coverage
from prorsa.rollout.report import SUMMARY_ROWS

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 72em; color: #222; }
table { border-collapse: collapse; margin: 1em 0; }
th, td { border: 1px solid #ccc; padding: 0.3em 0.7em; text-align: right; }
th:first-child, td:first-child { text-align: left; }
figure.plot { margin: 1em 0; }
figure.plot svg { max-width: 100%; height: auto; }
p.missing, p.notice { background: #fff4e5; border-left: 4px solid #f0a030; padding: 0.5em 1em; }
p.error { background: #fdecea; border-left: 4px solid #d33; padding: 0.5em 1em; }
.meta { color: #666; }
"""


@dataclass(frozen=True)
class Report:
    path: str
    notices: list[str]  # what the reader should know first (e.g. a run that completed no trajectory)


def notices(runs: list[RunData]) -> list[str]:
    out = [f"{r.name}: could not run: {r.error}" for r in runs if r.error]
    out += [
        f"{r.name}: no trajectory completed, so it has no trajectory times"
        for r in runs
        if not r.error and not r.completed
    ]
    return out


def write_report(directory: str, filename: str, title: str, runs: list[RunData], lines: list[str]) -> Report:
    """Write `directory/filename` (the directory is created); `lines` describe the run under the title."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, filename)
    notes = notices(runs)
    body = [
        f"<h1>{_e(title)}</h1>",
        *(f'<p class="meta">{_e(line)}</p>' for line in lines),
        f'<p class="meta">written {datetime.now(UTC):%Y-%m-%d %H:%M:%S} UTC</p>',
        *(f'<p class="notice">{_e(n)}</p>' for n in notes),
        "<h2>Comparison</h2>",
        _table(runs),
        "<h2>Trajectory completion times</h2>",
        _times(runs),
    ]
    for run in runs:
        body += [f"<h2>{_e(run.name)}</h2>", *_run_sections(run)]
    page = (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{_e(title)}</title><style>{STYLE}</style></head>\n<body>\n"
        + "\n".join(body)
        + "\n</body></html>\n"
    )
    with open(path, "w", encoding="utf-8") as f:
        f.write(page)
    return Report(path=path, notices=notes)


def _e(text: object) -> str:
    return html.escape(str(text))


def _table(runs: list[RunData]) -> str:
    head = "".join(f"<th>{_e(r.name)}</th>" for r in runs)
    rows = []
    for label, key, fmt in SUMMARY_ROWS:
        cells = "".join(f"<td>{fmt.format(r.summary[key]) if key in r.summary else '–'}</td>" for r in runs)
        rows.append(f"<tr><td>{_e(label)}</td>{cells}</tr>")
    return f'<table class="comparison"><tr><th>metric</th>{head}</tr>{"".join(rows)}</table>'


def _figure(key: str, caption: str, draw: Callable[[], str]) -> str:
    return (
        f'<figure class="plot" data-plot="{_e(key)}">{draw()}<figcaption>{_e(caption)}</figcaption></figure>'
    )


def _missing(key: str, why: str) -> str:
    return f'<p class="missing" data-plot="{_e(key)}">{_e(why)}</p>'


def _times(runs: list[RunData]) -> str:
    if not any(r.completed for r in runs):
        return _missing(
            "all:trajectory_times", "No trajectory completed in any run: there are no times to show."
        )
    return _figure(
        "all:trajectory_times",
        "Fraction of trajectories completed within each time, per run.",
        lambda: figures.trajectory_times(runs),
    )


def _run_sections(run: RunData) -> list[str]:
    if run.error:
        return [f'<p class="error">{_e(run.error)}</p>']
    out = []
    key = run.name
    if run.roles:
        out.append(_figure(f"{key}:roles", "Role of every engine over time.", lambda: figures.roles(run)))
    else:
        out.append(_missing(f"{key}:roles", "No engine reported its role during the run."))
    w = run.windows
    if w is not None and w.t_s:
        out.append(
            _figure(
                f"{key}:demand",
                f"Prefill and decode demand against the capacity of the engines in each role ({w.window_s:.3g} s windows).",
                lambda: figures.demand(w),
            )
        )
    else:
        out.append(_missing(f"{key}:demand", "No demand or engine throughput was recorded."))
    if run.forecasts is not None and w is not None:
        cover = band_coverage(run.forecasts, w)
        held = "; ".join(f"{role} {share:.0%} of {n}" for role, (share, n) in cover.items())
        out.append(
            _figure(
                f"{key}:forecast",
                "Demand forecast (as a rate over its horizon) against the demand realised over the same horizon. "
                "The q10–q90 band is the forecaster's calibrated one, kept within the demand the live "
                "trajectories could physically ask for (services/forecaster/calibration.py, bounds.py)"
                + (f"; realised within it (nominal 80 %): {held}." if held else "."),
                lambda: figures.forecast(run),
            )
        )
    else:
        out.append(
            _missing(f"{key}:forecast", f"No forecast plot: {run.forecast_note or 'no forecast recorded'}.")
        )
    return out
