"""The job runner without a bus: de-duplication of redeliveries, acks, and hand-on, over a fake agent and fake
JetStream messages (the simulated backend is real)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from proto import DecodeHandoff, GenerateRequest, Message, RequestFinished, Subjects, TokenChunk
from services.engine_agent.backend import BackendError
from services.engine_agent.backends.sim_backend import SimBackend
from services.engine_agent.context_cache import ContextCache
from services.engine_agent.contexts import ContextResolver
from services.engine_agent.runner import JobRunner
from services.engine_agent.weights_core import WeightsState
from services.runtime.model_profiles import load_profile
from tests.engine_agent_support import expected_ids, request, wait_until


@dataclass
class FakeMsg:
    """A JetStream message as the runner sees it: metadata and the four acknowledgements."""

    stream_seq: int
    delivered: int = 1
    acks: list[str] = field(default_factory=list)

    @property
    def metadata(self) -> Any:
        return SimpleNamespace(sequence=SimpleNamespace(stream=self.stream_seq), num_delivered=self.delivered)

    async def ack(self) -> None:
        self.acks.append("ack")

    async def nak(self, delay: float = 0) -> None:
        self.acks.append("nak")

    async def term(self) -> None:
        self.acks.append("term")

    async def in_progress(self) -> None:
        self.acks.append("wip")


def _no_bus() -> Any:
    raise AssertionError("a request with its whole prompt read the context log")


class _Weights:
    """The agent's WeightsControl as the runner asks it: every turn may run here, no abort bound."""

    state = WeightsState()

    async def admit(self, request: Any) -> str:
        return "run"


class FakeAgent:
    """Just enough of EngineAgent for a JobRunner: records what would be published."""

    def __init__(self, role: str, backend: SimBackend) -> None:
        self.engine_id = "fake-0"
        self.subjects = Subjects()
        self.backend = backend
        # These requests carry their whole prompt: the resolver never reads a context log (no bus here).
        self.contexts = ContextResolver(_no_bus, Subjects(), ContextCache())
        self.clock = backend.clock
        self.policy_version = 3
        backend.policy_version = 3  # what the engine serves (chunks are stamped with the backend's version)
        self.weights = _Weights()
        self.log = SimpleNamespace(
            info=lambda *a, **k: None, warning=lambda *a, **k: None, error=lambda *a, **k: None
        )
        self.metrics = SimpleNamespace(count_error=lambda kind: self.errors.append(kind))
        self.errors: list[str] = []
        self.bugs: dict[str, str] = {}
        self._role = role
        self.published: list[tuple[str, Message]] = []
        self.stored: list[tuple[str, Message, str | None]] = []
        self.events: list[Message] = []
        self.tasks: set[asyncio.Task[Any]] = set()

    @property
    def role(self) -> str:
        return self._role

    async def publish(self, subject: str, msg: Message, reply: str = "") -> None:
        self.published.append((subject, msg))

    async def js_publish(self, subject: str, msg: Message, msg_id: str | None = None) -> None:
        self.stored.append((subject, msg, msg_id))

    async def emit(self, cls: type[Message], **fields: Any) -> None:
        self.events.append(cls(engine_id=self.engine_id, ts_s=0.0, **fields))  # type: ignore[call-arg]

    async def reject(self, msg: Any, kind: str, error: str, field: str = "", request_id: str = "") -> None:
        self.errors.append(kind)
        await msg.term()

    def note_bug(
        self, kind: str, exc: BaseException, /, where: str = "", event: str = "", **fields: Any
    ) -> None:
        self.errors.append(kind)
        self.bugs[kind] = repr(exc)

    def clear_bug(self, kind: str, where: str = "") -> None:
        self.bugs.pop(kind, None)

    def spawn(self, coro: Any, name: str | None = None) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self.tasks.add(task)
        return task

    def chunks(self, rid: str) -> list[TokenChunk]:
        return [m for _, m in self.published if isinstance(m, TokenChunk) and m.request_id == rid]


@pytest.fixture
async def backend() -> Any:
    b = SimBackend(load_profile("qwen3-235b"), "fake-0", speedup=200.0)
    await b.start()
    yield b
    await b.close()


async def test_a_redelivered_finished_request_is_acked_without_work(backend: SimBackend) -> None:
    agent = FakeAgent("mixed", backend)
    runner = JobRunner(agent, chunk_interval_s=0.0)  # type: ignore[arg-type]
    first = FakeMsg(stream_seq=5)
    await runner.admit(request("r", 12), first)
    await wait_until(lambda: not runner.jobs)
    assert first.acks == ["ack"]
    n_chunks = len(agent.chunks("r"))
    assert [t for c in agent.chunks("r") for t in c.token_ids] == expected_ids("r", 12)
    again = FakeMsg(stream_seq=5, delivered=2)
    await runner.admit(request("r", 12), again)
    assert again.acks == ["ack"] and not runner.jobs and len(agent.chunks("r")) == n_chunks
    assert runner.duplicates == 1
    assert [type(e) for e in agent.events].count(RequestFinished) == 1


