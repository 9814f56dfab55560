"""Deterministic pseudo-random output of the simulated engine (pure; numpy generators seeded explicitly).

Token `pos` of request `request_id` depends on nothing else: not the attempt, the engine, the role or the batch.
So a redelivered, retried or migrated request produces the same ids on any engine, and a stream that continues on
another engine after a migration stays consistent with what the client already holds. The same holds for the top-k
alternatives of a position (`SimTokens.top`).
"""

from __future__ import annotations

import hashlib
import math

import numpy as np

QWEN3_VOCAB_SIZE = 151_936
_BLOCK = 256  # tokens drawn per generator: one small draw per 256 positions, any position reachable directly


def request_seed(request_id: str) -> int:
    """A stable 64-bit seed (Python's `hash` is salted per process, so it cannot be used)."""
    return int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:8], "little")


class SimTokens:
    """Output token ids and logprobs of one request, by position."""

    __slots__ = ("_block", "_ids", "_lps", "_seed", "_vocab")

    def __init__(self, request_id: str, vocab_size: int = QWEN3_VOCAB_SIZE) -> None:
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
        self._seed = request_seed(request_id)
        self._vocab = vocab_size
        self._block = -1
        self._ids: list[int] = []
        self._lps: list[float] = []

    def at(self, pos: int) -> tuple[int, float]:
        """(token id, logprob) of output position `pos` (>= 0). Logprobs are negative, mean about -0.5."""
        block, i = divmod(pos, _BLOCK)
        if block != self._block:
            rng = np.random.default_rng([self._seed, block])
            self._ids = rng.integers(0, self._vocab, size=_BLOCK).tolist()
            self._lps = (-(rng.exponential(0.5, size=_BLOCK) + 1e-4)).tolist()
            self._block = block
        return self._ids[i], self._lps[i]

    def top(self, pos: int, k: int) -> list[tuple[int, float]]:
        """The k most likely (token id, logprob) at output position `pos`, the most likely first.

        There are no logits here, so the distribution is made up, but coherently: it holds the sampled token
        (`at(pos)`) with its logprob, and other tokens (distinct, drawn from the request's seed and `pos`) share the
        rest of the probability mass in halves (1/2, 1/4, ... of it), so the k listed never sum past 1 and the
        sampled token is listed exactly when it ranks within the k. Same request and position: same answer."""
        if k <= 0:
            return []
        token, logprob = self.at(pos)
        rest = max(1.0 - math.exp(logprob), 1e-12)
        rng = np.random.default_rng([self._seed, pos, 1])  # a stream apart from `at`'s blocks ([seed, block])
        others: list[int] = []
        while len(others) < min(k, self._vocab - 1):
            t = int(rng.integers(0, self._vocab))
            if t != token and t not in others:
                others.append(t)
        pairs = [(token, logprob)] + [(t, math.log(rest * 0.5 ** (i + 1))) for i, t in enumerate(others)]
        pairs.sort(key=lambda p: -p[1])
        return pairs[:k]
