"""The prompts an engine resolved recently, so the next turn of a trajectory extends one in memory (pure, no I/O).

With the lean wire (`proto/context_log.py`) a turn carries only the ids after a prefix of an earlier turn's
prompt. The engine that served that turn holds the prompt here and extends it without touching the bus; any other
engine reads the trajectory's context log (`contexts.py`). One prompt is kept per trajectory (the latest turn
seen: a trajectory's turns come one after another), as compact 32-bit arrays, least recently used evicted first
beyond `max_tokens` in all. With it, where this engine last read the trajectory's log (a stream sequence): a turn
the engine does not hold needs only the segments after the turn it does hold, which were all written after that
read (a trajectory's turns are written one after another), so the next read starts there.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict

DEFAULT_MAX_TOKENS = 64 * 1024 * 1024  # 256 MiB of ids: a few hundred 128k-token trajectories


class ContextCache:
    def __init__(self, max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        self.max_tokens = max_tokens
        self._prompts: OrderedDict[str, tuple[int, array]] = OrderedDict()  # traj_id -> (turn, prompt ids)
        self._log_seq: dict[str, int] = {}  # traj_id -> the last log sequence read for it
        self.tokens = 0
        self.hits = 0
        self.misses = 0

    def get(self, traj_id: str, turn: int, min_len: int) -> array | None:
        """Turn `turn`'s prompt of `traj_id` if held and at least `min_len` long (counted as a hit or a miss)."""
        entry = self._prompts.get(traj_id)
        if entry is None or entry[0] != turn or len(entry[1]) < min_len:
            self.misses += 1
            return None
        self._prompts.move_to_end(traj_id)
        self.hits += 1
        return entry[1]

    def put(self, traj_id: str, turn: int, prompt: array) -> None:
        """Hold turn `turn`'s prompt (replacing an older turn's); a prompt larger than the whole cache is not held."""
        old = self._prompts.pop(traj_id, None)
        if old is not None:
            if old[0] > turn:  # a late redelivery of an older turn: keep the newer prompt
                self._prompts[traj_id] = old
                return
            self.tokens -= len(old[1])
        if len(prompt) > self.max_tokens:
            return
        self._prompts[traj_id] = (turn, prompt)
        self.tokens += len(prompt)
        while self.tokens > self.max_tokens:
            gone, (_, evicted) = self._prompts.popitem(last=False)
            self._log_seq.pop(gone, None)
            self.tokens -= len(evicted)

    def read_log(self, traj_id: str, seq: int) -> None:
        """This engine read `traj_id`'s log up to stream sequence `seq` (kept while its prompt is held)."""
        if traj_id in self._prompts:
            self._log_seq[traj_id] = max(seq, self._log_seq.get(traj_id, 0))

    def log_seq(self, traj_id: str) -> int:
        """Where the next read of `traj_id`'s log may start after (0: from the start)."""
        return self._log_seq.get(traj_id, 0) if traj_id in self._prompts else 0

    def known(self, traj_id: str) -> dict[int, array]:
        """What is held of `traj_id` (turn -> prompt), for `proto.context_log.rebuild` to stop early at."""
        entry = self._prompts.get(traj_id)
        return {entry[0]: entry[1]} if entry is not None else {}

    def __len__(self) -> int:
        return len(self._prompts)
