"""Shared pieces of the engine-agent tests: agents on the simulated backend, requests, and a token-stream checker
that knows what every simulated request must produce (its ids are a pure function of the request id)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import nats.errors

import proto
from proto import GenerateRequest, SamplingParams, TokenChunk
from services.engine_agent.agent import AgentConfig, EngineAgent
from services.engine_agent.backends.sim_backend import LiveSeq, SimBackend
from services.engine_agent.backends.sim_tokens import SimTokens
from services.engine_agent.solo_engine import SoloEngine
from services.runtime.clock import Clock
from services.runtime.model_profiles import load_profile
from services.runtime.perf_model import ModelProfile

PROFILE = load_profile("qwen3-235b")


def make_agent(
    url: str, engine_id: str, role: str, speedup: float | None = 20.0, **config: Any
) -> EngineAgent:
    """An agent tuned for tests: short polls and intervals, a short ack_wait."""
    max_model_len = config.pop("max_model_len", 131_072)
    restart_roles = config.pop("restart_roles", ())  # roles of another layout: a switch to them restarts
    defaults: dict[str, Any] = {
        "role": role,
        "ack_wait_s": 5.0,
        "stats_interval_s": 0.2,
        "progress_interval_s": 0.1,
        "chunk_interval_s": 0.01,
        "any_poll_s": 0.1,
    }
    defaults.update(config)
    # A restart costs the profile's engine start (a minute); 4 modelled seconds keep a test's restarts short.
    profile = dataclasses.replace(PROFILE, engine_start_s=4.0) if restart_roles else PROFILE
    backend = SimBackend(
        profile,
        engine_id,
        role=role,
        speedup=speedup,
        max_model_len=max_model_len,
        restart_roles=restart_roles,
    )
    return EngineAgent(url, engine_id=engine_id, backend=backend, config=AgentConfig(**defaults))


def request(
    rid: str, max_tokens: int, prompt_len: int = 2000, reply_to: str = "", **fields: Any
) -> GenerateRequest:
    return GenerateRequest(
        request_id=rid,
        traj_id=f"traj-{rid}",
        turn=0,
        prompt_token_ids=[],
        prompt_len=prompt_len,
        sampling=SamplingParams(max_tokens=max_tokens),
        reply_to=reply_to or f"prorsa.reply.test.{rid}",
        submitted_s=Clock.from_env().now_s(),  # as a client built now would stamp it
        **fields,
    )


def modelled_s(profile: ModelProfile, requests: list[GenerateRequest], role: str = "mixed") -> float:
    """Virtual seconds a fresh engine (the engine core) takes to generate `requests` all submitted at 0."""
    engine = SoloEngine(profile, role)
    for i, r in enumerate(requests):
        engine.submit(LiveSeq(i, r, "generate", 131_072, 1_000))
    while (t := engine.next_event_s()) is not None:
        engine.advance(t)
    return engine.now


def expected_ids(rid: str, n: int) -> list[int]:
    tokens = SimTokens(rid)
    return [tokens.at(i)[0] for i in range(n)]


@dataclass
class Watcher:
    """Collects token chunks (prorsa.reply.test.*) and engine events (prorsa.events.*) from a test connection."""

    chunks: dict[str, list[TokenChunk]] = field(default_factory=lambda: defaultdict(list))
    events: list[proto.Message] = field(default_factory=list)
    finished: dict[str, asyncio.Event] = field(default_factory=lambda: defaultdict(asyncio.Event))

    async def attach(self, nc: Any) -> None:
        async def on_chunk(msg: Any) -> None:
            chunk = proto.decode_as(msg.data, TokenChunk, msg.subject)
            self.chunks[chunk.request_id].append(chunk)
            if chunk.finished:
                self.finished[chunk.request_id].set()

        async def on_event(msg: Any) -> None:
            self.events.append(proto.decode(msg.data, msg.subject))

        await nc.subscribe("prorsa.reply.test.*", cb=on_chunk)
        await nc.subscribe("prorsa.events.*", cb=on_event)

    async def wait_finished(self, rids: list[str], timeout_s: float = 15.0) -> None:
        await asyncio.wait_for(asyncio.gather(*(self.finished[r].wait() for r in rids)), timeout_s)

    def of(self, cls: type[proto.Message]) -> list[Any]:
        return [e for e in self.events if isinstance(e, cls)]

    def tokens_streamed(self, rid: str) -> int:
        return sum(len(c.token_ids) for c in self.chunks[rid])

    def assert_exact_stream(self, rid: str, n_tokens: int) -> list[TokenChunk]:
        """One gap-free stream: indices 0..final exactly once each, exactly the request's n tokens, in order."""
        chunks = sorted(self.chunks[rid], key=lambda c: c.index)
        indices = [c.index for c in chunks]
        assert indices == list(range(len(chunks))), f"{rid}: chunk indices {indices}"
        assert [c.finished for c in chunks].count(True) == 1 and chunks[-1].finished, f"{rid}: finals"
        ids = [t for c in chunks for t in c.token_ids]
        assert ids == expected_ids(rid, n_tokens), f"{rid}: {len(ids)} tokens, expected {n_tokens}"
        assert chunks[-1].output_tokens == n_tokens
        return chunks


async def publish_work(nc: Any, subject: str, msg: proto.Message) -> None:
    await nc.jetstream().publish(subject, proto.encode(msg))


async def wait_until(predicate: Any, timeout_s: float = 10.0, interval_s: float = 0.01) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(interval_s)


async def wait_work_queue_empty(nc: Any, timeout_s: float = 5.0) -> None:
    """Every piece of work was acked (the work-queue stream removes acked messages)."""
    js = nc.jetstream()
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            left = (await js.stream_info(proto.Subjects().work_stream)).state.messages
        except nats.errors.TimeoutError:
            # The JetStream API answers late while vLLM holds both cores: ask again until the deadline.
            left = -1
        if left == 0:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(
                "work left unacked in the WORK stream" if left > 0 else "the WORK stream's info never came"
            )
        await asyncio.sleep(0.02)
