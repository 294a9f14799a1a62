"""This router's liveness: a beat in Redis from a thread of its own, so that a router that is only slow (its
event loop busy) keeps its reservations, while one that crashed has them given back within
``--liveness-seconds`` plus one beat (macpool/store/lib.lua ``reclaim``). Each beat also gives back what
routers that stopped beating held, and, behind Sentinel, logs a failover the moment it sees one."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading

from macpool.loops import every
from macpool.store import Keys, Store
from macpool.store.connect import connect
from router.settings import Settings

log = logging.getLogger("macpool.router")

STOP_S = 2.0  # the most a stop waits for the thread's last beat and its connection to close
BEATS_PER_PERIOD = 4  # beats per liveness period: a beat or two lost to a Redis hiccup is not a death


class Liveness:
    """Beats ``{p}routers`` every ``liveness_seconds / 4`` on its own thread, event loop and connection."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.alive_ms = max(int(settings.liveness_seconds * 1000), 1)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="macpool-liveness", daemon=True)
        self._thread.start()
        self._started.wait(5)

    def stop(self) -> None:
        """Stop beating, marking this router dead at once (its thread ends within about a second; a daemon
        thread, so a Redis that does not answer never holds up the router's exit)."""
        if self._loop is not None and self._task is not None:
            self._loop.call_soon_threadsafe(self._task.cancel)
        if self._thread is not None:
            self._thread.join(STOP_S)
            self._thread = None

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        settings = self.settings
        connection = connect(settings.redis_url, socket_connect_timeout=2.0, socket_timeout=2.0)
        store = Store(connection.client, Keys(settings.key_prefix))
        router = settings.router_id

        failing = False

        async def beat() -> None:
            nonlocal failing
            try:
                await connection.check_primary(log)
                reclaimed = await store.beat(router, self.alive_ms)
            except Exception as exc:  # one line per outage: the pool view already reports Redis down
                if not failing:
                    log.warning("router liveness beat failed (%s: %s); retrying every beat",
                                type(exc).__name__, exc)
                failing = True
                return
            if failing:
                log.info("router liveness beat succeeds again")
            failing = False
            if reclaimed:
                log.warning("gave back %d slots held by routers that stopped beating", reclaimed,
                            extra={"slots": reclaimed})

        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        self._started.set()
        try:
            await every(settings.liveness_seconds / BEATS_PER_PERIOD, beat, "router liveness", log,
                        first_now=True)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(store.beat(router, -self.alive_ms), 1)  # dead at once: a clean stop
        finally:
            await connection.aclose()
