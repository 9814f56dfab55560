"""Who may publish and subscribe to what on the bus: the one permission table, derived from `proto.Subjects`.

Each role of DESIGN.md principle 7 gets a NATS user with per-subject permissions; the server refuses everything
else (a publish or subscribe outside the table is a "Permissions Violation" and never reaches anyone).

  role         publishes (ns = namespace)                               subscribes
  trainer      ns.lifecycle, ns.work.prefill.{any,engine.*},            ns.reply.>, ns.lifecycle, ns.stats.*,
               ns.policy.version, ns.health (requests), ns.errors,      ns.ack.*, ns.forecast, ns.allocator.plan,
               ns.abort, ns.ctx.> (context log; purges it, and         ns.errors, ns.policy.status.*
               reads it: direct get); reads and writes the policy
               KV bucket
  engine       ns.events.<id>, ns.stats.<id>, ns.ack.<id>,              ns.cmd.<id>, ns.policy.version, ns.health,
               ns.policy.status.<id>,                                   ns.abort
               ns.work.{prefill,decode}.any (handoffs, hand-on),
               ns.reply.> (token streams), ns.errors;
               reads the context log (direct get) and reads and
               watches the policy KV bucket (never writes it)
  tracker      ns.tracker.snapshot, ns.errors;                          ns.health (EVENTS through JetStream)
               its checkpoints: the object store NS_TRACKER (only it)
  forecaster   ns.forecast, ns.errors                                   ns.tracker.snapshot, ns.lifecycle,
                                                                        ns.events.*, ns.health
  allocator    ns.cmd.* (request/reply), ns.allocator.plan, ns.errors   ns.stats.*, ns.ack.*, ns.forecast,
                                                                        ns.tracker.snapshot, ns.lifecycle,
                                                                        ns.events.*, ns.health
  operator     ns.health, ns.policy.version, ns.errors;                 ns.> (observes everything)
               creates and updates the streams; reads and writes the
               policy KV bucket

So only the allocator commands engines, only a trainer or the operator announces weights (and pauses generation), only an engine publishes
engine stats and events (with `engine_id` set, only its own), and only a trainer submits work or lifecycle events.

JetStream. Every API call is a request on `$JS.API.<verb>...`, so each role gets just the verbs it uses on our two
streams: every role may create a stream that is missing (a create of an existing stream with another config is
refused by the server, so this cannot change one), only the operator may update one; engines create and pull from
their consumers on WORK, the tracker from its ephemeral consumer on EVENTS; acks go to `$JS.ACK.<stream>.>`.

Replies. Each user's inbox is `_INBOX.<user>.>` (connect with that `inbox_prefix`; `credentials.BusCredentials`
does), and no user may subscribe to another's: pulled work, publish acks and command replies stay private. Replies
to requests (health, role-switch acks, ErrorReplies) use NATS's `allow_responses`: a service may publish once to
the reply subject of a request it received, and to no other inbox.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from proto import POLICY_KEY_CURRENT, POLICY_KEY_PAUSED, POLICY_KEY_TRANSFER, Subjects, check_token

RoleName = Literal["trainer", "engine", "tracker", "forecaster", "allocator", "operator"]
ROLE_NAMES: tuple[RoleName, ...] = ("trainer", "engine", "tracker", "forecaster", "allocator", "operator")
# The service module each service role runs as (`python -m services.<module>`).
SERVICE_ROLES: dict[str, RoleName] = {
    "engine_agent": "engine",
    "trajectory_tracker": "tracker",
    "forecaster": "forecaster",
    "allocator": "allocator",
}
INBOX_ROOT = "_INBOX"
JS_API = "$JS.API"
# A responder may answer a request it received once, within this long (a role switch drains for up to minutes).
RESPONSE_MAX = 1
RESPONSE_EXPIRES = "10m"


def inbox_prefix(user: str) -> str:
    """The inbox prefix of `user` (`_INBOX.<user>`): the only inboxes it may subscribe to."""
    return f"{INBOX_ROOT}.{check_token(user, 'user name')}"


@dataclass(frozen=True, slots=True)
class Permissions:
    """One user's grants: subjects it may publish and subscribe to (NATS wildcards), and whether it answers
    requests (`allow_responses`)."""

    user: str
    role: RoleName
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    responds: bool = False

    def as_config(self) -> dict[str, Any]:
        """The `permissions` map of a nats-server user entry."""
        out: dict[str, Any] = {
            "publish": {"allow": list(self.publish)},
            "subscribe": {"allow": list(self.subscribe)},
        }
        if self.responds:
            out["allow_responses"] = {"max": RESPONSE_MAX, "expires": RESPONSE_EXPIRES}
        return out


@dataclass(frozen=True, slots=True)
class _Grants:
    publish: list[str] = field(default_factory=list)
    subscribe: list[str] = field(default_factory=list)


def _streams(s: Subjects) -> tuple[str, ...]:
    return (s.work_stream, s.events_stream, s.context_stream, s.replies_stream, _kv_stream(s))


def _kv_stream(s: Subjects) -> str:
    return f"KV_{s.policy_bucket}"


def _policy_read(s: Subjects) -> list[str]:
    """Read the policy bucket's keys (nats.py's `KeyValue.get`: a direct get of the key's last message)."""
    return [f"{JS_API}.DIRECT.GET.{_kv_stream(s)}.>"]


