"""The fault campaign: a rollout on simulated engines while engines, services and the nats-server are killed and
every consumed subject is flooded with hostile payloads. `python -m prorsa.bench.faults` or `prorsa chaos`.

One supervised `System` (embedded nats-server, tracker, forecaster, allocator, N simulated engines) runs a closed-loop
rollout (`fault_load.Load`) the whole time. Scenarios, each tried `tries` times, one after another:

  engine-sigkill / engine-sigterm      an engine dies (round robin); the supervisor restarts it (same id)
  engine-sigkill-no-replacement        an engine dies and stays dead until its work has moved
  <service>-sigkill / <service>-sigterm  tracker, forecaster or allocator dies and is restarted
  nats-sigkill / nats-sigterm          the nats-server dies; the supervisor restarts it on its port and store
  hostile-flood                        malformed payloads (`hostile.malformed`) on every consumed subject
  known-attacks                        the valid-but-forbidden messages of issue 14 (needs bus permissions)

Measured per try. Recovery: engine kill — until every request that was streaming on the victim streams again (or
ended); server restart — from the server being back until every request that was streaming makes progress; service
kill — until the service answers health `ok` again (the tracker: caught up). Crashed: a child that exited without
being the target. Stuck: a service reporting a dead task or not answering after the fault, or a rollout that made
no progress. Lost and duplicated results are attributed to the fault in whose window they happened; at the end the
rollout drains and every trajectory still unfinished counts as lost. Hostile floods report messages sent, the
messages the services counted as bad input, and how many they were expected to count.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import nats
import nats.js.errors

import proto
from prorsa.bench.fault_load import Load, LoadShape
from prorsa.bench.fault_report import build_report, format_table
from prorsa.bench.hostile import flood, flood_subjects, in_stream, odd, receivers
from prorsa.client import RolloutClient
from prorsa.health import gather_health
from prorsa.supervisor import Exit, Supervisor
from prorsa.system import NATS_KEY, System, SystemConfig
from proto import EngineStats, PolicyVersionUpdate, RoleSwitchCommand, Subjects
from services.runtime.clock import time_scale_set

SERVICES = ("trajectory_tracker", "forecaster", "allocator")
SIGNALS = {"sigkill": signal.SIGKILL, "sigterm": signal.SIGTERM}


def scenario_names(services: tuple[str, ...] = SERVICES) -> list[str]:
    names = ["engine-sigkill", "engine-sigterm", "engine-sigkill-no-replacement"]
    names += [f"{s}-{sig}" for s in services for sig in SIGNALS]
    return names + ["nats-sigkill", "nats-sigterm", "hostile-flood", "known-attacks"]


@dataclass
class CampaignConfig:
    engines: int = 3
    speedup: float = 10.0
    load: LoadShape = field(default_factory=LoadShape)
    tries: dict[str, int] = field(default_factory=dict)  # scenario -> tries (missing: `default_tries`)
    default_tries: int = 1
    hostile_messages: int = 1000  # per hostile-flood try
    settle_s: float = 3.0  # wall seconds between tries (after the system is healthy again)
    warmup_s: float = 3.0  # wall seconds of load before the first try (a long one grows the EVENTS stream)
    recovery_timeout_s: float = 60.0
    drain_timeout_s: float = 120.0
    log_dir: str | None = None


@dataclass
class Try:
    scenario: str
    target: str
    t0: float
    recovery_s: float | None = None  # None: not measurable (nothing was streaming) or not applicable
    stuck: list[str] = field(default_factory=list)
    crashed: list[str] = field(default_factory=list)
    note: str = ""
    sent: int = 0  # hostile messages the server took (for stream subjects: acknowledged as stored)
    refused: int = 0  # refused with an error reply: not stored, not to be counted
    unconfirmed: int = 0  # the ack timed out: stored or not, the server did not say
    counted: int = 0
    expected_count: int = 0  # one per receiving service of every message sent
    expected_slack: int = 0  # the unconfirmed messages' receivers: counted may exceed the expectation by this


class Campaign:
    def __init__(self, config: CampaignConfig, say: Callable[[str], None] = print) -> None:
        self.config = config
        self.say = say
        self.system = System(
            SystemConfig(
                # An open server: the campaign measures recovery and what hostile bytes do to a service once
                # they are on a subject it consumes; who may put them there is the permission table's job
                # (tests/test_bus_security*.py), and an anonymous flood would only be refused at the door.
                auth=False,
                engines=config.engines,
                extra_engine_args=["--speedup", str(config.speedup), "--stats-interval-s", "0.5"],
                extra_service_args={"allocator": ["--policy", "colocated", "--engines", str(config.engines)]},
                log_dir=config.log_dir,
            ),
            # A crash loop is 5 exits in `loop_window_s`; the campaign's own kills of one service come every ~6 s,
            # and with the default 60 s window they made it a "crash loop" restarted only after max_backoff_s,
            # which measured the supervisor's policy, not the service's recovery.
            supervisor=Supervisor(
                base_backoff_s=0.3, max_backoff_s=5.0, stable_after_s=5.0, loop_window_s=10.0
            ),
        )
        self.exits: list[tuple[float, Exit]] = []
        self.tries: list[Try] = []
        self.t_start = time.monotonic()
        self._targets: set[str] = set()  # keys killed on purpose (their exits are not crashes)

    # --- plumbing ---------------------------------------------------------------------------------------------
    def log(self, text: str) -> None:
        self.say(f"[{time.monotonic() - self.t_start:7.1f} s] {text}")

    async def _supervise(self) -> None:
        while True:
            for ev in self.system.supervise():
                if isinstance(ev, Exit):
                    self.exits.append((time.monotonic(), ev))
                    if ev.key not in self._targets:
                        self.log(f"UNEXPECTED EXIT {ev.key} rc={ev.returncode}")
            await asyncio.sleep(0.1)

    async def health(self, wait_s: float = 0.6) -> list[proto.HealthReply]:
        try:
            return await gather_health(self.system.url, wait_s=wait_s)
        except (ConnectionError, OSError, nats.errors.Error):
            return []

    async def wait_healthy(self, timeout_s: float = 45.0) -> list[str]:
        """Wait until every service answers ok (tracker caught up); returns the services that did not."""
        want = sorted(self.system.expected_services())
        deadline = time.monotonic() + timeout_s
        bad: list[str] = want
        while time.monotonic() < deadline:
            replies = await self.health()
            ok = sorted(r.service for r in replies if _ok(r))
            bad = [s for s in set(want) if ok.count(s) < want.count(s)]
            if not bad:
                return []
        return sorted(bad)

    # --- the run ----------------------------------------------------------------------------------------------
    async def run(self) -> dict[str, Any]:
        cfg = self.config
        with time_scale_set(cfg.speedup):
            self.system.start()
            supervision = asyncio.create_task(self._supervise())
            loop = asyncio.get_running_loop()
            main = asyncio.current_task()
            assert main is not None
            for sig in (signal.SIGINT, signal.SIGTERM):  # stop the campaign, never orphan its system
                loop.add_signal_handler(sig, main.cancel)
            try:
                return await self._run()
            finally:
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.remove_signal_handler(sig)
                supervision.cancel()
                self.system.stop()

    async def _run(self) -> dict[str, Any]:
        cfg = self.config
        if await self.wait_healthy(90.0):
            raise RuntimeError("the system did not come up healthy")
        self.log(f"up: nats {self.system.url}, {cfg.engines} engines at {cfg.speedup}×")
        self.client = await RolloutClient.connect(self.system.url, retry_after_s=60.0)
        self.load = Load(self.client, cfg.load)
        await self.load.attach()
        await asyncio.sleep(1.0)
        running = asyncio.create_task(self.load.run())
        await asyncio.sleep(cfg.warmup_s)
        for name in scenario_names():
            for i in range(cfg.tries.get(name, cfg.default_tries)):
                await self._one(name, i)
        self.load.stop()
        unfinished = await self.load.drain(cfg.drain_timeout_s)
        for rid, p in list(self.client._pending.items()):  # what the unfinished ones wait for (diagnosis)
            a = p.assembler
            self.log(
                f"unfinished {rid}: attempts {sorted(a.attempts)}, chunks {sorted(a.chunks)}, final {a.final_index}, "
                f"idle {time.monotonic() - p.last_progress_mono:.0f} s, seen {len(self.load.chunks.get(rid, []))}"
            )
        running.cancel()
        stats = {
            "refused": self.client.refused,
            "replayed_chunks": self.client.replayed_chunks,
            "early_retries": self.client.early_retries,
        }
        await self.client.close()
        return build_report(
            self.config, self.tries, self.load, unfinished, stats, time.monotonic() - self.t_start
        )

    async def _one(self, name: str, i: int) -> None:
        if bad := await self.wait_healthy():
            self.log(f"before {name}: not healthy: {bad}")
        await self._wait_streaming()
        if name.startswith("engine-"):
            attempt = await self._engine(name, i)
        elif name.startswith("nats-"):
            attempt = await self._nats(name)
        elif name == "hostile-flood":
            attempt = await self._hostile(name)
        elif name == "known-attacks":
            attempt = await self._attacks(name)
        else:
            attempt = await self._service(name)
        after = time.monotonic()
        attempt.stuck += await self.wait_healthy(30.0)
        replies = await self.health()
        attempt.stuck += [r.instance_id for r in replies if r.details.get("failed_tasks")]
        if not await self._progress(after, 20.0):
            attempt.stuck.append("rollout")
        attempt.crashed = sorted(
            {e.key for t, e in self.exits if t >= attempt.t0 - 0.1 and e.key != attempt.target}
        )
        self.tries.append(attempt)
        rec = "n/a" if attempt.recovery_s is None else f"{attempt.recovery_s:.2f} s"
        self.log(
            f"{name} #{i + 1}: target {attempt.target}, recovery {rec}"
            + (f", stuck {attempt.stuck}" if attempt.stuck else "")
            + (f", crashed {attempt.crashed}" if attempt.crashed else "")
            + (f", {attempt.note}" if attempt.note else "")
        )
        await asyncio.sleep(self.config.settle_s)

    async def _wait_streaming(self, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.load.streaming() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def _progress(self, since: float, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.load.progress_since(since) > 0:
                return True
            await asyncio.sleep(0.1)
        return False

    # --- the faults -------------------------------------------------------------------------------------------
    async def _engine(self, name: str, i: int) -> Try:
        victim = f"engine-{i % self.config.engines}"
        replace = not name.endswith("no-replacement")
        sig = SIGNALS[name.split("-")[1]]
        self._targets.add(victim)
        if not replace:
            self.system.held.add(victim)
        stranded = self.load.streaming(victim)
        t0 = time.monotonic()
        self.system.signal(victim, sig)
        attempt = Try(name, victim, t0)
        if stranded:  # else nothing of its work was in flight: no recovery to measure (n/a, not 0)
            attempt.recovery_s = await self.load.progress_after(
                stranded, t0, self.config.recovery_timeout_s, new_execution=True
            )
        if stranded and attempt.recovery_s is None:
            attempt.stuck.append("stranded work")
        attempt.note = f"{len(stranded)} streaming on it"
        self.system.held.discard(victim)
        return attempt

    async def _nats(self, name: str) -> Try:
        sig = SIGNALS[name.split("-")[1]]
        self._targets.add(NATS_KEY)
        streaming = self.load.streaming()
        t0 = time.monotonic()
        self.system.signal(NATS_KEY, sig)
        attempt = Try(name, NATS_KEY, t0)
        assert self.system.embedded is not None
        while self.system.embedded.running and time.monotonic() < t0 + 15:
            await asyncio.sleep(0.02)
        while not self.system.embedded.running and time.monotonic() < t0 + 30:
            await asyncio.sleep(0.02)  # the supervisor restarts it
        back = time.monotonic()
        if streaming:
            attempt.recovery_s = await self.load.progress_after(
                streaming, back, self.config.recovery_timeout_s
            )
        if streaming and attempt.recovery_s is None:
            attempt.stuck.append("streams")
        attempt.note = f"down {back - t0:.1f} s, {len(streaming)} streaming"
        return attempt

    async def _service(self, name: str) -> Try:
        service, sig_name = name.rsplit("-", 1)
        self._targets.add(service)
        t0 = time.monotonic()
        self.system.signal(service, SIGNALS[sig_name])
        attempt = Try(name, service, t0)
        while time.monotonic() < t0 + 5 and self.system.children[service].poll() is None:
            await asyncio.sleep(0.02)
        while time.monotonic() < t0 + self.config.recovery_timeout_s:
            replies = [r for r in await self.health(0.3) if r.service == service]
            if replies and all(_ok(r) for r in replies) and self.system.children[service].poll() is None:
                fresh = [r for r in replies if r.uptime_s < time.monotonic() - t0 + 1]
                if fresh:
                    attempt.recovery_s = time.monotonic() - t0
                    break
        if attempt.recovery_s is None:
            attempt.stuck.append(service)
        return attempt

    async def _hostile(self, name: str) -> Try:
        subjects = flood_subjects(await self.health(), self.client.subjects)
        attempt = Try(name, f"{len(subjects)} subjects", time.monotonic())
        attacker = await nats.connect(self.system.url)
        js = attacker.jetstream()
        # First the odd values (they decode; a receiver may accept or refuse them, so they are not counted).
        for subject in subjects:
            for _kind, data in odd(subject):
                await (
                    js.publish(subject, data)
                    if in_stream(subject, self.client.subjects)
                    else attacker.publish(subject, data)
                )
        await attacker.flush()
        await asyncio.sleep(2.0)
        # The baseline once the odd values have settled: a receiver may refuse one (and count it) only when it
        # pulls it from a work queue, seconds later on a loaded machine — counted after the baseline, it read as
        # one bad input more than the flood sent (281 of 280, twice in four runs at load average 4).
        before = await self.health()
        baseline = sum(int(r.details.get("bad_input", 0)) for r in before)
        settle_deadline = time.monotonic() + 15.0
        while time.monotonic() < settle_deadline:
            await asyncio.sleep(1.0)
            again = await self.health()
            counted = sum(int(r.details.get("bad_input", 0)) for r in again)
            if counted == baseline and len(again) == len(before):
                break
            before, baseline = again, counted
        sent: list[str] = []
        unconfirmed: list[str] = []
        for k, (subject, _kind, data) in enumerate(flood(subjects, self.config.hostile_messages)):
            if in_stream(subject, self.client.subjects):
                try:
                    await js.publish(subject, data, timeout=5.0)
                except nats.js.errors.APIError as exc:
                    # Refused with an error reply (a full queue): not stored, not to be counted.
                    attempt.refused += 1
                    self.say(f"hostile publish on {subject} refused: {exc!r}")
                    continue
                except (nats.errors.Error, TypeError, KeyError) as exc:
                    # No ack the client could read: a timeout on a loaded machine, or (nats.py raises TypeError on
                    # an error reply it cannot parse, seen right after a server restart) a garbled one. The
                    # server may still have stored it, so its receivers widen the expected count.
                    unconfirmed.append(subject)
                    self.say(f"hostile publish on {subject} unconfirmed: {exc!r}")
                    continue
            else:
                await attacker.publish(subject, data)
            sent.append(subject)
            if k % 200 == 0:
                await attacker.flush()
        await attacker.flush()
        await attacker.close()
        attempt.sent = len(sent)
        attempt.unconfirmed = len(unconfirmed)
        attempt.expected_count = sum(receivers(s, before) for s in sent)
        attempt.expected_slack = sum(receivers(s, before) for s in unconfirmed)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            now = await self.health()
            attempt.counted = sum(int(r.details.get("bad_input", 0)) for r in now) - baseline
            if attempt.counted >= attempt.expected_count and len(now) == len(before):
                break
            await asyncio.sleep(0.5)
        attempt.recovery_s = time.monotonic() - attempt.t0
        attempt.note = f"sent {attempt.sent}, counted {attempt.counted}/{attempt.expected_count}"
        if attempt.refused or attempt.unconfirmed:
            attempt.note += f", {attempt.refused} refused, {attempt.unconfirmed} unconfirmed"
        return attempt

    async def _attacks(self, name: str) -> Try:
        """Issue 14's anonymous attacks. They are valid messages: only bus permissions can refuse them."""
        s: Subjects = self.client.subjects
        victim = "engine-0"
        attempt = Try(name, victim, time.monotonic())
        attacker = await nats.connect(self.system.url)
        now = time.time()
        attacks: list[tuple[str, proto.Message]] = [
            (
                s.engine_command(victim),
                RoleSwitchCommand(engine_id=victim, role="decode", epoch=1000, issued_s=now),
            ),
            (
                s.engine_command(victim),
                RoleSwitchCommand(engine_id=victim, role="decode", epoch=2**64 - 1, issued_s=now),
            ),
            (
                s.policy_version,
                PolicyVersionUpdate(version=2**63, ts_s=now, weights_path="/etc/hostile-weights"),
            ),
            (s.engine_stats("engine-9"), EngineStats(engine_id="engine-9", ts_s=now, role="mixed", epoch=0)),
        ]
        for subject, msg in attacks:
            await attacker.publish(subject, proto.encode(msg))
        await attacker.flush()
        await attacker.close()
        await asyncio.sleep(2.0)
        engines = {
            r.details.get("engine_id"): r.details for r in await self.health() if r.service == "engine_agent"
        }
        d = engines.get(victim, {})
        took = [
            what
            for what, hit in (
                ("role switch", int(d.get("epoch", 0)) >= 1000),
                ("weights", int(d.get("policy_version", 0)) >= 2**63),
            )
            if hit
        ]
        attempt.sent = len(attacks)
        attempt.note = (
            f"took effect: {', '.join(took) or 'none'} (only bus permissions can refuse valid messages)"
        )
        return attempt


