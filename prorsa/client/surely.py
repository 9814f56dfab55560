"""Run an ending to completion however often the task awaiting it is cancelled.

A trajectory whose turn failed or was cancelled must still be reported finished (as aborted), or the tracker counts
it live until its timeout. `asyncio.shield` keeps a cancel from reaching the ending, but the awaiting task stops
waiting at the first cancel — and a second cancel (a trainer cancelling a step's other loops when one fails, then
its worker process torn down) left the ending in flight and lost it. `surely` waits for it through every cancel;
the caller re-raises its own error afterwards.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def surely(ending: Awaitable[T]) -> T:
    """Await `ending` to completion, absorbing cancellations of the awaiting task meanwhile (the ending's own
    exceptions propagate)."""
    task = asyncio.ensure_future(ending)
    while True:
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.done():  # the ending itself was cancelled: nothing left to wait for
                raise
