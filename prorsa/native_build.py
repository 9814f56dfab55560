"""Compile the simulator's hot path with mypyc: `python -m prorsa.native_build [--out DIR]`.

Builds the modules of `prorsa.native.MODULES` as one mypyc group into DIR (default `.build/native`, outside the
source tree, so an edited module never runs stale: `prorsa.native` checks each source's hash against the manifest
written here). About a minute on two cores; `make demo` and `make test` run it when a module changed.

Type errors in these modules fail the build: mypyc compiles the annotations (an attribute declared `int` is a C
integer slot), so they must be right. Imports from outside the group are not followed (they stay Python objects).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from prorsa.native import (
    DEFAULT_BUILD_DIR,
    GROUP_NAME,
    MANIFEST,
    MODULES,
    ROOT,
    read_manifest,
    source_path,
    source_sha256,
    stale_modules,
)

# mypy's checks for the group: imports from outside it are not analysed (their values are Python objects to the
# compiled code), and the group's own types must check.
MYPY_FLAGS = ["--follow-imports=skip", "--ignore-missing-imports", "--python-version=3.11"]


def build(out: Path, jobs: int = os.cpu_count() or 1) -> dict:
    """Compile the group into `out` (replaced) and write its manifest. Returns the manifest."""
    from mypyc.build import mypycify  # build-time only (the `dev` extra)
    from setuptools import setup

    started = time.perf_counter()
    paths = [str(source_path(m).relative_to(ROOT)) for m in MODULES]
    # Hashed before compiling: a module edited during the build leaves it stale.
    hashes = {m: source_sha256(m) for m in MODULES}
    with tempfile.TemporaryDirectory(prefix="prorsa-native-") as tmp:
        staging = Path(tmp) / "lib"
        cwd = os.getcwd()
        try:
            os.chdir(ROOT)  # mypyc names modules by their paths relative to the working directory
            extensions = mypycify(
                MYPY_FLAGS + paths, opt_level="3", group_name=GROUP_NAME, target_dir=str(Path(tmp) / "c")
            )
            os.chdir(tmp)  # not the project's pyproject.toml: this is no build of the prorsa package
            setup(
                name=GROUP_NAME,
                ext_modules=extensions,
                script_args=[
                    "--quiet",
                    "build_ext",
                    f"--build-lib={staging}",
                    f"--build-temp={Path(tmp) / 'obj'}",
                    f"--parallel={jobs}",
                ],
            )
        finally:
            os.chdir(cwd)
        suffix = sysconfig.get_config_var("EXT_SUFFIX")
        modules = {}
        for module in MODULES:
            file = Path(*module.split(".")).with_suffix(suffix)
            if not (staging / file).exists():
                raise RuntimeError(f"mypyc built no {file}")
            modules[module] = {"file": str(file), "source_sha256": hashes[module]}
        shared = f"{GROUP_NAME}__mypyc"
        manifest = {
            "ext_suffix": suffix,
            "modules": modules,
            "shared": {"name": shared, "file": shared + suffix},
            "built_s": round(time.perf_counter() - started, 1),
        }
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1))
        if out.exists():
            shutil.rmtree(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(staging, out)
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prorsa.native_build", description=__doc__)
    parser.add_argument("--out", type=Path, default=DEFAULT_BUILD_DIR, help="build directory")
    parser.add_argument("--if-stale", action="store_true", help="build only if the build is missing or stale")
    args = parser.parse_args(argv)
    if args.if_stale:
        manifest = read_manifest(args.out)
        if manifest is not None and not stale_modules(manifest):
            print(f"the compiled simulator in {args.out} is current", flush=True)
            return 0
    print(
        f"compiling the simulator's {len(MODULES)} hot-path modules with mypyc into {args.out} (about a minute)",
        flush=True,
    )
    manifest = build(args.out)
    print(f"built in {manifest['built_s']} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
