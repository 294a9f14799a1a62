"""macpool/loops.py: the periodic loop survives a failed iteration, and ``wake`` brings a tick forward."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from macpool.loops import every

log = logging.getLogger("tests.loops")


async def _stop(loop: asyncio.Task[None]) -> None:
    loop.cancel()
    with pytest.raises(asyncio.CancelledError):
        await loop


def test_a_failed_iteration_is_one_warning_and_the_loop_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> list[float]:
        ticks: asyncio.Queue[float] = asyncio.Queue()
        count = 0

        async def tick() -> None:
            nonlocal count
            count += 1
            ticks.put_nowait(time.monotonic())
            if count == 1:
                raise RuntimeError("one bad iteration")

        started = time.monotonic()
        loop = asyncio.create_task(every(0.02, tick, "test loop", log))
        seen = [await asyncio.wait_for(ticks.get(), 5) for _ in range(3)]
        await _stop(loop)
        return [t - started for t in seen]

    ticks = asyncio.run(main())
    assert ticks[0] >= 0.015  # the first tick is one interval away unless first_now
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["test loop: iteration failed: RuntimeError: one bad iteration"]


def test_wake_runs_the_next_tick_at_once() -> None:
    async def main() -> float:
        ticks: asyncio.Queue[float] = asyncio.Queue()

        async def tick() -> None:
            ticks.put_nowait(time.monotonic())

        wake = asyncio.Event()
        loop = asyncio.create_task(every(60.0, tick, "test loop", log, wake=wake, first_now=True))
        await asyncio.wait_for(ticks.get(), 5)
        woken = time.monotonic()
        wake.set()
        second = await asyncio.wait_for(ticks.get(), 5)  # not the 60 s interval
        await _stop(loop)
        return second - woken

    assert asyncio.run(main()) < 5
