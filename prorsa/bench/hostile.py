"""Hostile payloads for every subject the services consume: the fault campaign's flood (`prorsa.bench.faults`).

Pure (no I/O). Two families:
- `malformed(subject)`: bytes no correct receiver may accept: deep nesting (the RecursionError that once stopped the
  tracker), NaN and Infinity literals, numbers beyond a float, wrong field types, a wrong schema version, an unknown
  or unexpected message type, a 1 MB payload, empty and binary bytes. Every one must be rejected and counted by
  every service that receives it (`Service.bad_input`).
- `odd(subject)`: messages that decode (the schema allows them) but carry hostile values: integers of 30 digits,
  ids at their length limit, empty lists. They must not crash or stall anyone; whether they are accepted is the
  receiver's business (and the bus permissions', for who may send them at all).
The message expected on a subject comes from `EXPECTED`, a table by subject family.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import msgspec

import proto
from proto import (
    DecodeHandoff,
    DemandForecast,
    EngineStats,
    GenerateRequest,
    HealthReply,
    HealthRequest,
    LifecycleSnapshot,
    PolicyVersionUpdate,
    PrefillDone,
    RoleSwitchAck,
    RoleSwitchCommand,
    Subjects,
    TrajectoryStarted,
)
from proto.examples import EXAMPLES

ONE_MB = 1_000_000  # below nats-server's default max_payload (1 MiB) with room for the subject and headers

# (subject family after the namespace, the message a receiver there expects)
EXPECTED: tuple[tuple[str, type[proto.Message]], ...] = (
    ("lifecycle", TrajectoryStarted),
    ("events.", PrefillDone),
    ("work.prefill.", GenerateRequest),
    ("work.decode.", DecodeHandoff),
    ("stats.", EngineStats),
    ("cmd.", RoleSwitchCommand),
    ("ack.", RoleSwitchAck),
    ("tracker.snapshot", LifecycleSnapshot),
    ("forecast", DemandForecast),
    ("policy.version", PolicyVersionUpdate),
    ("health", HealthRequest),
)


def expected_message(subject: str) -> type[proto.Message]:
    """The message class a receiver of `subject` (`ns.<family>...`) expects; HealthRequest when unknown."""
    rest = subject.split(".", 1)[1] if "." in subject else subject
    for family, cls in EXPECTED:
        if rest.startswith(family):
            return cls
    return HealthRequest


def _body(cls: type[proto.Message]) -> dict:
    return msgspec.json.decode(proto.encode(EXAMPLES[cls]))


def _with(body: dict, key: str, raw: bytes) -> bytes:
    """`body` encoded with field `key` replaced by the raw JSON text `raw` (which may be invalid JSON)."""
    body = dict(body)
    body[key] = "__HOLE__"
    return msgspec.json.encode(body).replace(b'"__HOLE__"', raw)


def _first_key(body: dict, kind: type) -> str | None:
    for k, v in body.items():
        if isinstance(v, kind) and not isinstance(v, bool) and k not in ("type", "schema_version"):
            return k
    return None


def malformed(subject: str) -> list[tuple[str, bytes]]:
    """(name, bytes) of every malformed payload for `subject` (see the module doc)."""
    cls = expected_message(subject)
    body = _body(cls)
    num = _first_key(body, float) or _first_key(body, int) or "ts_s"
    field = next(k for k in body if k not in ("type", "schema_version"))
    wrong = b"[1, 2, 3]" if isinstance(body[field], str) else b'"text"'
    other = HealthReply if cls is not HealthReply else EngineStats
    out = [
        ("deep_object", b'{"a":' * 100_000),
        ("deep_array", b"[" * 300_000),
        ("deep_unknown_field", _with(body, "x", b'{"a":' * 20_000 + b"1" + b"}" * 20_000)),
        ("nan", _with(body, num, b"NaN")),
        ("infinity", _with(body, num, b"-Infinity")),
        ("beyond_float", _with(body, num, b"1e400")),
        ("wrong_type", _with(body, field, wrong)),
        ("wrong_version", _with(body, "schema_version", b"99")),
        ("unknown_type", _with(body, "type", b'"no_such_message"')),
        ("unexpected_type", proto.encode(EXAMPLES[other])),
        ("one_mb", b'"' + b"A" * ONE_MB + b'"'),
        ("empty", b""),
        ("binary", bytes(random.Random(len(subject)).randrange(256) for _ in range(512))),
    ]
    return out


def odd(subject: str) -> list[tuple[str, bytes]]:
    """(name, bytes) of payloads that decode but carry hostile values (see the module doc)."""
    cls = expected_message(subject)
    body = _body(cls)
    out = []
    integer = _first_key(body, int)
    if integer is not None:
        out.append(("huge_integer", _with(body, integer, b"1" + b"0" * 30)))
    ident = next((k for k in ("traj_id", "request_id", "engine_id") if k in body), None)
    if ident is not None:
        out.append(("long_id", _with(body, ident, b'"' + b"x" * 200 + b'"')))
    return out


def flood(subjects: list[str], total: int) -> Iterator[tuple[str, str, bytes]]:
    """`total` malformed messages as (subject, payload name, bytes), cycling through subjects and payloads; the
    1 MB payload only in the first cycle on each subject (a campaign of thousands must not move gigabytes)."""
    catalogue = {s: malformed(s) for s in subjects}
    small = {s: [(n, b) for n, b in c if n != "one_mb"] for s, c in catalogue.items()}
    for i in range(total):
        subject = subjects[i % len(subjects)]
        cycle = i // len(subjects)
        full = catalogue[subject]
        name, data = full[cycle] if cycle < len(full) else small[subject][cycle % len(small[subject])]
        yield subject, name, data


# --- where to flood, and how many counts to expect -----------------------------------------------------------
def matches(pattern: str, subject: str) -> bool:
    p, s = pattern.split("."), subject.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return len(s) > i
        if i >= len(s) or (tok != "*" and tok != s[i]):
            return False
    return len(p) == len(s)


def in_stream(subject: str, s: Subjects) -> bool:
    return subject.startswith(f"{s.namespace}.work.") or any(
        matches(p, subject) for p in s.events_stream_subjects
    )


def flood_subjects(replies: list[proto.HealthReply], s: Subjects) -> list[str]:
    """Every subject some service consumes (wildcards filled with an engine id), plus health."""
    out = {s.health}
    for r in replies:
        for pattern in r.details.get("consumed", []):
            out.add(pattern.replace(".*", ".engine-0").replace(".>", ".x"))
    return sorted(out)


def receivers(subject: str, replies: list[proto.HealthReply]) -> int:
    """How many services count one bad message on `subject`: one for a work queue (a single engine takes it),
    every instance for health, else every instance that consumes a matching subject."""
    if subject.endswith(".health"):
        return len(replies)
    n = sum(1 for r in replies if any(matches(p, subject) for p in r.details.get("consumed", [])))
    return min(n, 1) if ".work." in subject else n
