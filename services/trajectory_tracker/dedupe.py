"""Bounded duplicate detection by (source, sequence number).

Each lifecycle source (a client) and each engine numbers its events 1, 2, ...; a redelivered or re-published
event repeats its number. Per source we remember the numbers seen within the last `window` of the highest one;
anything older than the window counts as already seen (it is so late that applying it could only do harm).
Sequence number 0 means "not numbered" (the proto default) and is never a duplicate: such events rely on the
state machine's own idempotence. Sources are kept in LRU order and capped, so memory stays bounded.
"""

from __future__ import annotations

from collections import OrderedDict


class _SourceWindow:
    __slots__ = ("high", "seen")

    def __init__(self) -> None:
        self.high = 0
        self.seen: set[int] = set()


class SeqDeduper:
    """`check_and_add(source, seq)` is True the first time a (source, seq) pair is offered, False after."""

    def __init__(self, window: int = 4096, max_sources: int = 4096) -> None:
        if window < 1 or max_sources < 1:
            raise ValueError("window and max_sources must be >= 1")
        self.window = window
        self.max_sources = max_sources
        self._sources: OrderedDict[str, _SourceWindow] = OrderedDict()

    def check_and_add(self, source: str, seq: int) -> bool:
        if seq <= 0:
            return True
        w = self._sources.get(source)
        if w is None:
            w = self._sources[source] = _SourceWindow()
            if len(self._sources) > self.max_sources:
                self._sources.popitem(last=False)
        else:
            self._sources.move_to_end(source)
        if seq <= w.high - self.window or seq in w.seen:
            return False
        w.seen.add(seq)
        if seq > w.high:
            w.high = seq
            if len(w.seen) > 2 * self.window:  # prune lazily: amortised O(1) per event
                floor = w.high - self.window
                w.seen = {s for s in w.seen if s > floor}
        return True

    def __len__(self) -> int:
        return len(self._sources)

    def windows(self) -> list[tuple[str, int, set[int]]]:
        """(source, highest seq, seqs remembered) per source, least recently used first: for checkpoints."""
        return [(s, w.high, set(w.seen)) for s, w in self._sources.items()]

    @classmethod
    def from_windows(
        cls, window: int, max_sources: int, items: list[tuple[str, int, list[int]]]
    ) -> SeqDeduper:
        """The deduper whose `windows()` were `items` (a checkpoint's)."""
        out = cls(window, max_sources)
        for source, high, seen in items:
            w = out._sources[source] = _SourceWindow()
            w.high = high
            w.seen = set(seen)
        return out

    def state(self) -> list[tuple[str, int, int]]:
        """(source, highest seq, seqs remembered) per source, sorted: for digests and tests."""
        return sorted((s, w.high, len(w.seen)) for s, w in self._sources.items())
