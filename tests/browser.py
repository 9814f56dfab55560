"""Open a report in headless Chromium (Debian's `chromium`): the DOM it rendered and every console message.

`chromium` is installed on first use where apt works (CI runs the tests as root on a fresh Debian machine); where
it cannot be, the tests that need it skip and say why. The page is read with `--dump-dom` (the DOM after load) and
`--enable-logging=stderr --v=0`, under which Chromium logs each console message as an `INFO:CONSOLE` line.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

import pytest

INSTALL = ["apt-get", "install", "-y", "--no-install-recommends", "chromium"]


def _apt_usable() -> str:
    """'' when apt-get can install packages here, else why not."""
    if shutil.which("apt-get") is None:
        return "apt-get is not on this machine"
    if os.geteuid() != 0:
        return "not root, so apt-get cannot install"
    return ""


def find_or_install_chromium() -> str:
    """The chromium binary; installs Debian's package when missing and apt is usable. Skips (with the reason)
    when neither works."""
    found = shutil.which("chromium")
    if found:
        return found
    why = _apt_usable()
    if why:
        pytest.skip(
            f"chromium is not installed and {why}: install Debian's `chromium` package to run this check"
        )
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    run = subprocess.run(INSTALL, capture_output=True, text=True, env=env, timeout=900)
    if run.returncode != 0:  # a fresh machine may have no package lists yet
        subprocess.run(["apt-get", "update"], capture_output=True, text=True, env=env, timeout=300)
        run = subprocess.run(INSTALL, capture_output=True, text=True, env=env, timeout=900)
    found = shutil.which("chromium")
    if run.returncode != 0 or not found:
        pytest.skip(f"`{' '.join(INSTALL)}` failed (rc {run.returncode}): {run.stderr.strip()[-400:]}")
    return found


@dataclass(frozen=True)
class Rendered:
    dom: str
    console: list[str]  # every console message the page produced (errors, warnings, logs)
    plots: dict[str, str]  # data-plot key → "figure" (an inline SVG drawn) or "missing" (a note saying why)


class _Plots(HTMLParser):
    """data-plot key → "figure" when the figure holds an <svg> with a non-empty viewBox, else what it is."""

    def __init__(self) -> None:
        super().__init__()
        self.plots: dict[str, str] = {}
        self._open: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        key = a.get("data-plot")
        if key is not None:
            self.plots[key] = "missing" if tag == "p" else "empty"
            self._open = key if tag == "figure" else None
        elif tag == "svg" and self._open is not None:
            box = [float(x) for x in (a.get("viewbox") or "0 0 0 0").split()]
            if len(box) == 4 and box[2] > 0 and box[3] > 0:
                self.plots[self._open] = "figure"

    def handle_endtag(self, tag: str) -> None:
        if tag == "figure":
            self._open = None


def render(chromium: str, page: Path) -> Rendered:
    """Load `page` headless; the DOM after load, the console messages, and which plots were drawn."""
    run = subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",  # CI runs as root, where Chromium's sandbox refuses to start
            "--disable-gpu",
            "--enable-logging=stderr",
            "--v=0",
            "--dump-dom",
            page.resolve().as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    console = [line for line in run.stderr.splitlines() if ":CONSOLE" in line]
    parser = _Plots()
    parser.feed(run.stdout)
    return Rendered(dom=run.stdout, console=console, plots=parser.plots)
