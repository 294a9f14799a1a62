"""macpool/loops.py: the periodic loop survives a failed iteration, and ``wake`` brings a tick forward."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time

import pytest
import redis.asyncio as redis

from macpool.loops import every, wait_event

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


def test_a_loop_cancelled_as_it_is_woken_ends() -> None:
    # the agent's shutdown wakes its heartbeat (a last beat) and cancels it in the same turn of the loop
    async def main() -> None:
        async def tick() -> None:
            pass

        wake = asyncio.Event()
        loop = asyncio.create_task(every(60.0, tick, "test loop", log, wake=wake))
        await asyncio.sleep(0.01)  # waiting for its first tick, or for wake
        wake.set()
        loop.cancel()
        await asyncio.wait_for(asyncio.shield(_stop(loop)), 5)

    asyncio.run(main())


def test_wait_event_says_whether_the_event_came() -> None:
    async def main() -> tuple[bool, bool]:
        event = asyncio.Event()
        timed_out = await wait_event(event, 0.01)
        asyncio.get_running_loop().call_later(0.01, event.set)
        return timed_out, await wait_event(event, 5)

    assert asyncio.run(main()) == (False, True)


def test_a_loop_ends_when_its_tick_swallowed_the_cancellation() -> None:
    # as asyncio.wait_for does on Python 3.11 when the cancellation meets the end of what it waits for
    async def main() -> None:
        started = asyncio.Event()

        async def tick() -> None:
            if started.is_set():
                return
            started.set()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(60)

        loop = asyncio.create_task(every(0.01, tick, "test loop", log, first_now=True))
        await started.wait()
        loop.cancel()  # once: a second cancellation would end the loop anyway
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(loop), 5)

    asyncio.run(main())


def test_a_loop_of_redis_calls_ends_whenever_it_is_cancelled(redis_url: str) -> None:
    # redis-py writes each command through asyncio.wait_for: some of these cancellations arrive as a
    # write completes, and only the loop's own check delivers them
    async def main() -> int:
        client = redis.Redis.from_url(redis_url, socket_timeout=2.0)
        ended = 0
        try:
            for _ in range(300):
                loop = asyncio.create_task(every(0.0001, lambda: client.set("loops:k", 1), "test", log,
                                                 first_now=True))
                await asyncio.sleep(random.random() * 0.002)
                loop.cancel()
                await asyncio.wait_for(asyncio.shield(_stop(loop)), 5)
                ended += 1
        finally:
            await client.aclose()
        return ended

    assert asyncio.run(main()) == 300
