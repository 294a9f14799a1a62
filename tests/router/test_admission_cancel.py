"""A request cancelled while its reservation is on its way to Redis leaves no slot behind."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from macpool.contract import now_ms
from macpool.dev.redis_server import RedisServer
from macpool.store import Candidate, Keys, ReserveRequest, Store
from router.admission import Admission, Rejected, Ticket
from router.settings import Settings
from tests.router.test_admission_memo import NODE, one_node_pool


def test_a_reservation_made_for_a_request_cancelled_meanwhile_is_given_back(redis_url: str) -> None:
    async def scenario() -> None:
        settings = Settings(redis_url=redis_url, queue_size=0)
        slots = Keys().reservations("a")
        async with one_node_pool(settings) as (redis, admission):
            # once through, so Redis knows the scripts (a cancelled EVALSHA it does not know reserves nothing)
            await admission.release(await admission.acquire(lambda: [NODE], Ticket(model="m")))
            # Redis holds every call for a while: the reservation is written, and the client leaves before
            # its answer; the script then runs all the same and reserves the node's one slot
            await redis.execute_command("CLIENT", "PAUSE", 300, "WRITE")
            request = asyncio.create_task(admission.acquire(lambda: [NODE], Ticket(model="m")))
            await asyncio.sleep(0.05)
            request.cancel()
            await asyncio.gather(request, return_exceptions=True)
            assert admission.active == {}
            for _ in range(100):  # the release goes once Redis answers again (without it: a 30 s lease)
                if await redis.zcount(slots, now_ms(), "+inf") == 0 and not admission.leases.busy():
                    break
                await asyncio.sleep(0.02)
            assert await redis.zcount(slots, now_ms(), "+inf") == 0
            # and the slot is there for the next request
            lease = await admission.acquire(lambda: [NODE], Ticket(model="m"))
            assert lease.node.node_id == "a"
            await admission.release(lease)

    asyncio.run(scenario())


@contextlib.asynccontextmanager
async def impatient_pool(url: str) -> AsyncIterator[tuple[Redis, Admission]]:
    """Admission over one node ``a`` of capacity 1, on a Redis client that gives a call up after 0.3 s."""
    async with one_node_pool(Settings(redis_url=url, queue_size=0), socket_timeout=0.3) as (redis, admission):
        # once through, so Redis knows the scripts
        await admission.release(await admission.acquire(lambda: [NODE], Ticket(model="m")))
        yield redis, admission


async def given_back(redis: Redis) -> bool:
    """Whether node ``a`` holds no live reservation within 3 s (a lease left behind: 30 s)."""
    for _ in range(150):
        if await redis.zcount(Keys().reservations("a"), now_ms(), "+inf") == 0:
            return True
        await asyncio.sleep(0.02)
    return False


def test_a_reservation_whose_answer_timed_out_is_given_back() -> None:
    """Redis stalls past the socket timeout: the request is refused (pool_unavailable), and the reservation
    the script makes once Redis goes on - its bytes were in Redis's socket already - is given back, not held
    by nobody for the whole lease."""

    async def scenario(server: RedisServer) -> None:
        async with impatient_pool(server.url) as (redis, admission):
            assert server.process is not None
            os.kill(server.process.pid, signal.SIGSTOP)
            try:
                with pytest.raises(Rejected) as refused:
                    await admission.acquire(lambda: [NODE], Ticket(model="m"))
                assert refused.value.reason == "pool_unavailable"
                await asyncio.sleep(0.5)
            finally:
                os.kill(server.process.pid, signal.SIGCONT)
            await asyncio.sleep(0.2)  # (the stalled script runs as soon as Redis goes on)
            assert await given_back(redis)
            # and the node's one slot is there for the next request
            lease = await admission.acquire(lambda: [NODE], Ticket(model="m"))
            await admission.release(lease)

    with RedisServer() as server:
        asyncio.run(scenario(server))


def test_a_release_whose_answer_timed_out_is_tried_again(redis_url: str) -> None:
    """A release Redis did not answer in time (it held every write, and dropped the call with its
    connection) is tried again until Redis answers: the slot does not wait for its lease to end."""

    async def scenario() -> None:
        async with impatient_pool(redis_url) as (redis, admission):
            lease = await admission.acquire(lambda: [NODE], Ticket(model="m"))
            await redis.execute_command("CLIENT", "PAUSE", 800, "WRITE")
            await admission.release(lease)  # given up after 0.3 s
            assert await redis.zcount(Keys().reservations("a"), now_ms(), "+inf") == 1
            assert await given_back(redis)

    asyncio.run(scenario())


def test_a_release_tried_again_still_says_the_node_failed(redis_url: str) -> None:
    """The retried release of a request its node failed does not hand the slot to a waiter (who would only
    meet the same failure): the waiter is told the slot is free, and chooses among the nodes it trusts."""

    async def scenario() -> None:
        async with impatient_pool(redis_url) as (redis, admission):
            lease = await admission.acquire(lambda: [NODE], Ticket(model="m"))
            # another router's request waits for node a's one slot
            other = ReserveRequest("other:w", [Candidate("a")], 60_000, queue_size=8, enqueue=True, model="m")
            assert (await Store(redis).reserve(other)).status == "queued"
            events = redis.pubsub()
            await events.subscribe(Keys().events)
            await redis.execute_command("CLIENT", "PAUSE", 800, "WRITE")
            await admission.release(lease, failed=True)  # given up after 0.3 s, tried again
            assert await given_back(redis)
            seen = []
            for _ in range(10):  # (None for the subscription's own message, too)
                message = await events.get_message(ignore_subscribe_messages=True, timeout=0.1)
                if message is not None:
                    seen.append(message["data"])
            await events.aclose()
            assert seen == [b"freed a"]  # not "granted other:w a 1"

    asyncio.run(scenario())
