"""Periodic background loops: drift-free, and one failed iteration only costs a log line."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger("macpool.router")


async def every(interval: float, tick: Callable[[], Awaitable[None]], name: str) -> None:
    """Run ``tick`` every ``interval`` seconds on a fixed schedule until cancelled."""
    loop = asyncio.get_running_loop()
    due = loop.time()
    while True:
        due += interval
        await asyncio.sleep(max(0.0, due - loop.time()))
        try:
            await tick()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("%s: iteration failed: %s: %s", name, type(exc).__name__, exc)
        if loop.time() > due + interval:  # fell behind: skip the missed ticks instead of bursting
            due = loop.time()
