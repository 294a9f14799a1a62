"""Router liveness (macpool/store/lib.lua ``reclaim``, router/liveness.py): a router that stops beating has
its reservations given back by the others; one that beats keeps them, however slow its event loop."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Iterator

import pytest
import redis

from macpool.store import Candidate, Keys, Lease, Release, ReserveRequest
from router.liveness import Liveness
from router.settings import Settings
from tests.blocking_store import BlockingStore
from tests.strict_keys import strict_keys  # noqa: F401  (the fixture)

pytestmark = pytest.mark.usefixtures("strict_keys")  # every script touches only its KEYS

KEYS = Keys()
ALIVE = 4_000
LEASE = 30_000
T0 = 1_000_000_000


@pytest.fixture
def api(redis_url: str) -> Iterator[BlockingStore]:
    r = redis.Redis.from_url(redis_url)
    r.hset(KEYS.node("n"), mapping={"capacity": 2, "state": "ready", "models": "m", "slots": 2})
    r.zadd(KEYS.nodes, {"n": T0})  # (in the index, which a beat declares)
    r.close()
    api = BlockingStore(redis_url, KEYS)
    yield api
    api.close()


def reserve(api: BlockingStore, rid: str, router: str, now: int, enqueue: bool = False) -> str:
    request = ReserveRequest(rid, [Candidate("n")], LEASE, queue_size=4 if enqueue else 0, enqueue=enqueue,
                             model="m", router=router)
    return api.run(api.store.reserve(request, now)).status


def held(api: BlockingStore, now: int) -> int:
    return int(api.run(api.store.redis.zcount(KEYS.reservations("n"), now, "+inf")))


def test_a_router_that_stops_beating_has_its_slots_given_back(api: BlockingStore) -> None:
    api.run(api.store.beat("crashed", ALIVE, now=T0))
    assert reserve(api, "crashed:1", "crashed", T0 + 10) == "reserved"
    assert reserve(api, "crashed:2", "crashed", T0 + 20) == "reserved"
    api.run(api.store.beat("live", ALIVE, now=T0))
    # still within its liveness: nothing is given back
    assert api.run(api.store.beat("live", ALIVE, now=T0 + ALIVE - 1)) == 0
    assert reserve(api, "live:1", "live", T0 + ALIVE - 1, enqueue=True) == "queued"
    assert held(api, T0 + ALIVE) == 2
    # past it: the live router's next beat gives both slots back, one of them to its waiter
    assert api.run(api.store.beat("live", ALIVE, now=T0 + ALIVE + 1)) == 2
    assert api.run(api.store.redis.zrange(KEYS.reservations("n"), 0, -1)) == ["live:1"]
    assert api.run(api.store.redis.zscore(KEYS.routers, "crashed")) is None
    assert api.run(api.store.redis.hkeys(KEYS.held)) == []
    assert api.run(api.store.redis.zrange(KEYS.in_flight, 0, -1)) == ["anonymous\tlive:1"]
    assert api.run(api.store.redis.hgetall(KEYS.in_flight_count)) == {"anonymous": "1"}


def test_a_dead_routers_slots_on_a_node_gone_from_the_index_lapse_with_their_lease(
        api: BlockingStore) -> None:
    api.run(api.store.beat("crashed", ALIVE, now=T0))
    assert reserve(api, "crashed:1", "crashed", T0) == "reserved"
    api.run(api.store.redis.zrem(KEYS.nodes, "n"))  # not in the index: the beat does not declare it
    assert api.run(api.store.beat("live", ALIVE, now=T0 + ALIVE + 1)) == 0
    assert api.run(api.store.redis.hkeys(KEYS.held)) == []  # (the router's record is gone all the same)
    assert held(api, T0 + ALIVE + 1) == 1
    assert held(api, T0 + LEASE + 1) == 0


def test_a_beating_router_keeps_its_slots_and_its_releases_untrack_them(api: BlockingStore) -> None:
    api.run(api.store.beat("slow", ALIVE, now=T0))
    assert reserve(api, "slow:1", "slow", T0) == "reserved"
    assert reserve(api, "slow:2", "slow", T0) == "reserved"
    for beat in range(1, 10):  # it beats on time, while its requests run long
        api.run(api.store.beat("slow", ALIVE, now=T0 + beat * 1000))
        assert api.run(api.store.beat("other", ALIVE, now=T0 + beat * 1000 + 1)) == 0
    assert held(api, T0 + 10_000) == 2
    api.run(api.store.release(Release("slow:1", "n", router="slow"), T0 + 10_000))
    assert api.run(api.store.redis.hkeys(KEYS.held)) == ["slow:2"]


def test_a_router_counted_dead_that_renews_holds_its_slot_again(api: BlockingStore) -> None:
    api.run(api.store.beat("cut-off", ALIVE, now=T0))
    assert reserve(api, "cut-off:1", "cut-off", T0) == "reserved"
    api.run(api.store.beat("other", ALIVE, now=T0 + ALIVE + 1))
    assert held(api, T0 + ALIVE + 1) == 0
    lease = Lease("cut-off:1", "n", router="cut-off")
    assert api.run(api.store.renew([lease], LEASE, T0 + ALIVE + 2)) == [True]  # counted again
    (record,) = api.run(api.store.redis.hgetall(KEYS.held)).items()
    assert record[0] == "cut-off:1"
    assert json.loads(record[1]) == {"router": "cut-off", "node": "n", "tenant": "anonymous", "slots": 1}


def test_the_beat_goes_on_while_the_event_loop_is_blocked(redis_url: str) -> None:
    """The beat has a thread and an event loop of its own: a router whose event loop is stuck (slow, not
    dead) stays alive."""
    settings = Settings(redis_url=redis_url, router_id="stuck", liveness_seconds=0.4)
    liveness = Liveness(settings)
    r = redis.Redis.from_url(redis_url)
    try:
        liveness.start()

        async def stuck() -> list[float]:
            seen = []
            for _ in range(4):
                time.sleep(0.3)  # noqa: ASYNC251 (the point: this event loop does nothing else meanwhile)
                seen.append(float(r.zscore(KEYS.routers, "stuck") or 0))
            return seen

        alive_until = asyncio.run(stuck())
        assert all(b > a for a, b in itertools.pairwise(alive_until)), alive_until
    finally:
        liveness.stop()
        r.close()
    # a clean stop ends the beat: dead at once, for the next reclaim
    with redis.Redis.from_url(redis_url) as r:
        assert r.zscore(KEYS.routers, "stuck") is None
