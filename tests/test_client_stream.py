"""Exactly-once assembly of token streams: duplicates, reordering, restarts and migrations (pure, table-like)."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from prorsa.client.directory import EngineDirectory
from prorsa.client.stream import StreamAssembler
from proto import EngineStats, TokenChunk


def chunk(i: int, toks: list[int], engine: str = "e1", final: bool = False) -> TokenChunk:
    return TokenChunk(
        request_id="r",
        index=i,
        token_ids=toks,
        logprobs=[-0.1] * len(toks),
        finished=final,
        finish_reason="length" if final else "",
        engine_id=engine,
        prefill_engine="p0" if final else "",
    )


def test_in_order_stream() -> None:
    a = StreamAssembler("r")
    assert a.add(chunk(0, [1, 2])) is None
    res = a.add(chunk(1, [3], final=True))
    assert res is not None and res.token_ids == [1, 2, 3] and res.logprobs == [-0.1] * 3
    assert res.prefill_engine == "p0" and res.restarts == 0


def test_top_logprobs_are_assembled_per_token_in_order() -> None:
    def top(t: int) -> list[tuple[int, float]]:
        return [(t, -0.1), (t + 100, -2.5)]

    a = StreamAssembler("r")
    first = msgspec.structs.replace(chunk(1, [3], final=True), top_logprobs=[top(3)])
    assert a.add(first) is None  # out of order
    res = a.add(msgspec.structs.replace(chunk(0, [1, 2]), top_logprobs=[top(1), top(2)]))
    assert res is not None and res.top_logprobs == [top(1), top(2), top(3)]
    # An engine that sent some chunk without them (an older one): none rather than misaligned ones.
    b = StreamAssembler("r")
    b.add(msgspec.structs.replace(chunk(0, [1, 2]), top_logprobs=[top(1), top(2)]))
    res = b.add(chunk(1, [3], final=True))
    assert res is not None and res.top_logprobs is None
    assert StreamAssembler("r").add(chunk(0, [1], final=True)).top_logprobs is None  # type: ignore[union-attr]


def test_duplicates_and_late_chunks_change_nothing() -> None:
    a = StreamAssembler("r")
    a.add(chunk(0, [1]))
    a.add(chunk(0, [1]))
    res = a.add(chunk(1, [2], final=True))
    assert res is not None and res.token_ids == [1, 2]
    assert a.add(chunk(1, [2], final=True)) is None and a.add(chunk(0, [9], engine="e2")) is None
    assert a.duplicates == 3 and a.result is res


def test_restart_on_another_engine_discards_the_partial_stream() -> None:
    a = StreamAssembler("r")
    a.add(chunk(0, [1]))
    a.add(chunk(1, [2]))
    assert a.add(chunk(0, [7], engine="e2")) is None
    res = a.add(chunk(1, [8], engine="e2", final=True))
    assert res is not None and res.token_ids == [7, 8] and res.restarts == 1 and res.engine_id == "e2"


def test_migration_continues_the_stream_on_another_engine() -> None:
    a = StreamAssembler("r")
    a.add(chunk(0, [1, 2], engine="d1"))
    res = a.add(chunk(1, [3, 4], engine="d2", final=True))
    assert res is not None and res.token_ids == [1, 2, 3, 4] and res.restarts == 0


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 8), st.randoms(use_true_random=False), st.integers(0, 6))
def test_any_arrival_order_with_duplicates_gives_the_same_tokens(n: int, rnd, dups: int) -> None:
    chunks = [chunk(i, [i * 10, i * 10 + 1], final=i == n - 1) for i in range(n)]
    arrivals = chunks + [rnd.choice(chunks) for _ in range(dups)]
    rnd.shuffle(arrivals)
    # Index 0 must come first from the streaming engine for a restart to be recognisable; all from one engine here.
    a = StreamAssembler("r")
    results = [r for c in arrivals if (r := a.add(c)) is not None]
    assert len(results) == 1
    assert results[0].token_ids == [t for i in range(n) for t in (i * 10, i * 10 + 1)]


def stats(role: str, ts: float = 1.0, waiting: int = 0, switching: bool = False) -> EngineStats:
    return EngineStats(engine_id="e1", ts_s=ts, role=role, epoch=1, waiting=waiting, switching=switching)


def test_affinity_only_to_fresh_prefill_capable_engines() -> None:
    d = EngineDirectory(stale_after_s=3.0, max_waiting=4)
    assert d.affinity_target("e1", now=0.0) is None
    d.observe(stats("prefill"), now=10.0)
    assert d.affinity_target("e1", now=11.0) == "e1"
    assert d.affinity_target("e1", now=14.0) is None  # stale
    d.observe(stats("decode", ts=2.0), now=14.0)
    assert d.affinity_target("e1", now=14.0) is None
    d.observe(stats("mixed", ts=3.0, waiting=9), now=14.0)
    assert d.affinity_target("e1", now=14.0) is None  # overloaded
    d.observe(stats("prefill", ts=0.5), now=14.0)  # older than what we have: ignored
    assert d.engines["e1"].role == "mixed"


def test_a_group_goes_to_the_least_loaded_engine_that_takes_turns() -> None:
    d = EngineDirectory()
    for engine_id, role, waiting, running in (
        ("a", "mixed", 3, 2),
        ("b", "mixed", 1, 1),
        ("c", "decode", 0, 0),
    ):
        d.observe(
            EngineStats(engine_id=engine_id, ts_s=0.0, role=role, epoch=1, waiting=waiting, running=running),
            10.0,
        )
    assert d.group_target(10.5) == "b"  # "c" is least loaded but takes no prefill
    assert d.group_target(100.0) is None  # nobody fresh: the shared queue
