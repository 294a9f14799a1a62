"""The router's Redis client survives a Redis restart without failing a command per pooled connection."""

from __future__ import annotations

import asyncio

from macpool.redis_server import RedisServer
from router.app import redis_client
from router.settings import Settings

CONNECTIONS = 8


def test_a_restarted_redis_costs_no_command() -> None:
    server = RedisServer().start()
    restarted: RedisServer | None = None
    try:
        client = redis_client(Settings(redis_url=server.url))

        async def together() -> list[object]:
            # started together, each command takes its own pooled connection
            return await asyncio.gather(*(client.ping() for _ in range(CONNECTIONS)), return_exceptions=True)

        async def scenario() -> list[object]:
            nonlocal restarted
            assert await together() == [True] * CONNECTIONS
            server.kill()
            restarted = RedisServer(port=server.port).start()  # empty, where the clients expect it
            answers = await together()
            await client.aclose()
            return answers

        assert asyncio.run(scenario()) == [True] * CONNECTIONS
    finally:
        server.close()
        if restarted is not None:
            restarted.close()