async def test_redelivery_of_running_work_moves_the_ack_and_a_second_copy_waits(backend: SimBackend) -> None:
    agent = FakeAgent("mixed", backend)
    runner = JobRunner(agent, chunk_interval_s=0.0)  # type: ignore[arg-type]
    first = FakeMsg(stream_seq=7)
    await runner.admit(request("long", 3_000), first)
    redelivered = FakeMsg(stream_seq=7, delivered=2)
    await runner.admit(request("long", 3_000), redelivered)
    retry = FakeMsg(stream_seq=8)  # a client retry published while the first copy runs
    await runner.admit(request("long", 3_000), retry)
    assert retry.acks == ["nak"] and len(runner.jobs) == 1
    await wait_until(lambda: len(agent.chunks("long")) >= 2)
    await runner.stop_job(runner.jobs["long"])  # hand it on: it streamed, so it migrates
    await wait_until(lambda: not runner.jobs)
    assert first.acks == [] and redelivered.acks == ["ack"]  # acked through the newest delivery
    ((subject, moved, msg_id),) = agent.stored
    assert subject == Subjects().prefill_work_any and isinstance(moved, GenerateRequest)
    streamed = [t for c in agent.chunks("long") for t in c.token_ids]
    assert moved.resume_token_ids == streamed and moved.next_chunk_index == len(agent.chunks("long"))
    assert msg_id == f"long#0:m{len(streamed)}"


async def test_prefill_role_acks_after_the_handoff_is_stored(backend: SimBackend) -> None:
    agent = FakeAgent("prefill", backend)
    runner = JobRunner(agent, chunk_interval_s=0.0)  # type: ignore[arg-type]
    msg = FakeMsg(stream_seq=1)
    await runner.admit(request("p", 30), msg)
    await wait_until(lambda: not runner.jobs)
    ((subject, handoff, msg_id),) = agent.stored
    assert subject == Subjects().decode_work_any and isinstance(handoff, DecodeHandoff)
    assert handoff.first_token_id == expected_ids("p", 1)[0] and handoff.prefill_engine == "fake-0"
    assert msg_id == "p#0:h1" and msg.acks == ["ack"] and agent.published == []


async def test_bad_requests_are_terminated_with_an_error_chunk(backend: SimBackend) -> None:
    agent = FakeAgent("mixed", backend)
    runner = JobRunner(agent, chunk_interval_s=0.0)  # type: ignore[arg-type]
    msg = FakeMsg(stream_seq=3)
    await runner.admit(request("huge", 10, prompt_len=200_000), msg)
    assert msg.acks == ["term"] and agent.errors == ["invalid_request"] and not runner.jobs
    (chunk,) = agent.chunks("huge")
    assert chunk.finished and chunk.finish_reason == "error" and "max_model_len" in chunk.error


async def test_engine_errors_are_redelivered_then_failed(backend: SimBackend) -> None:
    agent = FakeAgent("mixed", backend)
    runner = JobRunner(agent, chunk_interval_s=0.0)  # type: ignore[arg-type]

    async def broken(req: GenerateRequest) -> Any:
        raise BackendError("engine fell over")
        yield  # pragma: no cover - makes this an async generator

    backend.generate = broken  # type: ignore[method-assign]
    early, late = FakeMsg(stream_seq=1, delivered=1), FakeMsg(stream_seq=2, delivered=3)
    await runner.admit(request("e1", 10), early)
    await runner.admit(request("e2", 10), late)
    await wait_until(lambda: not runner.jobs)
    assert early.acks == ["nak"]  # transient: redelivered
    assert late.acks == ["term"] and agent.chunks("e2")[-1].finish_reason == "error"
    assert "job" not in agent.errors and not agent.bugs  # the engine's failure, not our bug


async def test_our_bug_in_a_job_is_surfaced_and_the_request_still_answered(backend: SimBackend) -> None:
    agent = FakeAgent("mixed", backend)
    runner = JobRunner(agent, chunk_interval_s=0.0)  # type: ignore[arg-type]
    real_generate = backend.generate

    def buggy(req: GenerateRequest) -> Any:
        if req.request_id.startswith("bug"):
            raise KeyError("our bug")
        return real_generate(req)

    backend.generate = buggy  # type: ignore[method-assign]
    early, late = FakeMsg(stream_seq=1, delivered=1), FakeMsg(stream_seq=2, delivered=3)
    await runner.admit(request("bug1", 10), early)
    await runner.admit(request("bug2", 10), late)
    await wait_until(lambda: not runner.jobs)
    assert early.acks == ["nak"]  # redelivered, then failed for good: never lost
    assert late.acks == ["term"] and agent.chunks("bug2")[-1].finish_reason == "error"
    assert agent.errors.count("job") == 2 and "KeyError" in agent.bugs["job"]
    ok = FakeMsg(stream_seq=3)
    await runner.admit(request("fine", 5), ok)
    await wait_until(lambda: not runner.jobs)
    assert ok.acks == ["ack"] and not agent.bugs  # the next good job clears it from health
