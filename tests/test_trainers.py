"""Real trainers on the bus: verl's own agent loops (0.9.1) through `VerlServerManager` and AReaL's own multi-turn
rollout workflow (1.0.4) through `ProrsaWorkflow`, on a live cluster of simulated engines, plus a check of our
adapters' signatures against the installed libraries so that a new release's drift is caught.

verl and AReaL live in their own environment, `.venv-trainers` (`make trainers`, which `make test` runs first):
their dependency sets clash with ours. The trainer side runs there as a subprocess with the repository on its
path and reaches the cluster over NATS, as a trainer would; this side starts the cluster and checks, with the strict
Python codec, what the trainer put on the bus. Skipped, saying so, where that environment has not been built.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest

import proto
from prorsa.system import System, SystemConfig
from proto import ErrorReply, RequestFinished, Subjects, TrajectoryFinished, TrajectoryStarted, TurnSubmitted

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parent.parent
PYTHON = ROOT / ".venv-trainers" / "bin" / "python"
TIME_SCALE = "20"


def _trainer_env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT), PRORSA_TIME_SCALE=TIME_SCALE, VERL_LOGGING_LEVEL="ERROR")


@pytest.fixture(scope="module")
def trainers_python() -> str:
    if not (ROOT / ".venv-trainers" / ".installed").exists():
        pytest.skip("verl/AReaL environment not built: run `make trainers` (`make test` does)")
    return str(PYTHON)


@pytest.fixture(scope="module")
def cluster(trainers_python: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Embedded NATS, tracker, forecaster, allocator (colocated: engines keep their role) and two sim engines."""
    from prorsa.commands.up import wait_healthy

    previous = os.environ.get("PRORSA_TIME_SCALE")
    os.environ["PRORSA_TIME_SCALE"] = TIME_SCALE  # the children inherit it; restored below
    config = SystemConfig(
        # An open server: this test is about the trainer's use of the subjects, not credentials (the Node
        # client and the trainers' environment carry no nkey support yet; tests/test_bus_security*.py cover auth).
        auth=False,
        engines=2,
        extra_service_args={"allocator": ["--policy", "colocated"]},
        log_dir=str(tmp_path_factory.mktemp("trainers-cluster")),
    )
    system = System(config).start()
    try:
        expected = system.expected_services()
        replies = asyncio.run(wait_healthy(system.url, "prorsa", expected, timeout_s=120.0))
        assert sorted(r.service for r in replies if r.status == "ok") == sorted(expected)
        yield system.url
    finally:
        system.stop()
        if previous is None:
            os.environ.pop("PRORSA_TIME_SCALE", None)
        else:
            os.environ["PRORSA_TIME_SCALE"] = previous


class BusLog:
    """The trainer's lifecycle events, the engines' finished requests and any error reply, decoded strictly."""

    def __init__(self) -> None:
        self.lifecycle: list[proto.Message] = []
        self.finished: list[RequestFinished] = []
        self.errors: list[ErrorReply] = []

    async def attach(self, nc: nats.NATS) -> None:
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

    def of(self, source: str, cls: type) -> list:
        return [e for e in self.lifecycle if e.source == source and isinstance(e, cls)]


async def _run_trainer(python: str, module: str, url: str) -> tuple[dict, BusLog]:
    nc = await nats.connect(url)
    log = BusLog()
    try:
        await log.attach(nc)
        proc = await asyncio.create_subprocess_exec(
            python, "-m", module, "--nats", url, cwd=ROOT, env=_trainer_env(),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        stdout, stderr = await asyncio.wait_for(proc.communicate(), 240)
        assert proc.returncode == 0, stdout.decode() + stderr.decode()
        await asyncio.sleep(0.5)  # the last events reach the log
    finally:
        await nc.close()
    return json.loads(stdout.decode().strip().splitlines()[-1]), log


def test_adapters_match_the_installed_verl_and_areal(trainers_python: str) -> None:
    out = subprocess.run(
        [trainers_python, "-m", "tests.trainers.signatures"],
        cwd=ROOT,
        env=_trainer_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 mismatches" in out.stdout


async def test_verl_agent_loops_run_on_prorsa(trainers_python: str, cluster: str) -> None:
    out, log = await _run_trainer(trainers_python, "tests.trainers.verl_agent_loop", cluster)
    single, tool = out["single"], out["tool"]
    # SingleTurnAgentLoop: one prompt, one generation of the adapter's budget, every token with its logprob.
    assert single["response_ids"] == single["response_mask_ones"] == single["logprobs"] == 16
    assert single["num_turns"] == 2
    # ToolAgentLoop: three generations of 24 tokens, two tool calls whose observations verl merged in (mask 0).
    assert tool["tool_calls"] == 2 and tool["tool_rewards"] == [0.5, 0.5] and tool["num_turns"] == 6
    assert tool["response_mask_ones"] == 3 * 24 and tool["response_ids"] > 3 * 24 + 2 * 40
    # One Prorsa trajectory across verl's turns: each turn found the previous context cached on its engine.
    assert tool["engines"][1:] == tool["prefill_engines"][:-1]
    for k in (1, 2):
        assert tool["cached_tokens"][k] == tool["prompt_tokens"][k - 1] + 24, tool

    source = out["client_id"]
    started = {e.traj_id for e in log.of(source, TrajectoryStarted)}
    assert started == {single["request_id"], tool["request_id"]}
    turns = [e.traj_id for e in log.of(source, TurnSubmitted)]
    assert turns.count(single["request_id"]) == 1 and turns.count(tool["request_id"]) == 3
    finished = {e.traj_id: e for e in log.of(source, TrajectoryFinished)}
    assert finished[tool["request_id"]].turns == 3 and finished[tool["request_id"]].reward == 1.0
    assert sum(1 for f in log.finished if f.traj_id in started) == 4
    assert log.errors == []


async def test_areal_workflow_runs_on_prorsa(trainers_python: str, cluster: str) -> None:
    out, log = await _run_trainer(trainers_python, "tests.trainers.areal_workflow", cluster)
    # AReaL's MultiTurnWorkflow: accepted at the third attempt, 20 generated tokens each, reward 0.9^2.
    assert out["keys"] == ["attention_mask", "input_ids", "logprobs", "loss_mask", "rewards", "versions"]
    assert out["loss_mask_ones"] == 3 * 20
    assert out["input_ids"] == out["logprobs"] == out["versions"]
    assert out["reward"] == pytest.approx(0.81)

    source = out["client_id"]
    (started,) = log.of(source, TrajectoryStarted)
    assert started.task == "math"
    assert len(log.of(source, TurnSubmitted)) == 3
    (finished,) = log.of(source, TrajectoryFinished)
    assert finished.traj_id == started.traj_id and finished.turns == 3
    assert finished.reward == pytest.approx(0.81)
    served = sorted((f for f in log.finished if f.traj_id == started.traj_id), key=lambda f: f.turn)
    assert [f.output_tokens for f in served] == [20, 20, 20]
    assert all(f.cached_tokens > 0 for f in served[1:])  # every retry reused the episode's prefix
    assert log.errors == []
