"""The compiled simulator (`prorsa.native`, built by `python -m prorsa.native_build`) gives the source's results,
byte for byte, and is used only while it matches the source.

The rest of the suite runs the source (`conftest.py` sets `PRORSA_NATIVE=0`); these tests start processes with
the build switched on. They use the project's build when it is current (`make test` makes it) and build one into a
temporary folder otherwise (about a minute).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from prorsa import native

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    manifest = native.read_manifest(native.DEFAULT_BUILD_DIR)
    if manifest is not None and not native.stale_modules(manifest):
        return native.DEFAULT_BUILD_DIR
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(compiler) is None:
        pytest.skip(f"no C compiler ({compiler}) to build the compiled simulator with; the source runs")
    out = tmp_path_factory.mktemp("native") / "build"
    subprocess.run(
        [sys.executable, "-m", "prorsa.native_build", "--out", str(out)], check=True, cwd=native.ROOT
    )
    return out


def _env(native_on: bool, build_dir: Path | None = None) -> dict[str, str]:
    env = dict(os.environ, PRORSA_NATIVE="1" if native_on else "0")
    if build_dir is not None:
        env["PRORSA_NATIVE_DIR"] = str(build_dir)
    return env


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], env=env, cwd=native.ROOT, capture_output=True, text=True, timeout=600
    )


def test_the_compiled_simulator_gives_the_sources_results(build: Path, tmp_path: Path) -> None:
    # The identity gate's configurations of one workload: policies × sync/async, role switches with and without
    # migrations, aborts, GRPO groups, observed runs (lifecycle events hashed), the speed bench at 1/16.
    only = ["--only", "profile:coding"]
    saved = _run(["-m", "prorsa.bench.sim_identity", "save", str(tmp_path), *only], _env(False))
    assert saved.returncode == 0, saved.stderr[-3000:]
    assert saved.stdout.startswith("simulator: source")
    compared = _run(["-m", "prorsa.bench.sim_identity", "compare", str(tmp_path), *only], _env(True, build))
    assert compared.stdout.startswith("simulator: compiled"), compared.stdout[:500] + compared.stderr[-3000:]
    assert compared.returncode == 0, compared.stdout[-3000:] + compared.stderr[-3000:]
    assert "0 differing, 0 missing" in compared.stdout
    assert len(list(tmp_path.glob("*.json"))) >= 10


def test_the_hindsight_oracle_forks_the_compiled_simulator_as_the_source(build: Path, tmp_path: Path) -> None:
    # `Simulation.fork` deep-copies the run: compiled objects must copy (and rebind what they call) like the source.
    args = ["-m", "prorsa", "sim", "--workload", "profile:general", "--profile", "deepseek-v3.2"]
    args += ["--engines", "8", "--policy", "oracle", "--batch-size", "32", "--steps", "1", "--json"]
    source = _run([*args, str(tmp_path / "source.json")], _env(False))
    assert source.returncode == 0, source.stderr[-3000:]
    compiled = _run([*args, str(tmp_path / "compiled.json")], _env(True, build))
    assert compiled.returncode == 0, compiled.stderr[-3000:]
    result = json.loads((tmp_path / "compiled.json").read_text())
    assert result["oracle"]["forks"] > 0
    assert (tmp_path / "compiled.json").read_bytes() == (tmp_path / "source.json").read_bytes()


_PROBE = "import prorsa, prorsa.native as n, prorsa.sim.core as c; print(n.active(), c.__file__)"


def test_a_stale_build_is_not_used(build: Path, tmp_path: Path) -> None:
    stale = tmp_path / "stale"
    shutil.copytree(build, stale)
    manifest = json.loads((stale / native.MANIFEST).read_text())
    manifest["modules"]["services.engine_agent.engine_core"]["source_sha256"] = "0" * 64  # an edited core
    (stale / native.MANIFEST).write_text(json.dumps(manifest))
    assert native.stale_modules(manifest) == ["services.engine_agent.engine_core"]

    probe = _run(["-c", _PROBE], _env(True, stale))
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.startswith("False ") and probe.stdout.strip().endswith("core.py")
    assert "older than its source (services.engine_agent.engine_core)" in probe.stderr

    current = _run(["-c", _PROBE], _env(True, build))
    assert current.stdout.startswith("True ") and ".so" in current.stdout, current.stderr
    switched_off = _run(["-c", _PROBE], _env(False, build))
    assert switched_off.stdout.startswith("False "), switched_off.stderr


def test_the_group_stays_interpreted_when_part_of_it_was_imported_first(build: Path) -> None:
    # A process that imported the engine core before `prorsa` (a service) cannot mix in compiled callers of it.
    probe = _run(["-c", "import services.engine_agent.engine_core; " + _PROBE], _env(True, build))
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.startswith("False ")
