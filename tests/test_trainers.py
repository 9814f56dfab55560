"""verl and AReaL under their own orchestration on a Prorsa cluster, across a weight update, with authentication on.

verl (0.9.1): its own `AgentLoopManager` with two `AgentLoopWorker` Ray actors under `ray.init(num_cpus=2)`, the
`ProrsaLLMClient` pickled into each, verl's `single_turn_agent` and `tool_agent` wrapped by `ProrsaAgentLoop`, the
`prorsa` rollout replica found through verl's registry (tests/trainers/verl_rl_steps.py). AReaL (1.0.4): its own
`WorkflowExecutor` over `ProrsaInferenceEngine`, running its `MultiTurnWorkflow` and grouped `RLVRWorkflow`, the
weight update in the order AReaL's trainer calls the engine (tests/trainers/areal_rl_steps.py). Each runs two steps
with a weight update (version 0 → 1) between them, then loops or a workflow that crash after their first turn.

The cluster is `prorsa up` as a user starts it (embedded nats-server with per-role credentials, tracker,
forecaster, allocator, two simulated engines, PRORSA_WEIGHTS_ROOT). The trainers run in their own environment
(`.venv-trainers`, `make trainers`; their dependency sets clash with ours) as subprocesses with `trainer.env`'s
credentials; this side watches the bus with the operator's and checks, with the strict codec, that every trajectory
they started was finished exactly once (the crashed ones as aborted), that every token of step 1 is version 0 and
every token of step 2 version 1, and that no service answered anything with an error. Skipped, saying so, where
the trainers' environment has not been built.

`PRORSA_TRAINERS_PYTHON` names another trainers' interpreter (default: .venv-trainers/bin/python here).
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import shlex
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import proto
from proto import ErrorReply, RequestFinished, Subjects, TrajectoryFinished, TrajectoryStarted, TurnSubmitted
from services.runtime.bus import connect
from services.runtime.credentials import BusCredentials
from tests.up_support import prorsa_up

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parent.parent
TIME_SCALE = "20"


def _trainers_python() -> Path:
    return Path(os.environ.get("PRORSA_TRAINERS_PYTHON") or ROOT / ".venv-trainers" / "bin" / "python")


@pytest.fixture(scope="module")
def trainers_python() -> str:
    python = _trainers_python()
    if not (python.parent.parent / ".installed").exists():
        pytest.skip(
            f"verl/AReaL environment not built at {python.parent.parent}: run `make trainers` (`make test` does)"
        )
    return str(python)


@dataclass(frozen=True)
class Cluster:
    url: str
    secrets: Path
    weights_root: Path

    def env_file(self, user: str) -> dict[str, str]:
        """The variables `source <secrets>/<user>.env` sets."""
        out = {}
        for line in (self.secrets / f"{user}.env").read_text().splitlines():
            key, _, value = line.removeprefix("export ").partition("=")
            out[key] = shlex.split(value)[0]
        return out

    def credentials(self, user: str) -> BusCredentials:
        return BusCredentials.from_env(self.env_file(user))


@pytest.fixture
def cluster(trainers_python: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """`prorsa up` with authentication on (its default), two simulated engines and a weights root; one per test:
    each trainer starts from policy version 0, as on a cluster of its own."""
    base = tmp_path_factory.mktemp("trainers-cluster")
    weights_root = base / "weights"
    weights_root.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRORSA_NATS_")}
    env.update(
        PYTHONPATH=str(ROOT),
        PYTHONUNBUFFERED="1",
        PRORSA_TIME_SCALE=TIME_SCALE,
        PRORSA_WEIGHTS_ROOT=str(weights_root),
    )
    args = ["--engines", "2", "--gateway-port", "-1"]
    args += ["--log-dir", str(base / "logs"), "--secrets-dir", str(base / "secrets")]
    with prorsa_up(args, ready_s=120, env=env, cwd=ROOT) as started:
        url = started.printed.get("nats")
        assert url and started.summary.startswith("up: 5/5 services healthy"), started.output
        yield Cluster(url, base / "secrets", weights_root)


class BusLog:
    """What the trainers' runs put on the bus, decoded strictly, as the operator sees it."""

    def __init__(self) -> None:
        self.lifecycle: list[proto.Message] = []
        self.finished: list[RequestFinished] = []
        self.errors: list[ErrorReply] = []

    async def attach(self, nc) -> None:  # noqa: ANN001
        s = Subjects()

        async def on_lifecycle(msg) -> None:  # noqa: ANN001
            self.lifecycle.append(proto.decode(msg.data, msg.subject, proto.LIFECYCLE_MESSAGES))

        async def on_event(msg) -> None:  # noqa: ANN001
            event = proto.decode(msg.data, msg.subject)
            if isinstance(event, RequestFinished):
                self.finished.append(event)

        async def on_error(msg) -> None:  # noqa: ANN001
            self.errors.append(proto.decode_as(msg.data, ErrorReply, msg.subject))

        await nc.subscribe(s.lifecycle, cb=on_lifecycle)
        await nc.subscribe(s.all_engine_events, cb=on_event)
        await nc.subscribe(s.errors, cb=on_error)
        await nc.flush()

    def started(self, task: str) -> dict[str, TrajectoryStarted]:
        return {e.traj_id: e for e in self.lifecycle if isinstance(e, TrajectoryStarted) and e.task == task}

    def of(self, cls: type, trajectories: dict) -> list:
        return [e for e in self.lifecycle if isinstance(e, cls) and e.traj_id in trajectories]

    async def settled(self, timeout_s: float = 10.0) -> None:
        """Wait until every trajectory seen starting has been seen finishing, or `timeout_s` (then the checks
        below say which is missing): acked events reach this observer a moment after the trainer exits, later on
        a loaded machine than a fixed pause allowed."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            started = {e.traj_id for e in self.lifecycle if isinstance(e, TrajectoryStarted)}
            if started <= {e.traj_id for e in self.lifecycle if isinstance(e, TrajectoryFinished)}:
                return
            await asyncio.sleep(0.1)


async def _run_trainer(python: str, module: str, cluster: Cluster, workdir: Path) -> tuple[dict, BusLog]:
    nc = await connect(cluster.url, "test-observer", credentials=cluster.credentials("operator"))
    log = BusLog()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRORSA_NATS_")}
    env.update(
        cluster.env_file("trainer")
    )  # the trainer's nkey, inbox prefix and URL: what `source` would set
    env.update(
        PYTHONPATH=str(ROOT),
        PRORSA_TIME_SCALE=TIME_SCALE,
        PRORSA_WEIGHTS_ROOT=str(cluster.weights_root),
        VERL_LOGGING_LEVEL="ERROR",
        RAY_DEDUP_LOGS="1",
    )
    try:
        await log.attach(nc)
        proc = await asyncio.create_subprocess_exec(
            python, "-m", module, "--workdir", str(workdir), cwd=ROOT, env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        stdout, stderr = await asyncio.wait_for(proc.communicate(), 240)
        assert proc.returncode == 0, stdout.decode()[-3000:] + stderr.decode()[-6000:]
        await log.settled()  # the last events reach the log
    finally:
        await nc.close()
    return json.loads(stdout.decode().strip().splitlines()[-1]), log


def _check_lifecycle(log: BusLog, task: str, expected: int, aborted: int) -> dict[str, TrajectoryFinished]:
    """Every trajectory of `task` started once and finished exactly once; `aborted` of them as aborted."""
    started = log.started(task)
    assert len(started) == expected, sorted(started)
    finished = collections.Counter(e.traj_id for e in log.of(TrajectoryFinished, started))
    assert finished == dict.fromkeys(started, 1), f"not finished exactly once: {finished}"
    ends = {e.traj_id: e for e in log.of(TrajectoryFinished, started)}
    assert sum(1 for e in ends.values() if e.status == "aborted") == aborted
    assert log.errors == []
    return ends


def test_our_integrations_match_the_installed_verl_and_areal(trainers_python: str) -> None:
    out = subprocess.run(
        [trainers_python, "-m", "tests.trainers.signatures"],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 mismatches" in out.stdout


async def test_verl_agent_loop_manager_across_a_weight_update(
    trainers_python: str, cluster: Cluster, tmp_path: Path
) -> None:
    out, log = await _run_trainer(trainers_python, "tests.trainers.verl_rl_steps", cluster, tmp_path)
    assert out["replica"] == "ProrsaReplica" and out["server_address"] == cluster.url
    # The barrier returned once the live engines (both, unless a loaded machine delayed one's reports past the
    # liveness bound) served version 1, loaded from the checkpoint the replica wrote.
    ack = out["ack"]
    assert ack["version"] == 1 and ack["engines"], ack
    assert set(ack["engines"]) <= {"engine-0", "engine-1"} and min(ack["engines"].values()) >= 1, ack
    assert Path(out["ack"]["source"]) == cluster.weights_root / "global_step_1"
    assert (cluster.weights_root / "global_step_1" / "model.safetensors").is_file()
    for step, version in (("step1", 0), ("step2", 1)):
        rows = out[step]
        assert [r["agent"] for r in rows] == ["prorsa_single_turn_agent", "prorsa_tool_agent"] * 2
        for r in rows:
            # A version on every token the model produced, -1 on every other (tool observations), aligned with
            # the response: 16 tokens per turn, one turn per single-turn loop, three per tool loop.
            assert [v != -1 for v in r["versions"]] == [m == 1 for m in r["mask"]], r
            assert {v for v in r["versions"] if v != -1} == {version}, (step, r)
            assert sum(r["mask"]) == (16 if r["agent"] == "prorsa_single_turn_agent" else 3 * 16)
            assert r["min_global_steps"] == r["max_global_steps"] == version
            assert sum(r["padding_mask"]) == 0
    assert out["failing"]["agent_bug"], out["failing"]  # verl's step fails with the loop's own error

    # 4 trajectories per step and the 2 crashed loops', each finished once; the crashed ones aborted.
    ends = _check_lifecycle(log, "verl-test", expected=10, aborted=2)
    started = log.started("verl-test")
    turns = collections.Counter(e.traj_id for e in log.of(TurnSubmitted, started))
    assert sorted(turns.values()) == [1] * 6 + [3] * 4
    crashed = [t for t, e in ends.items() if e.status == "aborted"]
    assert all(turns[t] == 1 and ends[t].turns == 1 for t in crashed)
    # The engines' own records: every turn served under the version the trainer saw; a tool loop's later turn
    # that its client sent to the engine of the previous turn (prefix affinity: the rule needs that engine's stats
    # fresh, which a loaded machine may delay) found the prefix cached there.
    served = [f for f in log.finished if f.traj_id in started]
    assert len(served) == 6 + 3 * 4
    assert sorted({f.policy_version for f in served}) == [0, 1]
    engine_of = {(f.traj_id, f.turn): f.engine_id for f in served}
    stayed = [f for f in served if f.turn > 0 and engine_of[(f.traj_id, f.turn - 1)] == f.engine_id]
    assert stayed and all(f.cached_tokens > 0 for f in stayed), [
        (f.traj_id, f.turn, f.cached_tokens) for f in served
    ]


async def test_areal_workflow_executor_across_a_weight_update(
    trainers_python: str, cluster: Cluster, tmp_path: Path
) -> None:
    out, log = await _run_trainer(trainers_python, "tests.trainers.areal_rl_steps", cluster, tmp_path)
    assert Path(out["checkpoint"]).is_relative_to(cluster.weights_root)
    for step, version in (("step1", 0), ("step2", 1)):
        rows = out[step]
        # Two multi-turn episodes (accepted at the third attempt: 3 × 12 tokens, reward 0.9²) and two prompts of
        # two RLVR samples each (12 tokens, reward 1): every output token carries the version that produced it,
        # every prompt token AReaL's -1.
        # (AReaL shuffles what it returns.)
        assert sorted(r["outputs"] for r in rows) == [12, 12, 12, 12, 36, 36], rows
        assert all(r["output_versions"] == [version] and r["other_versions"] == [-1] for r in rows), rows
        assert sorted(round(r["reward"], 4) for r in rows) == [0.81, 0.81, 1.0, 1.0, 1.0, 1.0]
    assert out["failing"] is None  # AReaL drops the crashed episode

    # Per step: 2 multi-turn trajectories (3 turns each) and 4 RLVR samples; then the crashed one (aborted).
    ends = _check_lifecycle(log, "areal-test", expected=13, aborted=1)
    started = log.started("areal-test")
    turns = collections.Counter(e.traj_id for e in log.of(TurnSubmitted, started))
    assert sorted(turns.values()) == [1] * 9 + [3] * 4
    rewards = sorted(round(e.reward, 4) for e in ends.values() if e.reward is not None)
    assert rewards == [0.81] * 4 + [1.0] * 8  # one-trajectory episodes report the episode's reward
    served = [f for f in log.finished if f.traj_id in started]
    assert sorted({f.policy_version for f in served}) == [0, 1]