def _policy_watch(s: Subjects) -> list[str]:
    """Watch the policy bucket (nats.py's `KeyValue.watch`: an ordered push consumer, unnamed, delivered to the
    watcher's own inbox, recreated after a gap, its flow control answered on `$JS.FC`)."""
    kv = _kv_stream(s)
    return [
        f"{JS_API}.CONSUMER.CREATE.{kv}",
        f"{JS_API}.CONSUMER.CREATE.{kv}.>",
        f"{JS_API}.CONSUMER.INFO.{kv}.*",
        f"{JS_API}.CONSUMER.DELETE.{kv}.*",
        f"$JS.FC.{kv}.>",
    ]


def _policy_write(s: Subjects) -> list[str]:
    """Write the keys of the policy bucket (a JetStream publish on the key's subject); only these keys."""
    keys = (POLICY_KEY_CURRENT, POLICY_KEY_PAUSED, POLICY_KEY_TRANSFER)
    return [f"$KV.{s.policy_bucket}.{key}" for key in keys]


def _ensure_streams(s: Subjects) -> list[str]:
    """What `bus.ensure_streams` needs: look the streams up, create the missing ones (never update)."""
    return [f"{JS_API}.STREAM.{verb}.{name}" for name in _streams(s) for verb in ("INFO", "CREATE")]


def _pull(stream: str, create: list[str]) -> list[str]:
    """Bind and fetch from pull consumers on `stream`: `create` are the CONSUMER.CREATE subjects allowed (nats.py
    sends `CONSUMER.CREATE.<stream>.<name>[.<filter>]`), then info, next-message requests and acks on any consumer."""
    return [
        *create,
        f"{JS_API}.CONSUMER.INFO.{stream}.*",
        f"{JS_API}.CONSUMER.MSG.NEXT.{stream}.*",
        f"$JS.ACK.{stream}.>",
    ]


def _engine(s: Subjects, engine_id: str) -> _Grants:
    """`engine_id` "*" (any engine: a scaled deployment whose ids are host names) or one engine's id."""
    ns, w = s.namespace, s.work_stream
    own_prefill = f"{ns}.work.prefill.engine.{engine_id}"
    return _Grants(
        publish=[
            f"{ns}.events.{engine_id}",
            f"{ns}.stats.{engine_id}",
            f"{ns}.ack.{engine_id}",
            s.prefill_work_any,
            s.decode_work_any,
            f"{ns}.reply.>",
            f"{ns}.policy.status.{engine_id}",
            # The context log: read a trajectory's prompt segments with direct gets (proto/context_log.py).
            f"{JS_API}.DIRECT.GET.{s.context_stream}",
            # The current policy version and the pause flag: read before pulling, watched after (never written).
            *_policy_read(s),
            *_policy_watch(s),
            *_pull(
                w,
                [
                    # Durable names are free; the filter (what the consumer takes) is not. Only prefill work is
                    # ever addressed to one engine: decode handoffs are pulled from the shared queue by capacity.
                    f"{JS_API}.CONSUMER.CREATE.{w}.*.{s.prefill_work_any}",
                    f"{JS_API}.CONSUMER.CREATE.{w}.*.{s.decode_work_any}",
                    f"{JS_API}.CONSUMER.CREATE.{w}.*.{own_prefill}",
                ],
            ),
        ],
        # stats.*: peers watch each other's stats, to move a dead engine's addressed work (engine_agent/rescue.py)
        subscribe=[f"{ns}.cmd.{engine_id}", s.policy_version, s.all_engine_stats, s.abort],
    )