def _ok(r: proto.HealthReply) -> bool:
    if r.status != "ok":
        return False
    return bool(r.details.get("caught_up", True))


# --- printing and the command line ---------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engines", type=int, default=3)
    p.add_argument("--speedup", type=float, default=10.0)
    p.add_argument("--concurrency", type=int, default=12, help="trajectories in flight")
    p.add_argument("--tries", type=int, default=1, help="tries of every scenario not set below")
    p.add_argument("--engine-kills", type=int, default=None, help="tries of each engine scenario")
    p.add_argument("--server-restarts", type=int, default=None, help="tries of each nats-server scenario")
    p.add_argument("--service-kills", type=int, default=None, help="tries of each service scenario")
    p.add_argument("--hostile-floods", type=int, default=None, help="tries of hostile-flood")
    p.add_argument("--hostile-messages", type=int, default=1000, help="messages per hostile flood")
    p.add_argument("--only", default="", help="comma-separated scenario names (default: all)")
    p.add_argument("--settle-s", type=float, default=3.0)
    p.add_argument("--warmup-s", type=float, default=3.0, help="wall seconds of load before the first fault")
    p.add_argument("--log-dir", default=None)
    p.add_argument("--json", dest="json_path", default=None)


def config_from_args(args: argparse.Namespace) -> CampaignConfig:
    tries: dict[str, int] = {}
    only = [s for s in args.only.split(",") if s]
    for name in scenario_names():
        n = args.tries
        if name.startswith("engine-") and args.engine_kills is not None:
            n = args.engine_kills
        elif name.startswith("nats-") and args.server_restarts is not None:
            n = args.server_restarts
        elif name.split("-")[0] in SERVICES and args.service_kills is not None:
            n = args.service_kills
        elif name == "hostile-flood" and args.hostile_floods is not None:
            n = args.hostile_floods
        tries[name] = n if not only or name in only else 0
    return CampaignConfig(
        engines=args.engines,
        speedup=args.speedup,
        load=LoadShape(concurrency=args.concurrency),
        tries=tries,
        hostile_messages=args.hostile_messages,
        settle_s=args.settle_s,
        warmup_s=args.warmup_s,
        log_dir=args.log_dir,
    )


def run(args: argparse.Namespace) -> int:
    import logging

    from services.runtime.logging import configure_logging

    configure_logging(level="WARNING")
    # The campaign's own connections see every server restart: nats.py logs each failed reconnect with a
    # traceback, which is the expected weather here, not news.
    logging.getLogger("nats.aio.client").setLevel(logging.CRITICAL)
    report = asyncio.run(Campaign(config_from_args(args), say=lambda s: print(s, flush=True)).run())
    print(format_table(report), flush=True)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(report, f, indent=1, default=str)
        print(f"json: {args.json_path}")
    t = report["totals"]
    bad = (
        t["trajectories_lost"]
        or t["wrong_results"]
        or any(r["crashed"] or r["stuck"] for r in report["rows"])
    )
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m prorsa.bench.faults", description=__doc__.split("\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
