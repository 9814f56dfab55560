"""Every message of the flow in DESIGN.md, as frozen, tagged msgspec Structs.

Rules of the contract (msgspec's schema-evolution rules, see STYLE.md):
- every message carries `schema_version`; a receiver rejects a version it does not speak (`proto.codec`);
- a new field gets a default and goes last; a field is never retyped or renamed within a version;
- unknown fields are skipped on decode, so an older reader keeps working when a field is added;
- times are seconds: `*_s` fields are either durations or, for `ts_s`, the sender's clock (Unix seconds in the
  live system, virtual seconds in the simulator);
- token counts are non-negative integers (`*_tokens`), enforced on decode;
- epochs and policy versions count one step at a time: at most `MAX_COUNTER` (2^53 - 1, the largest integer every
  JSON reader holds exactly), so 2^63 or 2^64 - 1 is refused on decode; a receiver also bounds how far one may
  jump past the newest it has (the engine agent's `max_epoch_jump`, `max_version_jump`).

The `type` tag of each message is its snake_case class name; a JSON payload is therefore self-describing.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

# 2: the lean wire (a turn's `prompt_token_ids` are the ids after `prefix_len` tokens of an earlier turn's
# prompt, resolved from the context log: `proto/context_log.py`). A version-1 reader would take them for the whole
# context, hence the bump.
SCHEMA_VERSION = 2

NonNegInt = Annotated[int, Meta(ge=0)]
NonNegFloat = Annotated[float, Meta(ge=0.0)]
MAX_COUNTER = 2**53 - 1
Counter = Annotated[int, Meta(ge=0, le=MAX_COUNTER)]  # an epoch or a policy version
# Ids end up as NATS subject tokens (engine ids) or log keys: no dots, spaces or wildcards.
Id = Annotated[str, Meta(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9_\-:]+$")]
Role = Literal["prefill", "decode", "mixed"]
LogprobsMode = Literal["", "raw_logprobs", "processed_logprobs"]
LOGPROBS_MODES: tuple[str, ...] = ("raw_logprobs", "processed_logprobs")
MAX_TOP_LOGPROBS = 20
# One alternative of `top_logprobs`: (token id, logprob), the most likely first.
TopLogprob = tuple[int, float]
ROLES: tuple[str, ...] = ("prefill", "decode", "mixed")


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


class Message(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag=_snake):
    """Base of every message on the bus."""

    schema_version: int = SCHEMA_VERSION


# --------------------------------------------------------------------------------------------------------------
# Trajectory lifecycle, published by the client (SDK or raw) on `Subjects.lifecycle`.
# `source` names the publishing client and `seq` counts its events (1, 2, ...), so a reader can drop duplicates
# and detect reordering per source.


class LifecycleEvent(Message, frozen=True, kw_only=True):
    traj_id: Id
    ts_s: float
    source: str = "client"
    seq: NonNegInt = 0


class TrajectoryStarted(LifecycleEvent, frozen=True, kw_only=True):
    task: str = ""  # e.g. "coding", "math"; the forecaster keeps per-task distributions
    policy_version: Counter = 0  # weights version the trajectory is rolled out with
    group: str = ""  # GRPO-style group id (trajectories sharing a first prompt)
    prompt_tokens: NonNegInt = 0  # first prompt length, when known


class TurnSubmitted(LifecycleEvent, frozen=True, kw_only=True):
    turn: NonNegInt
    request_id: Id
    prompt_tokens: NonNegInt  # whole context sent with this turn
    new_tokens: NonNegInt = 0  # tokens appended since the previous turn (not cacheable anywhere)


class ToolCallStarted(LifecycleEvent, frozen=True, kw_only=True):
    turn: NonNegInt  # the model turn whose output called the tool
    tool: str = ""


class ToolCallFinished(LifecycleEvent, frozen=True, kw_only=True):
    turn: NonNegInt
    tool: str = ""
    observation_tokens: NonNegInt = 0  # tokens the observation adds to the next prompt
    ok: bool = True


class TrajectoryFinished(LifecycleEvent, frozen=True, kw_only=True):
    status: Literal["finished", "aborted"] = "finished"
    reward: float | None = None
    turns: NonNegInt = 0


LIFECYCLE_MESSAGES = (TrajectoryStarted, TurnSubmitted, ToolCallStarted, ToolCallFinished, TrajectoryFinished)


# --------------------------------------------------------------------------------------------------------------
# Generation work, on the JetStream work queues (`Subjects.prefill_work*`, `Subjects.decode_work*`).


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    max_tokens: Annotated[int, Meta(ge=1)]
    temperature: NonNegFloat = 1.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    top_k: int = -1  # -1: disabled
    seed: int | None = None
    logprobs: bool = True  # return the sampled token's logprob (RL needs it)
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    # Added within schema 2 with neutral defaults (an older sender means none of them). Penalties as vLLM/OpenAI
    # define them: presence subtracts once from the logit of a token already in the output, frequency once per
    # occurrence in the output, repetition (HF/vLLM, > 1 discourages) divides the logits of tokens in the prompt or
    # the output. An engine that cannot apply one says so in its docs (the simulated one has no logits).
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    repetition_penalty: Annotated[float, Meta(gt=0.0)] = 1.0
    # Output tokens before a stop token or EOS may end the turn (capped by max_tokens).
    min_tokens: NonNegInt = 0
    # Per output token, the `top_logprobs` most likely tokens and their logprobs (`TokenChunk.top_logprobs`);
    # 0: none. At most 20, vLLM's default `max_logprobs`.
    top_logprobs: Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)] = 0
    # Which logprobs the turn needs: "raw_logprobs" (log-softmax of the model's logits, before temperature,
    # penalties, top-k/top-p) or "processed_logprobs" (of the distribution sampled from, after all of them); "":
    # whichever the engine returns. An engine that returns the other kind fails the turn, naming both.
    logprobs_mode: LogprobsMode = ""


class GenerateRequest(Message, frozen=True, kw_only=True):
    request_id: Id  # unique per attempt-independent turn: `<traj_id>:<turn>`; retries reuse it
    traj_id: Id
    turn: NonNegInt
    # The ids of the prompt after its first `prefix_len` tokens (the whole context when `prefix_len` is 0). Empty:
    # either the simulated backend's count-only turn (then prompt_len counts), or, with `context_logged`, ids too
    # many to send inline, read from the context log instead.
    prompt_token_ids: list[int]
    prompt_len: NonNegInt  # the whole context: prefix_len + len(prompt_token_ids) when ids are sent
    sampling: SamplingParams
    reply_to: str  # subject the engine streams `TokenChunk`s and the final result to
    policy_version: Counter = 0
    task: str = ""
    affinity_engine: str = ""  # engine that served this trajectory's previous turn ("" = none)
    attempt: NonNegInt = 0  # bumped by the client on a retry; engines de-duplicate on request_id
    submitted_s: float = 0.0
    # Simulated backend only: the output length the workload prescribes (real engines ignore it). A trainer leaves
    # both sim_* fields 0; the rollout driver sets them from a recorded workload (prorsa.client.workload_hint).
    sim_output_tokens: NonNegInt = 0
    # Simulated backend only: prompt tokens cacheable on an engine holding this trajectory's prefix.
    sim_cacheable_tokens: NonNegInt = 0
    # Migration (a decode moved off an engine that switched role): tokens already streamed to the client. The new
    # engine prefills prompt + these, generates the rest (max_tokens counts the whole turn) and numbers its chunks
    # from `next_chunk_index`, so the client sees one gap-free stream.
    resume_token_ids: list[int] = []
    next_chunk_index: NonNegInt = 0
    # Lean wire (schema 2; `proto/context_log.py`). The prompt starts with the first `prefix_len` tokens of the prompt
    # of this trajectory's turn `prefix_turn` (an earlier turn whose segment is in the context log); 0: no prefix.
    prefix_turn: NonNegInt = 0
    prefix_len: NonNegInt = 0
    # True: the client wrote this turn's segment (its prefix reference and the ids after it) to the context log at
    # `ns.ctx.<traj_id>.<turn>` before publishing, so a later turn may refer to it and any engine can rebuild it.
    context_logged: bool = False
    # The staleness bound: the oldest policy version whose weights may serve this turn. An engine serving older
    # weights never runs it (it leaves it to an engine that serves a version this new, or to itself once updated);
    # one that knows of no version this new answers it with an error (proto/README.md, "Policy versions").
    min_policy_version: Counter = 0
    # Migration: the oldest policy version among `resume_token_ids` (they were streamed with their versions; an
    # engine needs only the oldest, to tell whether `abort_older_than` covers this turn). 0 without resume tokens.
    resume_min_version: Counter = 0


class DecodeHandoff(Message, frozen=True, kw_only=True):
    """A prefilled request moving to a decode engine; names where its KV lives."""

    request: GenerateRequest
    prefill_engine: Id
    first_token_id: int | None = None  # the token sampled by the prefill step, if any
    first_logprob: float | None = None
    kv_transfer_params: dict[str, Any] | None = None  # vLLM KV-connector params (None on the sim backend)
    kv_tokens: NonNegInt = 0  # tokens of KV to pull (prompt length)
    prefill_new_tokens: NonNegInt = 0
    prefill_cached_tokens: NonNegInt = 0
    handed_off_s: float = 0.0
    # The first token's `sampling.top_logprobs` alternatives (None when not asked for), streamed with it.
    first_top_logprobs: list[TopLogprob] | None = None
    # The policy version whose weights computed this KV and sampled `first_token_id`. Only a decode engine serving
    # exactly that version continues from it; one on newer weights has the turn prefilled again under them, one on
    # older weights gives it back (the rule in proto/README.md, "Policy versions").
    policy_version: Counter = 0


WORK_MESSAGES = (GenerateRequest, DecodeHandoff)


# --------------------------------------------------------------------------------------------------------------
# Engine events, published by each engine agent on `Subjects.engine_events(engine_id)` (retained stream).


class EngineEvent(Message, frozen=True, kw_only=True):
    engine_id: Id
    ts_s: float
    seq: NonNegInt = 0  # per-engine event counter (reordering/duplicate detection)


class PrefillDone(EngineEvent, frozen=True, kw_only=True):
    request_id: Id
    traj_id: Id
    turn: NonNegInt
    new_tokens: NonNegInt  # prompt tokens computed
    cached_tokens: NonNegInt  # prompt tokens served from the prefix cache or a KV transfer
    prefill_s: NonNegFloat = 0.0
    handed_off: bool = False  # True: decode continues on another engine
    # True: its trajectory's previous turn was prefilled on another engine (`GenerateRequest.affinity_engine`, set
    # and not this one) — a turn placement sent away from its cache. What such a turn recomputes against its context
    # is what the allocator's turn model charges a miss (`CapacityModel.miss_share`).
    away: bool = False


class ProgressItem(msgspec.Struct, frozen=True, kw_only=True):
    request_id: Id
    traj_id: Id
    turn: NonNegInt
    output_tokens: NonNegInt  # total generated so far in this turn


class TokenProgress(EngineEvent, frozen=True, kw_only=True):
    """Batched decode progress: one message per engine step or ~100 ms, never one per token."""

    items: list[ProgressItem]


class RequestFinished(EngineEvent, frozen=True, kw_only=True):
    request_id: Id
    traj_id: Id
    turn: NonNegInt
    prompt_tokens: NonNegInt
    cached_tokens: NonNegInt
    output_tokens: NonNegInt
    finish_reason: str = "length"  # "length" | "stop" | "abort"
    queue_s: NonNegFloat = 0.0
    ttft_s: NonNegFloat = 0.0
    e2e_s: NonNegFloat = 0.0
    policy_version: Counter = 0


class RequestFailed(EngineEvent, frozen=True, kw_only=True):
    request_id: Id
    traj_id: Id
    turn: NonNegInt
    error: str
    retriable: bool = False


ENGINE_EVENT_MESSAGES = (PrefillDone, TokenProgress, RequestFinished, RequestFailed)


# --------------------------------------------------------------------------------------------------------------
# Token stream to the client (core NATS, on the request's `reply_to`).


class TokenChunk(Message, frozen=True, kw_only=True):
    request_id: Id
    index: NonNegInt  # chunk counter within the request, from 0; lets a client drop duplicates
    token_ids: list[int]
    logprobs: list[float] | None = None  # one per token when requested
    finished: bool = False
    finish_reason: str = ""
    engine_id: str = ""
    # Filled on the final chunk only:
    prompt_tokens: NonNegInt = 0
    cached_tokens: NonNegInt = 0
    output_tokens: NonNegInt = 0
    ttft_s: NonNegFloat = 0.0
    e2e_s: NonNegFloat = 0.0
    # On every chunk: the policy version whose weights sampled this chunk's tokens (a chunk never spans two
    # versions: an engine that updates in flight splits it). On a final chunk without tokens: the version the
    # engine serves. Senders before issue 31 set it on the final chunk only.
    policy_version: Counter = 0
    prefill_engine: str = ""  # final chunk: the engine that holds this prompt's prefix (next turn's affinity)
    error: str = (
        ""  # final chunk of a failed request: why (finish_reason "error"); the client does not retry it
    )
    # The request's `attempt`: chunk boundaries depend on timing, so a client assembles each attempt on its own
    # and never splices the chunks of two attempts into one stream.
    attempt: NonNegInt = 0
    # One execution of the stream (an engine's job; "" from older senders): chunk 0 of another execution means the
    # stream restarted from scratch (its engine died and the work was redelivered), even on an engine of the same id.
    stream: str = ""
    # The index this execution started at: 0 for a run from scratch, the predecessor's next index for a migrated
    # request. Lets a client follow one chain of executions and ignore a concurrent duplicate run.
    stream_base: NonNegInt = 0
    # Per token of `token_ids`, its request's `sampling.top_logprobs` most likely alternatives as (token id,
    # logprob), the most likely first; None when not asked for.
    top_logprobs: list[list[TopLogprob]] | None = None


class AbortRequest(Message, frozen=True, kw_only=True):
    """Stop a turn (core NATS on `Subjects.abort`, to every engine): the engine holding `request_id` stops it,
    frees its KV, streams the partial output's final chunk with `finish_reason="abort"` and acks its work, so it
    is never redelivered; an engine that pulls it later answers the same way without running it."""

    request_id: Id
    traj_id: Id
    ts_s: float = 0.0
    reason: str = ""


class ErrorReply(Message, frozen=True, kw_only=True):
    """Answer to bad input where a reply subject exists; also published on `Subjects.errors`."""

    kind: (
        str  # "decode" | "schema_version" | "unknown_trajectory" | "stale_command" | "invalid_request" | ...
    )
    error: str
    subject: str = ""
    field: str = ""
    request_id: str = ""
    service: str = ""
    ts_s: float = 0.0


# --------------------------------------------------------------------------------------------------------------
# Engine state and control.


class EngineStats(Message, frozen=True, kw_only=True):
    """Published every second on `Subjects.engine_stats(engine_id)`."""

    engine_id: Id
    ts_s: float
    role: Role
    epoch: Counter  # newest role-switch epoch this engine has applied
    backend: str = "sim"  # "sim" | "vllm"
    running: NonNegInt = 0  # requests in the running batch
    waiting: NonNegInt = 0  # requests pulled but not yet running
    kv_used_tokens: NonNegInt = 0
    kv_capacity_tokens: NonNegInt = 0
    prefill_tokens_per_s: NonNegFloat = 0.0  # computed prompt tokens over the last interval
    decode_tokens_per_s: NonNegFloat = 0.0  # generated tokens over the last interval
    prefix_hit_rate: NonNegFloat = 0.0
    policy_version: Counter = 0
    switching: bool = False
    last_switch_s: NonNegFloat = 0.0  # duration of the last role switch
    in_flight_tokens: NonNegInt = 0  # tokens still to compute for work it holds
    # Prompt tokens its prefix cache holds for later turns (0 = not measured): what a role switch would throw away.
    prefix_cache_tokens: NonNegInt = 0
    # The performance profile it runs as — a built-in name or a profile file written by `prorsa profile` — so the
    # allocator plans with the engines it has ("" = not known).
    profile: str = ""
    # Prompts addressed to it (prefix affinity: `Subjects.prefill_work_for`) that it has not pulled yet. `waiting`
    # counts only what it pulled, at most a prefill budget's worth; the addressed backlog beyond is invisible there
    # and grew to 70+ prompts on two of five prefill engines while three idled (docs/benchmarks.md, "The
    # allocator at high concurrency"). Clients count both before addressing a turn to it.
    addressed_waiting: NonNegInt = 0
    # Roles a switch to which restarts the engine (their layout differs: `--role-engine-arg`), so a planner can price
    # such a switch as an engine start, not an in-place one ([] = every switch is in place).
    restart_roles: list[Role] = []


class RoleSwitchCommand(Message, frozen=True, kw_only=True):
    """Request/reply on `Subjects.engine_command(engine_id)`; the reply is a `RoleSwitchAck`.

    `epoch` increases monotonically per allocator; an engine ignores a command older than the newest it has seen
    and answers a repeated one with the same ack.
    """

    engine_id: Id
    role: Role
    epoch: Annotated[int, Meta(ge=1, le=MAX_COUNTER)]
    issued_s: float
    reason: str = ""
    # Decodes expected to outlast this are migrated by re-prefill: on a restart, and on an in-place switch to
    # prefill (there from the engine's own prefix cache, `switch_rule.hands_on_decodes`).
    drain_timeout_s: NonNegFloat = 30.0


class RoleSwitchAck(Message, frozen=True, kw_only=True):
    engine_id: Id
    epoch: Counter
    role: Role
    ok: bool
    error: str = ""
    switch_s: NonNegFloat = 0.0  # command received → serving the new role
    migrated_requests: NonNegInt = 0  # decodes handed on for re-prefill (see drain_timeout_s)
    drained_requests: NonNegInt = 0  # requests finished in the old role before switching
    ts_s: float = 0.0


class AllocationPlan(Message, frozen=True, kw_only=True):
    epoch: Counter
    policy: str
    roles: dict[str, Role]  # engine_id -> role
    ts_s: float
    reason: str = ""
    forecast_ts_s: float = 0.0


UpdateMode = Literal["drain", "inflight"]


class PolicyVersionUpdate(Message, frozen=True, kw_only=True):
    """New weights: every engine loads them and reports the version it serves (`weights_status`).

    The durable copy is the value of key `current` in the KV bucket `<NS>_POLICY` (`Subjects.policy_bucket`): an
    engine reads it before it pulls any work and watches it after, so one that starts or restarts serves the current
    version. Published on `ns.policy.version` alone it reaches only the engines running now."""

    version: Counter
    ts_s: float
    # Real engines: where the new weights are ("" = reload from the model path); an engine takes only a path
    # under its configured weights root (`--weights-root`).
    weights_path: Annotated[str, Meta(max_length=4096)] = ""
    # "drain" (synchronous RL): stop pulling, let held turns finish (at most `drain_timeout_s`), load, resume.
    # "inflight" (asynchronous RL, AReaL/PipelineRL): load between two engine steps; running turns go on under the
    # new weights, their tokens stamped with the version that sampled each (`TokenChunk.policy_version`).
    mode: UpdateMode = "drain"
    # Drain mode: scaled seconds held turns get to finish; past it the engine updates in flight (versions stamped).
    drain_timeout_s: NonNegFloat = 300.0
    # Tensors instead of a checkpoint (vLLM's weight-transfer API, e.g. NCCL from the trainer's ranks): the
    # backend-specific update info (`names`, `dtype_names`, `shapes` for "nccl"). None: load `weights_path`.
    transfer: dict[str, Any] | None = None


WeightsState = Literal["starting", "serving", "draining", "loading", "failed"]


class WeightsStatus(Message, frozen=True, kw_only=True):
    """What weights an engine serves: published on `ns.policy.status.<engine_id>` at every change and every stats
    interval; the weights barrier (`RolloutClient.update_weights`) waits until every live engine reports the version."""

    engine_id: Id
    ts_s: float
    policy_version: Counter  # the version whose weights serve its turns now
    # The newest version it knows of (the durable current one): it is loading it when higher.
    target_version: Counter = 0
    # "starting": not serving yet (it reads the current version before it pulls work); "failed": see `error`.
    state: WeightsState = "serving"
    paused: bool = False  # generation paused by the trainer (`GenerationControl`)
    # State "failed": why `target_version` could not be loaded (it serves `policy_version` meanwhile).
    error: str = ""
    load_s: NonNegFloat = 0.0  # how long the last load took (scaled seconds)
    # It joined the trainer's weight-transfer group (`WeightTransferInit`): updates may send tensors (`transfer`).
    transfer_ready: bool = False
    transfer_error: str = ""  # why joining that group failed ("" while it has not, or did)


class GenerationControl(Message, frozen=True, kw_only=True):
    """Pause or resume all generation: the value of key `paused` in the KV bucket `<NS>_POLICY`. A paused engine
    pulls no work and freezes its running turns between two steps (nothing is lost: queued work waits in the
    queue, frozen turns resume where they stopped); an engine that starts while paused starts paused."""

    paused: bool
    ts_s: float
    reason: str = ""


class WeightTransferInit(Message, frozen=True, kw_only=True):
    """Join the trainer's weight-transfer group (vLLM's weight-transfer API, e.g. NCCL): the value of key `transfer`
    in the KV bucket `<NS>_POLICY`. Every engine calls its `init_weight_transfer_engine` with `init_info` (its own
    `rank_offset` from `rank_offsets` when given) while the trainer opens its end of the group, and reports
    `transfer_ready`; updates then carry `transfer` (the tensors' update info) instead of a checkpoint path."""

    init_info: dict[
        str, Any
    ]  # the backend's worker init info (NCCL: master_address, master_port, world_size, ...)
    ts_s: float
    rank_offsets: dict[
        str, NonNegInt
    ] = {}  # engine id -> its first rank in the group (NCCL); {}: init_info's own


class AbortOlderThan(Message, frozen=True, kw_only=True):
    """Abort every live turn that holds tokens (or runs on weights) of a policy version below `older_than`: a request
    on `ns.abort`; every engine answers with an `AbortOlderThanAck` naming the turns it aborted, each of which ends
    as an `AbortRequest`ed turn does (its partial output, with per-token versions, and finish_reason "abort"). An
    engine also remembers the bound: a migrated turn holding such tokens that it pulls later is answered the same."""

    older_than: Counter
    ts_s: float = 0.0
    reason: str = ""


class AbortOlderThanAck(Message, frozen=True, kw_only=True):
    engine_id: Id
    older_than: Counter
    request_ids: list[str] = []  # the turns this engine aborted
    ts_s: float = 0.0


# --------------------------------------------------------------------------------------------------------------
# Tracker snapshots and demand forecasts.

TrajectoryState = Literal["queued", "prefill", "decode", "tool_call", "finished", "aborted", "lost"]
TRAJECTORY_STATES: tuple[str, ...] = (
    "queued",
    "prefill",
    "decode",
    "tool_call",
    "finished",
    "aborted",
    "lost",
)


class TrajectoryFeatures(msgspec.Struct, frozen=True, kw_only=True):
    """What a forecaster needs to know about one live trajectory."""

    traj_id: str
    task: str
    state: TrajectoryState
    time_in_state_s: NonNegFloat
    turn: NonNegInt
    context_tokens: NonNegInt
    generated_this_turn: NonNegInt
    tool: str = ""
    policy_version: Counter = 0
    silent: bool = False  # no event for longer than the tracker's silence bound


class LifecycleSnapshot(Message, frozen=True, kw_only=True):
    ts_s: float
    seq: NonNegInt
    counts: dict[str, int]  # state -> live trajectories
    counts_by_task: dict[str, dict[str, int]]  # task -> state -> count
    context_tokens_by_state: dict[str, int]
    trajectories: list[TrajectoryFeatures]
    finished_total: NonNegInt = 0
    aborted_total: NonNegInt = 0
    lost_total: NonNegInt = 0
    silent_total: NonNegInt = 0
    # trajectories the tracker has seen start since it began (restored from its checkpoint): how many are new
    # since the last snapshot, without comparing ids (a step start, for the allocator's step memory)
    started_total: NonNegInt = 0


class Quantiles(msgspec.Struct, frozen=True, kw_only=True):
    q10: float
    q50: float
    q90: float


class HorizonForecast(msgspec.Struct, frozen=True, kw_only=True):
    horizon_s: NonNegFloat
    prefill_tokens: Quantiles  # new prompt tokens to prefill within the next horizon_s
    decode_tokens: Quantiles  # output tokens to generate within the next horizon_s
    decode_concurrency: Quantiles  # mean sequences decoding over the horizon
    kv_tokens: Quantiles  # KV held by decoding sequences at the horizon


# The demand outlook (issue 32, item 3): what the allocator needs of the live trajectories and the turns ahead, so
# that it reads demand from the forecast alone (the tracker's snapshot stays the forecaster's input). Bounds beyond
# which a figure is absurd: more tokens than any model's context (the forecaster's picture refuses more), a state
# lasting longer than a run, more trajectories or turns than a cluster holds.
MAX_OUTLOOK_TOKENS = float(2**24)
MAX_OUTLOOK_S = 7 * 86400.0
MAX_OUTLOOK_COUNT = float(2**31)


class Estimate(msgspec.Struct, frozen=True, kw_only=True):
    """One figure of the outlook: its mean and q10 / q50 / q90 (finite, >= 0, ordered; checked on decode and on
    construction, so an invalid one cannot exist), and the observations it rests on (0: a prior, or nothing seen:
    a reader falls back to its own default)."""

    mean: NonNegFloat
    q10: NonNegFloat
    q50: NonNegFloat
    q90: NonNegFloat
    observed: NonNegInt = 0

    def __post_init__(self) -> None:
        for name in ("mean", "q10", "q50", "q90"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0.0):
                raise ValueError(f"`{name}` is {v}: an estimate is finite and >= 0")
        if not (self.q10 <= self.q50 <= self.q90):
            raise ValueError(f"quantiles out of order: q10 {self.q10}, q50 {self.q50}, q90 {self.q90}")


ZERO_ESTIMATE = Estimate(mean=0.0, q10=0.0, q50=0.0, q90=0.0)


class TaskOutlook(msgspec.Struct, frozen=True, kw_only=True):
    """One task's live trajectories now and its turns over the next `DemandForecast.outlook_horizon_s`."""

    task: Annotated[str, Meta(max_length=200)]  # the trajectories' `TrajectoryStarted.task` ("" when unnamed)
    # Live trajectories now, by phase (the tracker's states).
    queued: NonNegInt = 0
    prefill: NonNegInt = 0
    decode: NonNegInt = 0
    tool_call: NonNegInt = 0
    # Over the horizon: turns its trajectories submit, and trajectories that finish.
    turns: Estimate = ZERO_ESTIMATE
    finished: Estimate = ZERO_ESTIMATE
    # Per turn ahead: new prompt tokens (what the client appends), output tokens, the whole context at the turn's
    # prefill, and the seconds of the tool call before it (the time outside the model between two turns).
    new_tokens: Estimate = ZERO_ESTIMATE
    output_tokens: Estimate = ZERO_ESTIMATE
    context_tokens: Estimate = ZERO_ESTIMATE
    tool_s: Estimate = ZERO_ESTIMATE

    def __post_init__(self) -> None:
        limits = (
            ("turns", MAX_OUTLOOK_COUNT),
            ("finished", MAX_OUTLOOK_COUNT),
            ("new_tokens", MAX_OUTLOOK_TOKENS),
            ("output_tokens", MAX_OUTLOOK_TOKENS),
            ("context_tokens", MAX_OUTLOOK_TOKENS),
            ("tool_s", MAX_OUTLOOK_S),
        )
        for name, limit in limits:
            e = getattr(self, name)
            if max(e.mean, e.q90) > limit:
                raise ValueError(
                    f"task {self.task!r}: `{name}` of {max(e.mean, e.q90)} is absurd (> {limit:g})"
                )
        live = self.queued + self.prefill + self.decode + self.tool_call
        if live > MAX_OUTLOOK_COUNT:
            raise ValueError(
                f"task {self.task!r}: {live} live trajectories is absurd (> {MAX_OUTLOOK_COUNT:g})"
            )

    @property
    def live(self) -> int:
        return self.queued + self.prefill + self.decode + self.tool_call


class DemandForecast(Message, frozen=True, kw_only=True):
    """Demand over the next horizons, with its uncertainty (`horizons`), and the outlook the allocator plans from:
    per task, the live trajectories by phase and the turns ahead (`outlook`, `TaskOutlook`). The allocator reads
    demand from this message alone; the tracker's snapshot is the forecaster's input."""

    ts_s: float
    predictor: str  # "naive" | "ewma" | "ets" | "arima" | "lifecycle" | "ensemble"
    horizons: list[HorizonForecast]
    snapshot_ts_s: float = 0.0
    # Added within schema 2 with neutral defaults (an older forecaster sends no outlook: outlook_horizon_s 0).
    # Per task, the live trajectories and the turns ahead (`TaskOutlook`), tasks in order of first appearance.
    outlook: list[TaskOutlook] = []
    # The horizon the outlook's turns and finishes cover (s); 0: no outlook (then `outlook` is empty). A forecast
    # with an outlook and no live trajectory has this > 0 and an empty `outlook`.
    outlook_horizon_s: NonNegFloat = 0.0
    # Trajectories the tracker had seen start, at the snapshot the outlook was made from (its `started_total`):
    # between two forecasts, how many are new (a step start, for the allocator's step memory).
    started_total: NonNegInt = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.outlook_horizon_s) and self.outlook_horizon_s <= MAX_OUTLOOK_S):
            raise ValueError(f"`outlook_horizon_s` is {self.outlook_horizon_s}")
        if self.outlook and not self.outlook_horizon_s > 0.0:
            raise ValueError("an outlook needs `outlook_horizon_s` > 0")
        tasks = [t.task for t in self.outlook]
        if len(set(tasks)) != len(tasks):
            raise ValueError(f"the outlook lists a task twice: {tasks}")