def _checkpoints(bucket: str) -> list[str]:
    """What nats.py's object store does on the tracker's bucket: look it up or create it, write chunks and the
    metadata roll-up (`$O.<bucket>.>`), purge replaced chunks, read the metadata (`STREAM.MSG.GET`), and read the
    chunks through an ordered push consumer (found by subject with `STREAM.NAMES`, created unnamed, its flow
    control answered on `$JS.FC`, deleted after)."""
    obj = f"OBJ_{bucket}"
    return [
        f"$O.{bucket}.>",
        f"{JS_API}.STREAM.INFO.{obj}",
        f"{JS_API}.STREAM.CREATE.{obj}",
        f"{JS_API}.STREAM.PURGE.{obj}",
        f"{JS_API}.STREAM.MSG.GET.{obj}",
        f"{JS_API}.STREAM.NAMES",
        f"{JS_API}.CONSUMER.CREATE.{obj}",
        f"{JS_API}.CONSUMER.DELETE.{obj}.*",
        f"$JS.FC.{obj}.>",
    ]


def _tracker(s: Subjects) -> _Grants:
    e = s.events_stream
    # Its consumer is ephemeral with several filters: `CONSUMER.CREATE.<stream>.<generated name>`.
    return _Grants(
        publish=[
            s.snapshot,
            *_pull(e, [f"{JS_API}.CONSUMER.CREATE.{e}.*"]),
            *_checkpoints(s.tracker_checkpoint_bucket),
        ]
    )


def _forecaster(s: Subjects) -> _Grants:
    return _Grants(publish=[s.forecast], subscribe=[s.snapshot, s.lifecycle, s.all_engine_events])


def _allocator(s: Subjects) -> _Grants:
    return _Grants(
        publish=[f"{s.namespace}.cmd.*", s.plan],
        subscribe=[
            s.all_engine_stats,
            s.all_engine_acks,
            s.forecast,  # demand, and its outlook: the allocator reads no tracker snapshot
            s.lifecycle,
            s.all_engine_events,
        ],
    )


def _trainer(s: Subjects) -> _Grants:
    ns, r = s.namespace, s.replies_stream
    # After a server restart a client reads back the token chunks it missed from REPLIES (prorsa.client.recovery):
    # an ephemeral consumer filtered to the reply subjects, deleted when read.
    replay = [
        *_pull(r, [f"{JS_API}.CONSUMER.CREATE.{r}.*.{ns}.reply.>", f"{JS_API}.CONSUMER.CREATE.{r}"]),
        f"{JS_API}.CONSUMER.DELETE.{r}.*",
    ]
    return _Grants(
        publish=[
            s.lifecycle,
            s.prefill_work_any,
            f"{ns}.work.prefill.engine.*",
            s.policy_version,
            s.health,
            s.abort,
            *replay,
            # The context log: write each turn's prompt segment, purge a trajectory's segments when it finishes,
            # and read it back: a gateway asked for a session it does not hold looks there for one a trainer
            # opened and has not finished (another gateway's, or its own before a restart).
            *s.context_stream_subjects,
            f"{JS_API}.STREAM.PURGE.{s.context_stream}",
            f"{JS_API}.DIRECT.GET.{s.context_stream}",
            # Weight updates and pause/resume: the policy bucket (update_weights reads it, then writes it).
            *_policy_read(s),
            *_policy_write(s),
        ],
        # lifecycle: a trainer's rollout recorder reads the turns submitted (its own and its peers': the events say
        # no more than the trainer already knows of its trajectories).
        subscribe=[
            f"{ns}.reply.>",
            s.lifecycle,
            s.all_engine_stats,
            s.all_engine_acks,
            s.forecast,
            s.plan,
            s.errors,
            s.all_policy_status,  # the weights barrier
        ],
    )


