"""A request cancelled while its reservation is on its way to Redis leaves no slot behind."""

from __future__ import annotations

import asyncio

from macpool.contract import Keys, now_ms
from router.admission import Ticket
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
                if await redis.zcount(slots, now_ms(), "+inf") == 0 and not admission._releasing:
                    break
                await asyncio.sleep(0.02)
            assert await redis.zcount(slots, now_ms(), "+inf") == 0
            # and the slot is there for the next request
            lease = await admission.acquire(lambda: [NODE], Ticket(model="m"))
            assert lease.node.node_id == "a"
            await admission.release(lease)

    asyncio.run(scenario())
