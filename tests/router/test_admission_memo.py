"""Admission in-process on a real Redis: the "full" memo never refuses what Redis would queue."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from macpool.contract import NodeDoc
from macpool.store import Keys, Store
from router.admission import Admission, Rejected, Ticket
from router.full_memo import FULL_MEMO_S
from router.metrics import RouterMetrics
from router.pool import PoolView
from router.settings import Settings
from tests.conftest import eventually

NODE = NodeDoc(node_id="a", url="http://127.0.0.1:9", capacity=1, state="ready", models=["m"])


@contextlib.asynccontextmanager
async def one_node_pool(
    settings: Settings, socket_timeout: float | None = None
) -> AsyncIterator[tuple[Redis, Admission]]:
    """Admission over a pool of one node ``a`` of capacity 1 serving model ``m`` (stopped at the end), on a
    Redis client that gives a call up after ``socket_timeout`` (None: never)."""
    redis = Redis.from_url(settings.redis_url, socket_timeout=socket_timeout)
    keys = Keys()
    store = Store(redis, keys)
    pool = PoolView(settings, store)
    pool.redis_ok = True
    admission = Admission(settings, store, pool, RouterMetrics())
    await redis.hset(keys.node("a"), mapping={"capacity": 1, "state": "ready", "models": "m"})
    try:
        yield redis, admission
    finally:
        await admission.stop()
        await redis.aclose()


async def evalsha_calls(redis: Redis) -> int:
    stats = (await redis.info("commandstats")).get("cmdstat_evalsha", {})
    return int(stats.get("calls", 0))


def test_a_batch_full_answer_does_not_refuse_an_interactive_request_from_memory(redis_url: str) -> None:
    async def scenario() -> None:
        settings = Settings(redis_url=redis_url, queue_size=1, batch_queue_share=1.0, queue_timeout=5.0)
        async with one_node_pool(settings) as (redis, admission):
            holder = await admission.acquire(lambda: [NODE], Ticket(model="m"))
            batch_ticket = Ticket(model="m", priority="batch")
            batch = asyncio.create_task(admission.acquire(lambda: [NODE], batch_ticket))
            await eventually(lambda: redis.zcard(Keys().queue), what="the batch request queued")  # now full
            with pytest.raises(Rejected) as refused:
                await admission.acquire(lambda: [NODE], Ticket(model="m", priority="batch"))
            assert refused.value.reason == "pool_full"
            # an interactive request right after still reaches Redis and takes the batch request's place
            interactive = asyncio.create_task(admission.acquire(lambda: [NODE], Ticket(model="m")))
            with pytest.raises(Rejected) as shed:
                await batch
            assert shed.value.reason == "batch_shed"
            await admission.release(holder)
            lease = await asyncio.wait_for(interactive, 5)
            assert lease.node.node_id == "a"
            await admission.release(lease)
            # an interactive "full" is remembered: the next refusal makes no Redis call
            holder = await admission.acquire(lambda: [NODE], Ticket(model="m"))
            waiting = asyncio.create_task(admission.acquire(lambda: [NODE], Ticket(model="m")))
            await eventually(lambda: redis.zcard(Keys().queue), what="the request queued")
            with pytest.raises(Rejected):
                await admission.acquire(lambda: [NODE], Ticket(model="m"))
            before = await evalsha_calls(redis)
            with pytest.raises(Rejected) as remembered:
                await admission.acquire(lambda: [NODE], Ticket(model="m"))
            assert remembered.value.reason == "pool_full"
            assert await evalsha_calls(redis) == before
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)

    asyncio.run(scenario())


def test_a_lapsed_full_answer_is_asked_again_by_one_request_only(redis_url: str) -> None:
    """A lapsed memo: one request re-asks Redis; the others are refused from memory until it is back."""

    async def scenario() -> None:
        settings = Settings(redis_url=redis_url, queue_size=0)
        async with one_node_pool(settings) as (redis, admission):
            holder = await admission.acquire(lambda: [NODE], Ticket(model="m"))
            with pytest.raises(Rejected):
                await admission.acquire(lambda: [NODE], Ticket(model="m"))  # Redis says full: remembered
            await asyncio.sleep(FULL_MEMO_S * 1.5)  # lapsed
            before = await evalsha_calls(redis)
            asking = asyncio.create_task(admission.acquire(lambda: [NODE], Ticket(model="m")))
            await asyncio.sleep(0)  # the asking request now waits for Redis
            for _ in range(5):
                with pytest.raises(Rejected) as refused:
                    await admission.acquire(lambda: [NODE], Ticket(model="m"))
                assert refused.value.reason == "pool_full"
            with pytest.raises(Rejected):
                await asking  # still full
            assert await evalsha_calls(redis) == before + 1
            # its answer is remembered afresh; once the slot is released, the next request reaches Redis
            assert admission.known_full("m")
            await admission.release(holder)
            admission.pool.version += 1  # what the release's `freed` event does through the events channel
            lease = await admission.acquire(lambda: [NODE], Ticket(model="m"))
            assert lease.node.node_id == "a"
            await admission.release(lease)

    asyncio.run(scenario())


def test_a_request_no_node_can_run_now_is_refused_at_once_not_queued(redis_url: str) -> None:
    # several generations at once, and the only node large enough left between the router's check and
    # admission: its candidates are none, and a queued request with none would wait out the queue timeout
    async def scenario() -> None:
        settings = Settings(redis_url=redis_url, queue_size=4, queue_timeout=1.0)
        async with one_node_pool(settings) as (redis, admission):
            with pytest.raises(Rejected) as refused:
                await admission.acquire(lambda: [], Ticket(model="m", generations=2))
            assert refused.value.reason == "pool_full" and refused.value.retry_after >= 1
            assert await redis.zcard(Keys().queue) == 0

    asyncio.run(scenario())
