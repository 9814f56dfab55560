"""Per-engine prefix cache bookkeeping: which trajectory prefixes an engine still holds, in tokens, with LRU eviction.

Pure: no clock (`now` is passed in and only recorded), no I/O.

Model. An engine's KV cache keeps, per trajectory, the KV of a prefix of its history (the prompt it last computed,
or more). A new turn of that trajectory whose context extends the prefix reuses it: `lookup(traj, context)` returns
the hit, `min(cached, context)`. GRPO-style groups share turn 0's prompt: a member inserted with `group` and
`group_tokens` also registers the group's prefix once, and another member's lookup hits at least that much. Shared
blocks are counted once: a member entry charges only its private tokens (beyond the group prefix), and a group
prefix stays while any member entry references it (a referenced block cannot be freed, as in vLLM's ref-counted
block pool); an unreferenced group prefix is evictable like any entry.

Eviction is least-recently-inserted first (insert = the request ran, so the prefix was used) until the charged
tokens fit `capacity_tokens`. `resize` changes the capacity (a decode engine's cache shrinks as running sequences
claim KV) and evicts as needed. `clear()` empties it (role switch, weight update).

Host tier (`host_capacity_tokens` > 0: SGLang HiCache's L2, `services.runtime.host_kv`): a second cache of the same
kind in host memory, written through — every insert here is also an insert there, as HiCache's default
`write_through` policy backs up each prefix the GPU caches — with its own capacity and LRU order, never resized by
running work (host memory holds no running KV) and cleared with this one. So what the device tier evicts stays in
host memory until the host tier evicts it in turn, and `lookup_host` tells how much of a prompt the engine could
reload instead of recompute. Without it (the default) nothing of this class changes.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from mypy_extensions import mypyc_attr


@mypyc_attr(allow_interpreted_subclasses=True)  # deep-copied by `Simulation.fork` (see `prorsa.native`)
@dataclass(slots=True)
class _Entry:
    tokens: int  # cached prefix length of this trajectory (includes the group prefix if any)
    charged_tokens: int  # tokens it occupies beyond its group prefix
    group: str
    last_used_s: float


@mypyc_attr(allow_interpreted_subclasses=True)  # deep-copied by `Simulation.fork` (see `prorsa.native`)
@dataclass(slots=True)
class _Group:
    tokens: int
    refs: int
    last_used_s: float


@mypyc_attr(allow_interpreted_subclasses=True)  # deep-copied by `Simulation.fork` (see `prorsa.native`)
class PrefixCache:
    """Cached prefix lengths per trajectory (and shared group prefixes), bounded by a token capacity."""

    def __init__(self, capacity_tokens: int, host_capacity_tokens: int = 0) -> None:
        if capacity_tokens < 0 or host_capacity_tokens < 0:
            raise ValueError(f"capacities must be >= 0, got {capacity_tokens}, host {host_capacity_tokens}")
        self._capacity = capacity_tokens
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # LRU order: oldest first
        self._groups: dict[str, _Group] = {}
        self._free_groups: OrderedDict[str, None] = OrderedDict()  # unreferenced groups, LRU order
        self._used = 0
        self.evicted_tokens = 0  # running total, for statistics
        # The host tier, written through (module doc); None: no tier.
        self.host: PrefixCache | None = (
            PrefixCache(host_capacity_tokens) if host_capacity_tokens > 0 else None
        )

    @property
    def capacity_tokens(self) -> int:
        return self._capacity

    @property
    def used_tokens(self) -> int:
        return self._used

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def cached_tokens(self, key: str) -> int:
        """The trajectory's own cached prefix (0 if none), ignoring group prefixes."""
        entry = self._entries.get(key)
        return entry.tokens if entry is not None else 0

    def lookup(self, key: str, context_tokens: int, group: str = "", group_tokens: int = 0) -> int:
        """Tokens of a `context_tokens` prompt already cached for trajectory `key` (a read: recency unchanged)."""
        hit = 0
        entry = self._entries.get(key)
        if entry is not None:
            hit = entry.tokens
        if group and group_tokens > hit:
            shared = self._groups.get(group)
            if shared is not None:
                hit = max(hit, min(shared.tokens, group_tokens))
        return hit if hit < context_tokens else context_tokens

    def lookup_host(self, key: str, context_tokens: int, group: str = "", group_tokens: int = 0) -> int:
        """Tokens of the prompt the host tier holds (0 without one): what `lookup` finds there, a read."""
        host = self.host
        return host.lookup(key, context_tokens, group, group_tokens) if host is not None else 0

    def insert(self, key: str, tokens: int, now: float, group: str = "", group_tokens: int = 0) -> None:
        """Record that the engine now holds `tokens` of trajectory `key`'s prefix (most recently used).

        With `group`, the first `group_tokens` of it are the group's shared prefix. A prefix larger than the whole
        capacity is cached up to the capacity (a prefix of a prefix is still a valid prefix).
        """
        if tokens < 0 or group_tokens < 0:
            raise ValueError(f"negative token count: tokens={tokens} group_tokens={group_tokens}")
        host = self.host
        if host is not None:  # write-through: the whole prefix, whatever of it the device tier keeps
            host.insert(key, tokens, now, group, group_tokens)
        if tokens > self._capacity:
            tokens = self._capacity
        shared = (group_tokens if group_tokens < tokens else tokens) if group else 0
        entry = self._entries.get(key)
        if entry is not None and tokens > 0 and entry.group == (group if shared else ""):
            # The common case, a trajectory's next turn (inline: the simulator inserts once per turn).
            if shared:
                prefix = self._groups[entry.group]
                if shared > prefix.tokens:
                    self._used += shared - prefix.tokens
                    prefix.tokens = shared
                prefix.last_used_s = now
            charged = tokens - shared
            self._used += charged - entry.charged_tokens
            entry.tokens, entry.charged_tokens, entry.last_used_s = tokens, charged, now
            self._entries.move_to_end(key)
            if self._used > self._capacity:
                self._evict_to(self._capacity, keep=key)
            return
        self._drop(key)
        if tokens == 0:
            return
        if shared > 0:
            self._ref_group(group, shared, now)
        entry = _Entry(
            tokens=tokens, charged_tokens=tokens - shared, group=group if shared else "", last_used_s=now
        )
        self._entries[key] = entry
        self._used += entry.charged_tokens
        self._evict_to(self._capacity, keep=key)

    def evict(self, key: str) -> int:
        """Drop trajectory `key`'s entry; returns the tokens freed (its group prefix may become evictable)."""
        entry = self._entries.get(key)
        if entry is None:
            return 0
        self._drop(key)
        self.evicted_tokens += entry.charged_tokens
        return entry.charged_tokens

    def resize(self, capacity_tokens: int) -> int:
        """Set a new capacity, evicting least recently used prefixes to fit; returns the tokens evicted."""
        if capacity_tokens < 0:
            raise ValueError(f"capacity_tokens must be >= 0, got {capacity_tokens}")
        self._capacity = capacity_tokens
        return self._evict_to(capacity_tokens)

    def clear(self) -> None:
        """Forget everything (role switch or new weights: cached KV is no longer valid)."""
        self._entries.clear()
        self._groups.clear()
        self._free_groups.clear()
        self._used = 0
        if self.host is not None:  # host copies were computed with the same weights
            self.host.clear()

    # -- internals ------------------------------------------------------------------------------------------

    def _ref_group(self, group: str, tokens: int, now: float) -> None:
        shared = self._groups.get(group)
        if shared is None:
            self._groups[group] = _Group(tokens=tokens, refs=1, last_used_s=now)
            self._used += tokens
            return
        if shared.refs == 0:
            del self._free_groups[group]
        shared.refs += 1
        shared.last_used_s = now
        if tokens > shared.tokens:  # a longer shared prefix computed: charge the difference
            self._used += tokens - shared.tokens
            shared.tokens = tokens

    def _drop(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        self._used -= entry.charged_tokens
        if entry.group:
            shared = self._groups[entry.group]
            shared.refs -= 1
            if shared.refs == 0:
                self._free_groups[entry.group] = None

    def _evict_to(self, limit: int, keep: str | None = None) -> int:
        """Evict least recently used entries and unreferenced groups until used <= limit; returns tokens freed."""
        freed = 0
        entries, free_groups = self._entries, self._free_groups
        while self._used > limit:
            victim = next(iter(entries), None)  # the oldest entry, unless it is the one kept
            if victim is not None and victim == keep:  # (callers keep the newest: this one is alone)
                victim = next((k for k in entries if k != keep), None)
            free_group = next(iter(free_groups), None) if free_groups else None
            if free_group is not None and (
                victim is None or self._groups[free_group].last_used_s <= entries[victim].last_used_s
            ):
                del self._free_groups[free_group]
                tokens = self._groups.pop(free_group).tokens
                self._used -= tokens
                self.evicted_tokens += tokens
                freed += tokens
            elif victim is not None:
                freed += self.evict(victim)
            else:
                freed += self._trim_kept_group(keep)
                break  # only the entry being kept (and its pinned group) remain
        return freed

    def _trim_kept_group(self, keep: str | None) -> int:
        """The kept entry's group prefix is longer than the entry needs and overflows: cut it to fit."""
        entry = self._entries.get(keep) if keep is not None else None
        if entry is None or not entry.group:
            return 0
        shared = self._groups[entry.group]
        needed = entry.tokens - entry.charged_tokens
        cut = min(self._used - self._capacity, shared.tokens - needed)
        if cut <= 0:
            return 0
        shared.tokens -= cut
        self._used -= cut
        self.evicted_tokens += cut
        return cut
