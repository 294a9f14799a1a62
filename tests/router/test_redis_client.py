"""The router's Redis client (router/app.py), its scripts and its events subscription, against real Redis."""

from __future__ import annotations

import asyncio

import redis

from macpool.contract import NodeDoc, now_ms
from macpool.dev.redis_server import RedisServer
from macpool.store import Keys, Store
from router.admission import Admission, Ticket
from router.app import redis_client
from router.metrics import RouterMetrics
from router.pool import PoolView
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


NODE = NodeDoc(node_id="a", url="http://127.0.0.1:9", capacity=1, state="ready", models=["m"])


def test_admission_survives_a_redis_restarted_empty() -> None:
    """Redis forgets its scripts and its connections when it restarts: the next reservation and release
    still succeed (the dead pooled connections are replaced and the scripts are loaded again)."""
    server = RedisServer().start()
    restarted: RedisServer | None = None
    try:

        async def scenario() -> None:
            nonlocal restarted
            settings = Settings(redis_url=server.url)
            redis = redis_client(settings)
            keys = Keys()
            store = Store(redis, keys)
            pool = PoolView(settings, store)
            pool.redis_ok = True
            admission = Admission(settings, store, pool, RouterMetrics())
            try:
                await redis.hset(keys.node("a"), mapping={"capacity": 1, "state": "ready", "models": "m"})
                await admission.release(await admission.acquire(lambda: [NODE], Ticket(model="m")))
                server.kill()
                restarted = RedisServer(port=server.port).start()
                await redis.hset(keys.node("a"), mapping={"capacity": 1, "state": "ready", "models": "m"})
                lease = await admission.acquire(lambda: [NODE], Ticket(model="m"))
                assert not lease.local  # reserved in Redis, not from the router's own view
                assert await redis.zcard(keys.reservations("a")) == 1
                await admission.release(lease)
                assert await redis.zcard(keys.reservations("a")) == 0
            finally:
                await admission.stop()
                await redis.aclose()

        asyncio.run(scenario())
    finally:
        server.close()
        if restarted is not None:
            restarted.close()


async def _heard(view: PoolView, publisher: redis.Redis, node: str, freed: list[str]) -> None:
    """Publish ``freed <node>`` until the view hears it (its subscription may still be connecting)."""
    for _ in range(100):
        await asyncio.to_thread(publisher.publish, Keys().events, f"freed {node}")
        if node in freed:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"the pool view never heard {node}: {freed}")


def test_the_pool_view_follows_events_again_and_rereads_the_pool_after_redis_restarts() -> None:
    """The events connection dies with Redis. The view subscribes again, hears the next release, and reads
    the pool again at once: what was written while it was not listening is not left to the next refresh."""
    server = RedisServer().start()
    restarted: RedisServer | None = None
    try:

        async def scenario() -> None:
            nonlocal restarted
            settings = Settings(redis_url=server.url, refresh_interval=3600)  # no periodic refresh
            client = redis_client(settings)
            view = PoolView(settings, Store(client))
            freed: list[str] = []
            view.freed_listeners.append(freed.append)
            await view.start()
            publisher = redis.Redis.from_url(server.url)
            try:
                await _heard(view, publisher, "before", freed)
                server.kill()
                restarted = RedisServer(port=server.port).start()
                doc = NodeDoc(node_id="b", url="http://127.0.0.1:9", updated_at_ms=now_ms())
                with redis.Redis.from_url(server.url) as store:  # written without an event
                    store.zadd(Keys().nodes, {"b": now_ms()})
                    store.hset(Keys().node("b"), "doc", doc.encode())
                await _heard(view, publisher, "after", freed)
                for _ in range(50):
                    if "b" in view.snapshot.nodes:
                        break
                    await asyncio.sleep(0.1)
                assert "b" in view.snapshot.nodes
            finally:
                await view.stop()
                publisher.close()
                await client.aclose()

        asyncio.run(scenario())
    finally:
        server.close()
        if restarted is not None:
            restarted.close()


def test_a_message_that_cannot_be_applied_does_not_end_the_subscription(redis_url: str) -> None:
    async def scenario() -> None:
        settings = Settings(redis_url=redis_url)
        client = redis_client(settings)
        view = PoolView(settings, Store(client))
        freed: list[str] = []

        def listener(node: str) -> None:
            if node == "bad":
                raise ValueError("a listener that fails")
            freed.append(node)

        view.freed_listeners.append(listener)
        await view.start()
        publisher = redis.Redis.from_url(redis_url)
        try:
            await _heard(view, publisher, "first", freed)
            await asyncio.to_thread(publisher.publish, Keys().events, "freed bad")
            await _heard(view, publisher, "second", freed)
            assert freed[0] == "first" and "second" in freed
        finally:
            await view.stop()
            publisher.close()
            await client.aclose()

    asyncio.run(scenario())
