"""Do two versions of the simulator give the same results? `python -m prorsa.bench.sim_identity save|compare DIR`.

The gate for speed work on the simulator, whose changes must not move a result: run `save DIR` on the tree before
the change and `compare DIR` on the tree after it (each imports the `prorsa` of the current directory). Every
configuration of a matrix (workloads × policies × sync/async, role switches in place and by restart with
migrations, aborts, GRPO groups, the sim_speed bench at 1/16 scale) is simulated; its `--json` result (sorted keys)
must match byte for byte. A subset
runs a second time with an observer attached (the engines take other paths then), and that run's result and a hash
of every lifecycle event it sees (kind, trajectory, virtual time, fields) must match too. Event counts are printed
beside, not compared: a speed change may remove events. `--only SUBSTRING` runs a part. About 4 CPU minutes in all.
It also checks the compiled simulator against the source: `save` with `PRORSA_NATIVE=0`, `compare` with a
current build (`prorsa.native`; the first line printed says which ran).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path
from typing import Any

from prorsa import native
from prorsa.sim import SimConfig, run_simulation

WORKLOADS = ("swe", "profile:coding", "profile:math", "profile:general")


class EventHasher:
    """A simulator observer that folds every lifecycle event into one sha256."""

    def __init__(self) -> None:
        self._hash = hashlib.sha256()
        self.events = 0

    def on_event(self, kind: str, traj_id: str, now: float, **fields: Any) -> None:
        self.events += 1
        self._hash.update(repr((kind, traj_id, now, sorted(fields.items()))).encode())

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def configurations() -> dict[str, tuple[dict[str, Any], bool]]:
    """name → (SimConfig fields, whether to run it observed too)."""
    out: dict[str, tuple[dict[str, Any], bool]] = {}
    for w in WORKLOADS:
        for p in ("colocated", "static:2:6", "reactive", "prorsa"):
            base: dict[str, Any] = dict(workload=w, engines=8, policy=p, batch_size=24, training_s=20.0)
            if p == "prorsa":  # its forecaster costs CPU every virtual second: cap the virtual time
                base["duration_s"] = 200.0
            observe = w != "profile:general" and p != "prorsa"
            out[f"{w}|{p}|sync"] = (dict(base, mode="sync", steps=2), observe)
            out[f"{w}|{p}|async2"] = (dict(base, mode="async", staleness=2, steps=4), observe)
        for mode in (
            "sync",
            "async2",
        ):  # role switches in place (dynamo at 16 engines), and migrations (restarts with a short drain bound)
            extra = dict(mode="sync", steps=2) if mode == "sync" else dict(mode="async", staleness=2, steps=3)
            cfg = dict(workload=w, engines=16, policy="dynamo", batch_size=64, training_s=20.0, **extra)
            observe = w != "profile:general"
            out[f"{w}|dynamo16|{mode}"] = (cfg, observe)
            restarts = dict(drain_bound_s=0.2, restart_roles=("prefill", "decode", "mixed"))
            out[f"{w}|dynamo16|{mode}|drain0.2"] = (dict(cfg, **restarts), observe)
    for w in ("swe", "profile:coding"):  # aborts: staleness 0
        for p in ("static:2:6", "reactive", "prorsa"):
            cfg = dict(workload=w, engines=8, policy=p, batch_size=24, mode="async", staleness=0, steps=3)
            cfg["training_s"] = 15.0
            if p == "prorsa":
                cfg["duration_s"] = 200.0
            out[f"{w}|{p}|async0"] = (cfg, p != "prorsa")
    out["coding|reactive|grpo4"] = (
        dict(workload="profile:coding", engines=8, policy="reactive", batch_size=32, group_size=4, steps=2),
        True,
    )
    out["swe|colocated|grpo4"] = (
        dict(workload="swe", engines=8, policy="colocated", batch_size=32, group_size=4),
        True,
    )
    out["math|prorsa|grpo8"] = (
        dict(workload="profile:math", engines=8, policy="prorsa", batch_size=32, group_size=8, steps=2)
        | dict(duration_s=200.0),
        False,
    )
    for w in ("profile:coding", "swe"):  # the sim_speed bench configuration at 1/16 scale
        out[f"bench|{w}"] = (
            dict(workload=w, engines=16, policy="static:4:12", mode="async", staleness=1, duration_s=225.0)
            | dict(batch_size=256, training_s=60.0),
            False,
        )
    return out


def run_one(fields: dict[str, Any], observe: bool) -> tuple[str, int, float]:
    """(results as JSON text, events processed, CPU seconds) of one configuration: its result, and with `observe`
    also the observed run's result and lifecycle-event hash."""
    cpu0 = time.process_time()
    result = run_simulation(SimConfig(**fields))
    data: dict[str, Any] = {"result": result.to_json()}
    if observe:
        hasher = EventHasher()
        observed = run_simulation(SimConfig(**fields, observer=hasher)).to_json()
        data["observed"] = dict(observed, lifecycle_events=[hasher.events, hasher.hexdigest()])
    return json.dumps(data, sort_keys=True), result.sim.events_processed, time.process_time() - cpu0


