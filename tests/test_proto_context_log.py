"""The context log's pure rules (proto/context_log.py) and the engine's prompt cache (context_cache.py): segments in,
prompts out, and every way a log can fail to give a prompt named."""

from __future__ import annotations

from array import array

import pytest

from proto.context_log import (
    HEADER_PART,
    HEADER_TOKENS,
    ContextLogError,
    Segment,
    SegmentReader,
    ids_array,
    pack,
    part_tokens,
    parts,
    rebuild,
    unpack,
)
from services.engine_agent.context_cache import ContextCache


def seg(turn: int, prefix_turn: int, prefix_len: int, ids: list[int]) -> Segment:
    return Segment(turn, prefix_turn, prefix_len, array("I", ids))


def test_ids_are_little_endian_u32_and_round_trip() -> None:
    ids = ids_array([0, 1, 151_643, 2**32 - 1])
    data = pack(ids)
    assert data[:8] == b"\x00\x00\x00\x00\x01\x00\x00\x00" and len(data) == 16
    assert unpack(data) == ids
    with pytest.raises(ValueError, match="0..4294967295"):
        ids_array([1, -1])
    with pytest.raises(ContextLogError, match="not a whole number of 32-bit ids"):
        unpack(b"\x00" * 6, "t", 3)


def test_a_segment_is_split_under_max_payload_and_reassembled() -> None:
    ids = ids_array(range(1000))
    msgs = parts(4, 77, ids, max_payload=2048)  # (2048 - 1024) / 4 = 256 ids a part
    assert part_tokens(2048) == 256 and len(msgs) == 4
    assert [m.headers[HEADER_PART] for m in msgs] == ["0/4", "1/4", "2/4", "3/4"]
    assert all(m.headers[HEADER_TOKENS] == "1000" and len(m.body) <= 1024 for m in msgs)
    reader = SegmentReader("t")
    for m in msgs:
        reader.add(9, m.headers, m.body)
    assert reader.segments[9] == Segment(9, 4, 77, ids)
    assert len(parts(0, 0, ids_array([]), 1 << 20)) == 1  # an empty segment is still one message


def test_an_incomplete_write_is_ignored_and_the_last_complete_one_wins() -> None:
    first = parts(0, 0, ids_array(range(600)), max_payload=2048)  # 3 parts
    second = parts(0, 0, ids_array([7, 8]), max_payload=2048)
    reader = SegmentReader("t")
    reader.add(0, first[0].headers, first[0].body)  # a writer died after one part ...
    for m in second:  # ... and a retry wrote the whole segment
        reader.add(0, m.headers, m.body)
    reader.add(0, first[2].headers, first[2].body)  # a stray part of the dead write changes nothing
    assert list(reader.segments[0].ids) == [7, 8]


@pytest.mark.parametrize(
    ("headers", "error"),
    [
        ({}, "Prorsa-Part"),
        ({HEADER_PART: "2/2"}, "Prorsa-Part"),
        ({HEADER_PART: "0/1", HEADER_TOKENS: "x"}, "Prorsa-Tokens"),
        ({HEADER_PART: "0/1", HEADER_TOKENS: "3"}, "1 ids in the parts"),
    ],
)
def test_a_message_that_is_not_a_segment_part_is_named(headers: dict[str, str], error: str) -> None:
    with pytest.raises(ContextLogError, match=error):
        SegmentReader("t").add(0, headers, b"\x01\x00\x00\x00")


def test_a_prompt_is_rebuilt_along_its_chain_of_prefixes() -> None:
    # (Rebuilt in place: the arrays held by the segments and by `known` are never changed.)
    segments = {
        0: seg(0, 0, 0, [1, 2, 3]),
        1: seg(1, 0, 3, [4, 5]),  # extends turn 0
        2: seg(2, 1, 4, [9]),  # keeps 4 of turn 1's 5 tokens (a re-tokenised tail)
        3: seg(3, 0, 0, [6]),  # starts over
    }
    assert list(rebuild("t", 1, segments)) == [1, 2, 3, 4, 5]
    assert list(rebuild("t", 2, segments)) == [1, 2, 3, 4, 9]
    assert list(rebuild("t", 3, segments)) == [6]
    # A held prompt ends the walk early: turn 0 is not needed when turn 1 is known.
    assert list(rebuild("t", 2, {2: segments[2]}, known={1: [1, 2, 3, 4, 5]})) == [1, 2, 3, 4, 9]


@pytest.mark.parametrize(
    ("segments", "error"),
    [
        ({2: seg(2, 1, 3, [1])}, "segment of turn 1 is not in the context log"),
        ({1: seg(1, 0, 9, [1]), 0: seg(0, 0, 0, [1, 2])}, "keeps 9 tokens of turn 0, whose prompt has 2"),
        ({1: seg(1, 1, 1, [1])}, "refers to turn 1, not an earlier turn"),
    ],
)
def test_a_prompt_the_log_cannot_give_is_an_error_naming_the_turn(segments: dict, error: str) -> None:
    turn = max(segments)
    with pytest.raises(ContextLogError, match=error) as info:
        rebuild("traj-9", turn, segments)
    assert info.value.traj_id == "traj-9" and info.value.turn == turn


def test_the_cache_holds_one_prompt_per_trajectory_and_evicts_the_least_recent() -> None:
    cache = ContextCache(max_tokens=10)
    cache.put("a", 0, array("I", [1, 2, 3, 4]))
    cache.put("b", 0, array("I", [5, 6, 7, 8]))
    assert cache.get("a", 0, 4) is not None  # "a" is now the most recent
    assert cache.get("a", 1, 1) is None and cache.get("a", 0, 5) is None  # another turn, or too short
    cache.put("c", 0, array("I", [9, 9, 9]))  # 11 tokens: "b" goes
    assert cache.get("b", 0, 1) is None and cache.tokens == 7 and len(cache) == 2
    cache.put("a", 2, array("I", [1, 2, 3, 4, 5]))  # a newer turn replaces the older
    cache.put("a", 1, array("I", [1]))  # a late redelivery of an older turn does not
    assert cache.known("a") == {2: array("I", [1, 2, 3, 4, 5])}
    cache.put("d", 0, array("I", range(11)))  # larger than the whole cache: not held
    assert cache.get("d", 0, 0) is None and cache.tokens <= 10


def test_the_cache_remembers_where_it_last_read_a_trajectorys_log_while_it_holds_its_prompt() -> None:
    cache = ContextCache(max_tokens=8)
    cache.read_log("a", 40)  # nothing held: nothing to start after
    assert cache.log_seq("a") == 0
    cache.put("a", 3, array("I", [1, 2, 3]))
    cache.read_log("a", 40)
    cache.read_log("a", 12)  # an older position never moves it back
    assert cache.log_seq("a") == 40
    cache.put("b", 0, array("I", range(8)))  # "a" is evicted, and its position with it
    assert cache.log_seq("a") == 0
