"""Every subject and JetStream stream name of the bus, under a configurable namespace.

Two clusters can share one nats-server by using different namespaces (`PRORSA_NAMESPACE`, default "prorsa").
Who may publish and subscribe to each subject is one table, `services/runtime/auth.py`.

Subjects (ns = namespace):
  ns.lifecycle                     client lifecycle events                    stream EVENTS
  ns.events.<engine_id>            engine phase / progress / finished events  stream EVENTS
  ns.work.prefill.any              prefill work for any prefill-capable engine  stream WORK (work queue)
  ns.work.prefill.engine.<id>      prefill work addressed to one engine (prefix affinity)
  ns.work.decode.any               decode handoffs (never addressed: decode engines pull them by capacity)
  ns.stats.<engine_id>             EngineStats every second (core NATS)
  ns.cmd.<engine_id>               RoleSwitchCommand, request/reply → RoleSwitchAck
  ns.ack.<engine_id>               RoleSwitchAck, also published for observers
  ns.tracker.snapshot              LifecycleSnapshot
  ns.forecast                      DemandForecast
  ns.allocator.plan                AllocationPlan
  ns.policy.version                PolicyVersionUpdate (the running engines only; durable: the KV bucket below)
  ns.policy.status.<engine_id>     WeightsStatus: the weights an engine serves, at every change and every second
  ns.health                        HealthRequest → one HealthReply per live service instance
  ns.errors                        ErrorReply for bad input that had no reply subject
  ns.abort                         AbortRequest: stop a turn on whichever engine holds it (core NATS);
                                   AbortOlderThan (request): every engine aborts the turns of older versions
                                   and answers an AbortOlderThanAck
  ns.reply.<client_id>.<n>         token streams back to a client (chosen by the client, under ns.reply.;
                                   kept for minutes: stream REPLIES)
  ns.ctx.<traj_id>.<turn>          the context log: each turn's prompt segment, written by the client before
                                   the turn, read by engines that lack the prompt (stream CONTEXT;
                                   proto/context_log.py)

KV bucket NS_POLICY (`policy_bucket`): key `current` holds the current PolicyVersionUpdate (version, source,
mode), key `paused` a GenerationControl, key `transfer` a WeightTransferInit (tensors instead of checkpoints). Trainers (and the operator) write it; engines read it before they pull any
work and watch it after, so an engine that starts or restarts serves the current version (and starts paused while
generation is paused).

Object store NS_TRACKER (`tracker_checkpoint_bucket`): the trajectory tracker's own checkpoints, so a restarted
tracker replays only the end of EVENTS. Not a channel between services: only the tracker role may touch it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_TOKEN = re.compile(r"^[A-Za-z0-9_\-:]+$")


def check_token(value: str, what: str = "subject token") -> str:
    """Return `value` if it is a safe single NATS subject token (no dots, spaces or wildcards)."""
    if not _TOKEN.match(value):
        raise ValueError(f"invalid {what} {value!r}: use letters, digits, '_', '-' or ':'")
    return value


# Keys of the policy KV bucket (`Subjects.policy_bucket`).
POLICY_KEY_CURRENT = "current"  # value: a PolicyVersionUpdate
POLICY_KEY_PAUSED = "paused"  # value: a GenerationControl
POLICY_KEY_TRANSFER = "transfer"  # value: a WeightTransferInit


@dataclass(frozen=True, slots=True)
class Subjects:
    namespace: str = "prorsa"

    def __post_init__(self) -> None:
        check_token(self.namespace, "namespace")

    # --- streams -------------------------------------------------------------------------------------------
    @property
    def work_stream(self) -> str:
        return f"{self.namespace.upper().replace('-', '_').replace(':', '_')}_WORK"

    @property
    def events_stream(self) -> str:
        return f"{self.namespace.upper().replace('-', '_').replace(':', '_')}_EVENTS"

    @property
    def replies_stream(self) -> str:
        return f"{self.namespace.upper().replace('-', '_').replace(':', '_')}_REPLIES"

    @property
    def context_stream(self) -> str:
        return f"{self.namespace.upper().replace('-', '_').replace(':', '_')}_CONTEXT"

    @property
    def context_stream_subjects(self) -> list[str]:
        return [f"{self.namespace}.ctx.>"]

    @property
    def tracker_checkpoint_bucket(self) -> str:
        """The object-store bucket of the tracker's checkpoints (its stream is `OBJ_<bucket>`)."""
        return f"{self.namespace.upper().replace('-', '_').replace(':', '_')}_TRACKER"

    @property
    def policy_bucket(self) -> str:
        """The KV bucket of the current policy version and the pause flag (its stream is `KV_<bucket>`)."""
        return f"{self.namespace.upper().replace('-', '_').replace(':', '_')}_POLICY"

    @property
    def replies_stream_subjects(self) -> list[str]:
        return [f"{self.namespace}.reply.>"]

    @property
    def work_stream_subjects(self) -> list[str]:
        return [f"{self.namespace}.work.>"]

    @property
    def events_stream_subjects(self) -> list[str]:
        return [self.lifecycle, f"{self.namespace}.events.*"]

    # --- subjects ------------------------------------------------------------------------------------------
    @property
    def lifecycle(self) -> str:
        return f"{self.namespace}.lifecycle"

    def engine_events(self, engine_id: str) -> str:
        return f"{self.namespace}.events.{check_token(engine_id, 'engine id')}"

    @property
    def all_engine_events(self) -> str:
        return f"{self.namespace}.events.*"

    @property
    def prefill_work_any(self) -> str:
        return f"{self.namespace}.work.prefill.any"

    def prefill_work_for(self, engine_id: str) -> str:
        return f"{self.namespace}.work.prefill.engine.{check_token(engine_id, 'engine id')}"

    @property
    def decode_work_any(self) -> str:
        return f"{self.namespace}.work.decode.any"

    def engine_stats(self, engine_id: str) -> str:
        return f"{self.namespace}.stats.{check_token(engine_id, 'engine id')}"

    @property
    def all_engine_stats(self) -> str:
        return f"{self.namespace}.stats.*"

    def engine_command(self, engine_id: str) -> str:
        return f"{self.namespace}.cmd.{check_token(engine_id, 'engine id')}"

    def engine_ack(self, engine_id: str) -> str:
        return f"{self.namespace}.ack.{check_token(engine_id, 'engine id')}"

    @property
    def all_engine_acks(self) -> str:
        return f"{self.namespace}.ack.*"

    @property
    def snapshot(self) -> str:
        return f"{self.namespace}.tracker.snapshot"

    @property
    def forecast(self) -> str:
        return f"{self.namespace}.forecast"

    @property
    def plan(self) -> str:
        return f"{self.namespace}.allocator.plan"

    @property
    def policy_version(self) -> str:
        return f"{self.namespace}.policy.version"

    def policy_status(self, engine_id: str) -> str:
        return f"{self.namespace}.policy.status.{check_token(engine_id, 'engine id')}"

    @property
    def all_policy_status(self) -> str:
        return f"{self.namespace}.policy.status.*"

    @property
    def health(self) -> str:
        return f"{self.namespace}.health"

    @property
    def abort(self) -> str:
        return f"{self.namespace}.abort"

    @property
    def errors(self) -> str:
        return f"{self.namespace}.errors"

    def context(self, traj_id: str, turn: int) -> str:
        """The context-log subject of one turn's prompt segment."""
        return f"{self.namespace}.ctx.{check_token(traj_id, 'trajectory id')}.{int(turn)}"

    def context_of(self, traj_id: str) -> str:
        """Every context-log subject of one trajectory (a filter: read it whole, purge it when it finishes)."""
        return f"{self.namespace}.ctx.{check_token(traj_id, 'trajectory id')}.>"

    def reply(self, client_id: str) -> str:
        return f"{self.namespace}.reply.{check_token(client_id, 'client id')}"