def differences(old: Any, new: Any, path: str = "") -> list[str]:
    """Where two JSON values differ (one line per differing leaf or list)."""
    if isinstance(old, dict) and isinstance(new, dict):
        lines = []
        for key in sorted(set(old) | set(new)):
            if key not in old or key not in new:
                lines.append(f"{path}/{key}: only in {'new' if key in new else 'old'}")
            else:
                lines += differences(old[key], new[key], f"{path}/{key}")
        return lines
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new) and old != new:
        at = [i for i, (x, y) in enumerate(zip(old, new, strict=True)) if x != y]
        return [f"{path}: {len(at)} items differ, first [{at[0]}] {old[at[0]]!r} -> {new[at[0]]!r}"]
    return [f"{path}: {old!r} -> {new!r}"] if old != new else []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prorsa.bench.sim_identity", description=__doc__)
    parser.add_argument("action", choices=("save", "compare"))
    parser.add_argument("folder", type=Path)
    parser.add_argument("--only", default="", help="run the configurations whose name contains this")
    args = parser.parse_args(argv)
    args.folder.mkdir(parents=True, exist_ok=True)
    import prorsa.sim.core  # noqa: F401  (loaded now, to say which simulator runs)

    print(f"simulator: {'compiled (prorsa.native)' if native.active() else 'source'}", flush=True)
    differing = missing = 0
    events_old = events_new = 0
    for name, (fields, observe) in configurations().items():
        if args.only not in name:
            continue
        path = args.folder / (name.replace("|", "_").replace(":", "-") + ".json")
        text, events, cpu_s = run_one(fields, observe)
        if args.action == "save":
            path.write_text(json.dumps({"events": events, "result": text}))
            print(f"{name:42s} saved    events {events:>9,d}  cpu {cpu_s:6.2f} s", flush=True)
            continue
        if not path.exists():
            missing += 1
            print(f"{name:42s} MISSING  (not in {args.folder})", flush=True)
            continue
        saved = json.loads(path.read_text())
        same = saved["result"] == text
        differing += not same
        events_old, events_new = events_old + saved["events"], events_new + events
        change = events / max(saved["events"], 1) - 1
        print(
            f"{name:42s} {'same' if same else 'DIFFERS'}  events {saved['events']:>9,d} -> {events:>9,d} "
            f"({change:+.1%})  cpu {cpu_s:6.2f} s",
            flush=True,
        )
        if not same:
            for line in differences(json.loads(saved["result"]), json.loads(text)):
                print("    " + line)
    if args.action == "compare":
        print(f"{differing} differing, {missing} missing; events {events_old:,} -> {events_new:,}")
    return 1 if differing or missing else 0


if __name__ == "__main__":
    raise SystemExit(main())