# --------------------------------------------------------------------------------------------------------------
# Health (request/reply on `Subjects.health`; every live service answers).


class HealthRequest(Message, frozen=True, kw_only=True):
    ts_s: float = 0.0


class HealthReply(Message, frozen=True, kw_only=True):
    service: str  # "engine_agent" | "trajectory_tracker" | "forecaster" | "allocator"
    instance_id: str
    status: Literal["ok", "degraded", "stopping", "unhealthy"]  # unhealthy: a task of the service died
    uptime_s: NonNegFloat
    ts_s: float
    details: dict[str, Any] = {}


ALL_MESSAGES: tuple[type[Message], ...] = (
    *LIFECYCLE_MESSAGES,
    *WORK_MESSAGES,
    *ENGINE_EVENT_MESSAGES,
    TokenChunk,
    AbortRequest,
    ErrorReply,
    EngineStats,
    RoleSwitchCommand,
    RoleSwitchAck,
    AllocationPlan,
    PolicyVersionUpdate,
    WeightsStatus,
    GenerationControl,
    WeightTransferInit,
    AbortOlderThan,
    AbortOlderThanAck,
    LifecycleSnapshot,
    DemandForecast,
    HealthRequest,
    HealthReply,
)

__all__ = [m.__name__ for m in ALL_MESSAGES] + [
    "LIFECYCLE_MESSAGES",
    "LOGPROBS_MODES",
    "LogprobsMode",
    "MAX_TOP_LOGPROBS",
    "TopLogprob",
    "WORK_MESSAGES",
    "ENGINE_EVENT_MESSAGES",
    "ROLES",
    "TRAJECTORY_STATES",
    "MAX_COUNTER",
    "Message",
    "LifecycleEvent",
    "EngineEvent",
    "SamplingParams",
    "ProgressItem",
    "TrajectoryFeatures",
    "Quantiles",
    "HorizonForecast",
    "Estimate",
    "TaskOutlook",
    "ZERO_ESTIMATE",
    "MAX_OUTLOOK_TOKENS",
    "MAX_OUTLOOK_S",
    "MAX_OUTLOOK_COUNT",
    "Role",
    "TrajectoryState",
    "UpdateMode",
    "WeightsState",
]
