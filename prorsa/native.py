"""The simulator's hot path, compiled: load the mypyc build of its modules when it matches their source.

The simulator spends its time in a dozen pure modules (the engine core, placement, the event loop), ~75 µs of
interpreted Python per simulated turn. `python -m prorsa.native_build` compiles exactly those modules, from the
same source, with mypyc (mypy's compiler, which mypy and black ship with): typed attribute access and direct calls
instead of dictionary lookups: `prorsa sim` 1.7–2.7× faster, byte-identical results
(`tests/test_native_build.py`). The source stays the one copy of every rule; the build is a cache of it.

What compiling asks of these modules: annotations that are true (mypyc checks them at run time: a plan's roles
declared `dict` and given a mapping proxy fails), no mix-ins, `__slots__` as one expression, and a class attribute
for two cases — classes that interpreted code subclasses (`CoreSeq`: the live backend's `LiveSeq`), and classes whose
instances `Simulation.fork` deep-copies (the hindsight oracle): `copy.deepcopy` needs an instance made without
`__init__`, which a compiled class gives only with `allow_interpreted_subclasses` (mypyc's `serializable` would be the
natural flag, but in mypy 2.4 a class with it skips `__init__` when Python code constructs it).

`install()` (run by `import prorsa`) puts the build in front of the source only when it is safe:
- every module's source hash equals the one it was compiled from (an edited module makes the whole build stale:
  a warning says so, and the source runs);
- none of the modules is imported yet (they are compiled as one group and call each other natively, so a
  process that imported the engine core before `prorsa` keeps the whole group interpreted);
- `PRORSA_NATIVE` is not `0` (the tests run the source; they patch classes a compiled module does not let them).
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import sysconfig
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

# The simulator's per-turn path and everything it calls per event, as one group (each module's imports of the
# others are native calls). Classes a driver subclasses in interpreted code (`CoreSeq`) say so to mypyc.
MODULES: tuple[str, ...] = (
    "services.runtime.perf_model",
    "services.runtime.step_cost",
    "services.runtime.time_windows",
    "services.runtime.affinity",
    "services.engine_agent.prefix_cache",
    "services.engine_agent.pull_capacity",
    "services.engine_agent.engine_core",
    "services.engine_agent.solo_engine",
    "prorsa.sim.events",
    "prorsa.sim.state",
    "prorsa.sim.engine",
    "prorsa.sim.engine_switching",
    "prorsa.sim.router",
    "prorsa.sim.sim_driver",
    "prorsa.sim.core",
    "prorsa.sim.metrics",  # counters every step and turn updates: typed fields, not a dict (-7 % per turn)
)
GROUP_NAME = "prorsa_native"  # mypyc's shared library: `prorsa_native__mypyc`
ROOT = Path(__file__).resolve().parent.parent  # the source tree (an editable install's checkout)
DEFAULT_BUILD_DIR = ROOT / ".build" / "native"
MANIFEST = "manifest.json"

_installed: _Finder | None = None


def source_path(module: str) -> Path:
    return ROOT.joinpath(*module.split(".")).with_suffix(".py")


def source_sha256(module: str) -> str:
    return hashlib.sha256(source_path(module).read_bytes()).hexdigest()


def build_dir() -> Path:
    return Path(os.environ.get("PRORSA_NATIVE_DIR") or DEFAULT_BUILD_DIR)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds the group's modules (and mypyc's shared library) in the build."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files = files

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        file = self.files.get(fullname)
        if file is None:
            return None
        return importlib.util.spec_from_file_location(fullname, file)


def stale_modules(manifest: dict) -> list[str]:
    """Modules of the group whose source differs from what the build compiled (or that it lacks)."""
    built = manifest.get("modules", {})
    return [m for m in MODULES if m not in built or built[m]["source_sha256"] != source_sha256(m)]


def read_manifest(directory: Path) -> dict | None:
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if manifest.get("ext_suffix") != sysconfig.get_config_var("EXT_SUFFIX"):
        return None  # built for another interpreter
    return manifest


def install() -> bool:
    """Load the group from the build from now on, if the build is current (see the module docstring). Returns
    whether the compiled modules will be used."""
    global _installed
    if _installed is not None:
        return True
    if os.environ.get("PRORSA_NATIVE", "1") == "0":
        return False
    directory = build_dir()
    manifest = read_manifest(directory)
    if manifest is None:
        return False
    stale = stale_modules(manifest)
    if stale:
        warnings.warn(
            f"the compiled simulator in {directory} is older than its source ({', '.join(stale)}): running the "
            "source; `python -m prorsa.native_build` rebuilds it",
            stacklevel=2,
        )
        return False
    if any(m in sys.modules for m in MODULES):
        return False  # part of the group runs interpreted already; the compiled half could not call it
    files = {name: directory / entry["file"] for name, entry in manifest["modules"].items()}
    files[manifest["shared"]["name"]] = directory / manifest["shared"]["file"]
    _installed = _Finder(files)
    sys.meta_path.insert(0, _installed)
    return True


def active() -> bool:
    """Whether the group runs compiled in this process."""
    module = sys.modules.get("prorsa.sim.core")
    return module is not None and not (module.__file__ or "").endswith(".py")
