"""`prorsa.client.surely`: an ending runs to completion however often its awaiting task is cancelled."""

from __future__ import annotations

import asyncio

import pytest

from prorsa.client.surely import surely


async def test_an_ending_completes_through_repeated_cancellations_before_the_cancel_goes_up() -> None:
    done: list[str] = []
    release = asyncio.Event()

    async def ending() -> str:
        await release.wait()
        done.append("finished")
        return "ok"

    async def loop() -> None:
        try:
            raise RuntimeError("the loop failed")
        except BaseException:
            await surely(ending())
            raise

    task = asyncio.create_task(loop())
    await asyncio.sleep(0)
    for _ in range(3):  # a trainer cancelling its step's loops, then tearing down
        task.cancel()
        await asyncio.sleep(0)
    assert not task.done() and done == []
    release.set()
    with pytest.raises((asyncio.CancelledError, RuntimeError)):
        await task
    assert done == ["finished"]


async def test_the_endings_own_result_and_error_come_back() -> None:
    async def fine() -> int:
        return 7

    async def broken() -> None:
        raise ValueError("publish refused")

    assert await surely(fine()) == 7
    with pytest.raises(ValueError, match="publish refused"):
        await surely(broken())
