"""The prefix cache's host tier: written through, its own LRU and capacity, untouched by resizes, cleared with the
device tier — and a device tier that behaves exactly as without it."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from services.engine_agent.prefix_cache import PrefixCache


def test_without_a_host_tier_there_is_nothing_to_reload():
    c = PrefixCache(1_000)
    c.insert("a", 300, now=1.0)
    assert c.host is None and c.lookup_host("a", 500) == 0


def test_what_the_device_tier_evicts_stays_in_host_memory():
    c = PrefixCache(1_000, host_capacity_tokens=3_000)
    c.insert("a", 600, now=1.0)
    c.insert("b", 600, now=2.0)  # over the device capacity: a leaves the GPUs
    assert c.lookup("a", 800) == 0 and c.lookup("b", 800) == 600
    assert c.lookup_host("a", 800) == 600 and c.lookup_host("b", 800) == 600  # written through: both there
    assert c.lookup_host("a", 400) == 400  # capped by the context, as a device hit is


def test_a_reloaded_prefix_is_back_on_the_device_once_its_turn_ran():
    c = PrefixCache(1_000, host_capacity_tokens=3_000)
    c.insert("a", 600, now=1.0)
    c.insert("b", 600, now=2.0)
    c.insert("a", 700, now=3.0)  # the turn that reloaded a ran: the engine holds its (longer) prefix again
    assert c.lookup("a", 800) == 700 and c.lookup("b", 800) == 0
    assert c.lookup_host("a", 800) == 700 and c.lookup_host("b", 800) == 600


def test_the_host_tier_evicts_least_recently_used_beyond_its_own_capacity():
    c = PrefixCache(600, host_capacity_tokens=1_300)
    for i, key in enumerate("abc"):
        c.insert(key, 600, now=float(i))
    assert c.host is not None and c.host.used_tokens == 1_200
    assert c.lookup_host("a", 600) == 0  # 1,800 > 1,300: the oldest left host memory too
    assert c.lookup_host("b", 600) == 600 and c.lookup("b", 600) == 0
    assert c.lookup("c", 600) == 600


def test_running_work_shrinks_the_device_tier_only():
    c = PrefixCache(1_000, host_capacity_tokens=2_000)
    c.insert("a", 500, now=1.0)
    assert c.resize(0) == 500  # decodes took the KV
    assert c.lookup("a", 500) == 0 and c.lookup_host("a", 500) == 500


def test_a_prefix_longer_than_the_device_is_written_through_whole():
    c = PrefixCache(100, host_capacity_tokens=1_000)
    c.insert("big", 500, now=1.0)
    assert c.lookup("big", 500) == 100 and c.lookup_host("big", 500) == 500


def test_the_host_tier_holds_group_prefixes_too():
    c = PrefixCache(1_000, host_capacity_tokens=5_000)
    c.insert("m1", 900, now=1.0, group="g", group_tokens=800)
    c.insert("x", 1_000, now=2.0)  # the device tier drops m1 and the group's prompt
    assert c.lookup("m2", 800, group="g", group_tokens=800) == 0
    assert c.lookup_host("m2", 800, group="g", group_tokens=800) == 800


def test_clear_empties_both_tiers():
    c = PrefixCache(1_000, host_capacity_tokens=2_000)
    c.insert("a", 500, now=1.0)
    c.clear()  # new weights: no tier's KV is valid
    assert c.lookup("a", 500) == 0 and c.lookup_host("a", 500) == 0


_ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("insert"), st.sampled_from("abcdef"), st.integers(0, 900), st.sampled_from(["", "g"])
        ),
        st.tuples(st.just("resize"), st.just(""), st.integers(0, 2_000), st.just("")),
        st.tuples(st.just("evict"), st.sampled_from("abcdef"), st.just(0), st.just("")),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(_ops, st.integers(1, 3_000))
def test_the_device_tier_is_the_same_with_a_host_tier_as_without(ops, host_capacity) -> None:
    plain, tiered = PrefixCache(1_500), PrefixCache(1_500, host_capacity_tokens=host_capacity)
    for t, (op, key, n, group) in enumerate(ops):
        for c in (plain, tiered):
            if op == "insert":
                c.insert(key, n, now=float(t), group=group, group_tokens=n // 2 if group else 0)
            elif op == "resize":
                c.resize(n)
            else:
                c.evict(key)
        assert plain.used_tokens == tiered.used_tokens and plain.evicted_tokens == tiered.evicted_tokens
        for k in "abcdef":
            assert plain.lookup(k, 2_000, "g", 400) == tiered.lookup(k, 2_000, "g", 400)
            # the host tier is written through: it holds at least what the device does, while it has room for it
            if host_capacity >= 1_500:
                assert tiered.lookup_host(k, 2_000) >= min(tiered.lookup(k, 2_000), host_capacity)
