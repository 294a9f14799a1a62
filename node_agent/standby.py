"""Standby and activation on the autoscaler's word (``{p}desired:{id}``), read before each heartbeat.

A standby node is registered and reachable but holds no model: in supervise mode llama-server is stopped
(its memory goes back to the Mac's owner), in attach mode the agent admits nothing. ``active`` loads it
(supervise: starts llama-server) and the heartbeat calls it ready once llama-server answers; ``standby``
drains it - nothing new admitted, in-flight requests finish - then stops llama-server.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from redis.exceptions import RedisError

from macpool.store.elastic import ElasticStore

from .runtime import Runtime
from .settings import AgentSettings

log = logging.getLogger("macpool.agent")

# the node document's reason in each elastic state, for operators (the dashboard shows it)
REASONS = {
    "standby": "standby: no model loaded, admitting nothing; loads when the autoscaler or a router asks",
    "loading": "loading the model (asked by the autoscaler or a router); admitting nothing until "
               "llama-server is healthy",
    "draining-to-standby": "going to standby: finishing in-flight requests, admitting nothing new",
}


@dataclass
class Standby:
    """Moves one agent between standby and active; ``load`` and ``unload`` start and stop llama-server
    (no-ops in attach mode)."""

    runtime: Runtime
    store: ElasticStore
    load: Callable[[], None]
    unload: Callable[[], Awaitable[None]]

    async def follow(self) -> None:
        """One step toward what the autoscaler wants; a Redis error keeps the current mode."""
        runtime = self.runtime
        if runtime.draining:
            return
        try:
            desired = await self.store.desired(runtime.settings.node_id)
        except (RedisError, OSError):
            desired = None  # the heartbeat's own write says Redis is down
        if desired == "active" and runtime.standing_by:
            log.info("%s asked to load (by a router or the autoscaler): loading", runtime.settings.node_id)
            if runtime.state == "standby":
                self.load()
            runtime.activate()
        elif desired == "standby" and not runtime.standing_by:
            log.info("%s sent to standby by the autoscaler: draining %d in flight", runtime.settings.node_id,
                     runtime.in_flight)
            runtime.begin_standby_drain()
        elif self.idle():
            idle = runtime.settings.idle_unload
            try:  # (said in Redis, or the word that activated it would load it again at the next beat)
                await self.store.set_desired(runtime.settings.node_id, "standby")
            except (RedisError, OSError):
                return
            log.info("%s: no request for %.0fs: unloading the model, back to standby",
                     runtime.settings.node_id, idle)
            runtime.begin_standby_drain()
        if runtime.state == "draining-to-standby" and runtime.in_flight == runtime.light_in_flight == 0:
            await self.unload()
            runtime.enter_standby()
            log.info("%s in standby: model unloaded, admitting nothing", runtime.settings.node_id)


    def idle(self) -> bool:
        """Serving, and no request for ``--idle-unload`` seconds."""
        runtime = self.runtime
        idle = runtime.settings.idle_unload
        return (idle > 0 and runtime.state == "ready" and not runtime.standing_by and runtime.in_flight == 0
                and time.monotonic() - runtime.last_busy >= idle)


def standby_models(settings: AgentSettings) -> list[str]:
    """The model a supervised llama-server would serve, for the heartbeat while none runs: routers find a
    standby node by its model (scale to zero). Its ``--alias``, else the file name without ``.gguf``."""
    if not settings.supervise or settings.model_file is None:
        return []
    args = settings.llama_args
    for i, arg in enumerate(args):
        name, equals, value = arg.partition("=")
        if name in ("-a", "--alias"):
            return [value] if equals else args[i + 1:i + 2]
    return [settings.model_file.name.removesuffix(".gguf")]
