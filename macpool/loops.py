"""Periodic background loops (heartbeats, pool refreshes, lease renewals): drift-free, and one failed
iteration only costs a log line."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable


def raise_if_cancelled() -> None:
    """Raise the current task's cancellation if a library swallowed it. On Python 3.11,
    ``asyncio.wait_for`` returns the result instead when the cancellation meets the end of what it waits
    for, and redis-py writes every command through it: a loop cancelled during a Redis call would go on."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def wait_event(event: asyncio.Event, seconds: float) -> bool:
    """Wait up to ``seconds`` for ``event``; whether it is set. Unlike ``asyncio.wait_for`` on Python 3.11,
    a cancellation that arrives as the event is set is never lost."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await event.wait()
    return event.is_set()


async def ticker(interval: float, wake: asyncio.Event | None = None) -> AsyncIterator[int]:
    """Drift-free ticks: tick n is due at start + n x interval; missed ticks are skipped, not bunched.
    Setting ``wake`` brings the next tick forward (it is cleared then); the schedule stays as it was."""
    start = time.monotonic()
    n = 0
    while True:
        yield n
        n = max(n + 1, int((time.monotonic() - start) / interval) + 1)
        delay = max(0.0, start + n * interval - time.monotonic())
        if wake is None:
            await asyncio.sleep(delay)
            continue
        if await wait_event(wake, delay):
            wake.clear()
            n -= 1  # the due tick is still due


async def every(
    interval: float,
    tick: Callable[[], Awaitable[None]],
    name: str,
    log: logging.Logger,
    *,
    wake: asyncio.Event | None = None,
    first_now: bool = False,
) -> None:
    """Run ``tick`` on ``ticker(interval, wake)``'s schedule until cancelled, the first time at once
    (``first_now``) or one interval from now. A failed iteration is one warning (its traceback at debug
    level), so an outage repeated every second stays readable."""
    async for n in ticker(interval, wake):
        if n == 0 and not first_now:
            continue
        try:
            await tick()
        except Exception as exc:
            log.warning("%s: iteration failed: %s: %s", name, type(exc).__name__, exc,
                        exc_info=log.isEnabledFor(logging.DEBUG))
        raise_if_cancelled()
