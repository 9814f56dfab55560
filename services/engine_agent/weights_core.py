"""What weights an engine serves and which it should load next: the pure core of `weights.py`.

Rules (proto/README.md, "Policy versions"):
- The engine serves `served`. An update (from the policy KV bucket's `current` key, or `ns.policy.version`) for a
  newer version becomes the `target`; the shell loads it (draining first in "drain" mode) and reports `loaded` or
  `failed`. An update for a version not above the newest one known is old news, except a new KV revision of a
  version whose load failed: that is the trainer's retry (e.g. with the checkpoint fixed), so it is loaded again.
- An update is refused (answered with an error, counted) when its version jumps too far or its weights path is not
  under the engine's weights root (`weights_guard.py`); the status reports that version as failed, with the reason.
- A turn names the oldest version that may serve it (`min_policy_version`): served ≥ it → run; else, when the
  newest version known is at least as new and not failed → later (the turn goes back to the queue, for an engine
  that serves it or for this one once loaded); else → unavailable (failed at once: no version that new exists).
- `abort_below`: the newest `AbortOlderThan` bound seen; a turn holding tokens older than it is aborted on sight.

Time is a parameter (`now_s`, the agent's scaled clock); nothing here reads a clock or touches the bus.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from proto import GenerateRequest, PolicyVersionUpdate, WeightsStatus
from services.engine_agent.weights_guard import Refusal, check_update

Phase = Literal["starting", "serving", "draining", "loading", "failed"]
Admission = Literal["run", "later", "unavailable"]


@dataclass(frozen=True, slots=True)
class WeightsState:
    served: int = 0  # the version whose weights serve now
    target: PolicyVersionUpdate | None = None  # the newest update known (loading, loaded or failed)
    target_revision: int = 0  # its KV revision (0: it came on the core subject)
    phase: Phase = "starting"
    error: str = ""  # phase "failed": why the target could not be loaded
    paused: bool = False  # the trainer paused generation (GenerationControl)
    load_s: float = 0.0  # the last load's duration, scaled seconds
    abort_below: int = 0  # newest AbortOlderThan bound
    # The newest update refused (bad path, absurd jump) and why: reported as a failure of that version, so the
    # trainer's barrier fails at once; never a target (an absurd version would hide every real one after it).
    refused_version: int = 0
    refused_error: str = ""
    transfer_ready: bool = False  # joined the trainer's weight-transfer group (WeightTransferInit)
    transfer_error: str = ""

    @property
    def newest(self) -> int:
        """The newest version known (served or targeted)."""
        return max(self.served, self.target.version if self.target is not None else 0)

    @property
    def wants_load(self) -> bool:
        """A target newer than what serves, not (yet) failed."""
        return self.target is not None and self.target.version > self.served and self.phase != "failed"


@dataclass(frozen=True, slots=True)
class UpdateDecision:
    kind: Literal["ignore", "refuse", "load"]
    refusal: Refusal | None = None


def on_update(
    state: WeightsState,
    update: PolicyVersionUpdate,
    revision: int,
    max_version_jump: int,
    weights_root: str,
) -> tuple[WeightsState, UpdateDecision]:
    """An announced update (KV revision `revision`, 0 from the core subject)."""
    target = state.target
    retry = (
        state.phase == "failed"
        and target is not None
        and update.version == target.version
        and revision != 0
        and revision != state.target_revision
    )
    if update.version <= state.newest and not retry:
        return state, UpdateDecision("ignore")
    refusal = check_update(update, state.newest, max_version_jump, weights_root)
    if refusal is not None:
        refused = replace(state, refused_version=update.version, refused_error=refusal.error[:500])
        return refused, UpdateDecision("refuse", refusal)
    phase: Phase = "serving" if state.phase == "failed" else state.phase
    return replace(state, target=update, target_revision=revision, phase=phase, error=""), UpdateDecision(
        "load"
    )


def loading(state: WeightsState, draining: bool) -> WeightsState:
    return replace(state, phase="draining" if draining else "loading")


def loaded(state: WeightsState, version: int, load_s: float) -> WeightsState:
    return replace(state, served=max(state.served, version), phase="serving", error="", load_s=load_s)


def failed(state: WeightsState, version: int, error: str) -> WeightsState:
    """The load of `version` failed: the old weights serve on; a newer target (arrived meanwhile) is still loaded."""
    if state.target is not None and state.target.version > version:
        return replace(state, phase="serving")
    return replace(state, phase="failed", error=error[:500])


def started(state: WeightsState) -> WeightsState:
    """The engine serves (after its initial load, if any)."""
    return replace(state, phase="serving" if state.phase == "starting" else state.phase)


def admit(state: WeightsState, request: GenerateRequest) -> Admission:
    """Whether a turn may run here now (see the module doc)."""
    bound = request.min_policy_version
    if bound <= state.served:
        return "run"
    target = state.target
    if target is not None and target.version >= bound and state.phase != "failed":
        return "later"
    return "unavailable"


def unavailable_error(state: WeightsState, request: GenerateRequest) -> str:
    return (
        f"turn {request.request_id} needs policy version >= {request.min_policy_version}, but the newest version "
        f"known is {state.newest}" + (f" (its load failed: {state.error})" if state.phase == "failed" else "")
    )


def holds_older(oldest_token_version: int | None, bound: int) -> bool:
    """Whether a turn whose oldest sampled token has version `oldest_token_version` (None: no token yet) is older
    than an abort bound."""
    return oldest_token_version is not None and oldest_token_version < bound


def status(state: WeightsState, engine_id: str, now_s: float) -> WeightsStatus:
    """What the engine reports; a refused update newer than anything it knows is reported as that version failed."""
    refused = state.refused_version > state.newest and state.phase != "starting"
    return WeightsStatus(
        engine_id=engine_id,
        ts_s=now_s,
        policy_version=state.served,
        target_version=state.refused_version if refused else state.newest,
        state="failed" if refused else state.phase,
        paused=state.paused,
        error=state.refused_error if refused else state.error,
        load_s=max(0.0, state.load_s),
        transfer_ready=state.transfer_ready,
        transfer_error=state.transfer_error,
    )
