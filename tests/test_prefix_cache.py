"""The per-engine prefix cache: hits, LRU eviction, shared group prefixes, resize and clear."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.engine_agent.prefix_cache import PrefixCache


def test_hit_is_the_cached_prefix_capped_by_the_context():
    c = PrefixCache(1_000)
    assert c.lookup("a", 500) == 0
    c.insert("a", 300, now=1.0)
    assert c.lookup("a", 500) == 300
    assert c.lookup("a", 200) == 200
    assert c.lookup("b", 500) == 0
    assert c.used_tokens == 300


def test_lru_eviction_drops_the_least_recently_inserted():
    c = PrefixCache(1_000)
    c.insert("a", 400, now=1.0)
    c.insert("b", 400, now=2.0)
    c.insert("a", 450, now=3.0)  # a is used again (and grows)
    c.insert("c", 400, now=4.0)  # over capacity: b goes
    assert "b" not in c and "a" in c and "c" in c
    assert c.used_tokens == 850
    assert c.evicted_tokens == 400


def test_a_prefix_larger_than_the_cache_is_kept_up_to_capacity():
    c = PrefixCache(100)
    c.insert("a", 40, now=0.0)
    c.insert("big", 500, now=1.0)
    assert c.lookup("big", 500) == 100
    assert "a" not in c


def test_group_prefix_is_shared_and_counted_once():
    c = PrefixCache(10_000)
    c.insert("m1", 1_500, now=1.0, group="g", group_tokens=1_000)
    # Another member's first turn hits the shared prompt.
    assert c.lookup("m2", 1_000, group="g", group_tokens=1_000) == 1_000
    assert c.lookup("m2", 1_000, group="other", group_tokens=1_000) == 0
    c.insert("m2", 1_200, now=2.0, group="g", group_tokens=1_000)
    assert c.used_tokens == 1_000 + 500 + 200


def test_a_referenced_group_prefix_is_not_evicted_before_its_members():
    c = PrefixCache(2_000)
    c.insert("m1", 1_200, now=1.0, group="g", group_tokens=1_000)
    c.insert("x", 700, now=2.0)
    c.insert("y", 700, now=3.0)  # must evict: m1 (oldest member) goes, then the group is free to go
    assert "m1" not in c
    assert c.used_tokens <= 2_000
    assert c.lookup("m9", 1_000, group="g", group_tokens=1_000) in (0, 1_000)


def test_resize_evicts_to_fit_and_clear_empties():
    c = PrefixCache(1_000)
    for i, key in enumerate("abcd"):
        c.insert(key, 200, now=float(i))
    assert c.resize(500) == 400
    assert c.used_tokens == 400 and "a" not in c and "b" not in c
    c.clear()
    assert c.used_tokens == 0 and len(c) == 0 and c.lookup("d", 100) == 0


def test_negative_sizes_are_rejected():
    with pytest.raises(ValueError):
        PrefixCache(-1)
    with pytest.raises(ValueError):
        PrefixCache(10).insert("a", -1, now=0.0)


ops = st.lists(
    st.tuples(
        st.sampled_from(["insert", "evict", "resize"]),
        st.sampled_from(["a", "b", "c", "d", "e"]),
        st.integers(min_value=0, max_value=900),
        st.sampled_from(["", "g1", "g2"]),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_used_tokens_stay_within_capacity_and_match_the_entries(sequence):
    c = PrefixCache(1_000)
    for t, (op, key, n, group) in enumerate(sequence):
        if op == "insert":
            c.insert(key, n, now=float(t), group=group, group_tokens=n // 2)
        elif op == "evict":
            c.evict(key)
        else:
            c.resize(200 + n)
        assert 0 <= c.used_tokens <= c.capacity_tokens
        for k in "abcde":
            assert c.lookup(k, 10_000) <= c.capacity_tokens
    c.clear()
    assert c.used_tokens == 0