def _operator(s: Subjects) -> _Grants:
    return _Grants(
        publish=[
            s.health,
            s.policy_version,
            *_policy_read(s),
            *_policy_write(s),
            *(f"{JS_API}.STREAM.UPDATE.{name}" for name in _streams(s)),
            # Read-only inspection of the account and of every stream and consumer.
            f"{JS_API}.INFO",
            f"{JS_API}.STREAM.INFO.*",
            f"{JS_API}.STREAM.NAMES",
            f"{JS_API}.CONSUMER.INFO.*.*",
            f"{JS_API}.CONSUMER.NAMES.*",
            f"{JS_API}.CONSUMER.LIST.*",
        ],
        subscribe=[f"{s.namespace}.>"],
    )


_ROLE_GRANTS = {
    "trainer": _trainer,
    "tracker": _tracker,
    "forecaster": _forecaster,
    "allocator": _allocator,
    "operator": _operator,
}


def permissions(
    role: RoleName, subjects: Subjects, user: str | None = None, engine_id: str = "*"
) -> Permissions:
    """The grants of `role` under `subjects`' namespace, for the user named `user` (default: the role's name;
    it fixes the inbox prefix). `engine_id` scopes an engine's own subjects ("*": any engine)."""
    name = user or role
    if role == "engine":
        if engine_id != "*":
            check_token(engine_id, "engine id")
        g = _engine(subjects, engine_id)
    elif role in _ROLE_GRANTS:
        g = _ROLE_GRANTS[role](subjects)
    else:
        raise ValueError(f"unknown bus role {role!r}: expected one of {', '.join(ROLE_NAMES)}")
    common_pub = [subjects.errors, *_ensure_streams(subjects)]
    service = role in SERVICE_ROLES.values()
    return Permissions(
        user=name,
        role=role,
        publish=tuple(_unique([*g.publish, *common_pub])),
        subscribe=tuple(
            _unique([*g.subscribe, *([subjects.health] if service else []), f"{inbox_prefix(name)}.>"])
        ),
        # Services answer health requests (and a command's requester); the trainer and operator only ask.
        responds=service,
    )


def _unique(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))


# --- the server's side --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BusUser:
    """A user entry of the server config: its nkey public key (or a user name and password) and its grants."""

    permissions: Permissions
    nkey: str = ""  # public nkey ("U..."); the seed stays with the user
    password: str = ""  # used only when there is no nkey

    def as_config(self) -> dict[str, Any]:
        entry: dict[str, Any] = (
            {"nkey": self.nkey} if self.nkey else {"user": self.permissions.user, "password": self.password}
        )
        entry["permissions"] = self.permissions.as_config()
        return entry


def authorization_config(users: list[BusUser]) -> str:
    """The `authorization` block for a nats-server config (JSON is valid NATS config syntax): only these users
    may connect, each with its grants; there is no anonymous user. Raises ValueError for a user with no
    credential."""
    for u in users:
        if not u.nkey and not u.password:
            raise ValueError(f"bus user {u.permissions.user!r} has neither an nkey nor a password")
    lines = [f"# {u.permissions.user}: role {u.permissions.role}" for u in users]
    body = json.dumps({"users": [u.as_config() for u in users]}, indent=2)
    return "\n".join([*lines, f"authorization: {body}", ""])


def tls_config(cert_file: str, key_file: str, ca_file: str = "", verify_clients: bool = False) -> str:
    """A `tls` block: the server presents `cert_file`; with `verify_clients`, clients need a cert from `ca_file`."""
    block: dict[str, Any] = {"cert_file": cert_file, "key_file": key_file}
    if ca_file:
        block["ca_file"] = ca_file
    if verify_clients:
        if not ca_file:
            raise ValueError("verifying client certificates needs a CA file")
        block["verify"] = True
    return f"tls: {json.dumps(block, indent=2)}\n"
