"""macpool/store: the typed API against a real Redis, with the time passed in rather than slept."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from redis.asyncio import Redis

from macpool.contract import NodeDoc, now_ms
from macpool.store import Candidate, Keys, Release, ReserveRequest, Store
from macpool.store.events import Drained, Freed, Gone, Granted, Heartbeat, Shed, drain_message, parse_event
from macpool.store.scripts import source

LEASE = 60_000


def node(node_id: str, capacity: int) -> NodeDoc:
    return NodeDoc(node_id=node_id, url=f"http://{node_id}", models=["m"], capacity=capacity, state="ready",
                   updated_at_ms=now_ms())


def with_store(redis_url: str, keys: Keys, scenario: Callable[[Store], Awaitable[None]]) -> None:
    async def run() -> None:
        redis = Redis.from_url(redis_url)
        try:
            await scenario(Store(redis, keys))
        finally:
            await redis.aclose()

    asyncio.run(run())


def test_every_key_lives_under_a_hash_tagged_prefix(redis_url: str) -> None:
    """A prefix holding a hash tag (Redis Cluster's one slot per pool) works end to end, and nothing the
    scripts write escapes it."""
    keys = Keys("{pool-a}:")

    async def scenario(store: Store) -> None:
        await store.heartbeat(node("n1", 1), 5_000)
        ask = ReserveRequest("r1", [Candidate("n1")], LEASE, queue_size=4, enqueue=True, model="m",
                             prefixes=("h1",))
        assert (await store.reserve(ask)).status == "reserved"
        wait = ReserveRequest("r2", [Candidate("n1")], LEASE, queue_size=4, enqueue=True, model="m")
        assert (await store.reserve(wait)).status == "queued"
        assert await store.release(Release("r1", "n1")) == 1
        assert await store.leave_queue("r2")  # it had been handed r1's slot
        await store.drain("n1", True)
        assert await store.deregister("n1")
        written = [key.decode() for key in await store.redis.keys("*")]
        assert written and all(key.startswith("{pool-a}:") for key in written), written

    with_store(redis_url, keys, scenario)


def test_the_pool_read_counts_waiters_as_of_the_time_given(redis_url: str) -> None:
    async def scenario(store: Store) -> None:
        t = now_ms()
        await store.heartbeat(node("n1", 1), 60_000)
        await store.reserve(ReserveRequest("busy", [Candidate("n1")], LEASE, model="m"), now=t)
        for rid, tenant, gens in (("w1", "a", 1), ("w2", "b", 3)):
            ask = ReserveRequest(rid, [Candidate("n1")], LEASE, queue_size=4, enqueue=True, model="m",
                                 tenant=tenant, priority="batch" if tenant == "b" else "interactive",
                                 batch_queue_max=4, generations=gens)
            assert (await store.reserve(ask, now=t)).status == "queued"
        pool = await store.read_pool(["a", "b", "anonymous"], now=t)
        assert pool.reservations == {"n1": 1}
        assert pool.queue_depth == 2 and pool.queued_slots == 1 + 3
        assert pool.queued == {"a": {"interactive": 1}, "b": {"batch": 1}}
        assert pool.in_flight == {"a": 0, "b": 0, "anonymous": 1}
        # past the waiters' places in the queue and the lease: nothing waits, nothing is held
        later = await store.read_pool(now=t + LEASE + 1)
        assert later.queue_depth == 0 and later.reservations == {"n1": 0}

    with_store(redis_url, Keys(), scenario)


def test_a_heartbeat_says_how_tokens_count_and_the_pool_read_sums_them(redis_url: str) -> None:
    """The KV cache a heartbeat announces bounds what a node admits, and the pool read gives each node's
    reserved tokens - those of live reservations only."""

    async def scenario(store: Store) -> None:
        t = now_ms()
        doc = node("n1", 4).model_copy(update={"seq_ctx": 16_384, "kv_unified": True, "kv_cells": 16_384})
        await store.heartbeat(doc, 60_000)
        await store.heartbeat(node("n2", 4), 60_000)  # its cache unknown: slots alone
        for rid, on, lease in (("short", "n1", 1_000), ("long", "n1", LEASE), ("other", "n2", LEASE)):
            ask = ReserveRequest(rid, [Candidate(on)], lease, model="m", prompt_tokens=4_000,
                                 output_tokens=96)
            assert (await store.reserve(ask, now=t)).tokens == 4_096
        big = ReserveRequest("big", [Candidate("n1")], LEASE, model="m", prompt_tokens=9_000)
        assert (await store.reserve(big, now=t)).status == "full"  # 8K held, 16K wanted (no output limit)
        pool = await store.read_pool(now=t + 1_001)  # the short lease has ended
        assert pool.reservations == {"n1": 1, "n2": 1}
        assert pool.reserved_tokens == {"n1": 4_096, "n2": 4_096}

    with_store(redis_url, Keys(), scenario)


def test_a_node_that_becomes_ready_is_offered_to_the_queue(redis_url: str) -> None:
    """Slots no release announces (a node just ready) go to the waiters in queue order, as a release's would,
    and only while they are free."""

    async def scenario(store: Store) -> None:
        t = now_ms()
        await store.heartbeat(node("n1", 1), 60_000)
        await store.reserve(ReserveRequest("busy", [Candidate("n1")], LEASE, model="m"), now=t)
        for rid in ("w1", "w2", "w3"):
            ask = ReserveRequest(rid, [Candidate("n1")], LEASE, queue_size=4, enqueue=True, model="m")
            assert (await store.reserve(ask, now=t)).status == "queued"
        await store.heartbeat(node("n2", 2), 60_000)
        assert await store.offer("n2", now=t + 1) == 2
        assert await store.offer("n2", now=t + 2) == 0  # nothing free there any more
        both = [Candidate("n1"), Candidate("n2")]
        for rid, status in (("w1", "reserved"), ("w2", "reserved"), ("w3", "queued")):
            again = ReserveRequest(rid, both, LEASE, queue_size=4, enqueue=True, dequeue=True, model="m")
            answer = await store.reserve(again, now=t + 3)
            assert answer.status == status, (rid, answer)
            if status == "reserved":
                assert answer.node_id == "n2"

    with_store(redis_url, Keys(), scenario)


def test_the_admission_scripts_share_one_library_and_the_others_stand_alone() -> None:
    library = source("lib").strip()
    for name in ("reserve", "release", "leave", "offer", "beat", "renew", "forget"):
        assert source(name).startswith(library)
    for name in ("heartbeat", "deregister"):
        assert "local function queue_entries" not in source(name)


def test_every_event_the_scripts_send_reads_back() -> None:
    doc = node("n1", 2)
    assert parse_event(f"node {doc.encode()}") == Heartbeat(doc)
    assert parse_event("granted router-1:abc n1 2") == Granted("router-1:abc", "n1", 2)
    assert parse_event("freed n1") == Freed("n1")
    assert parse_event("gone n1") == Gone("n1")
    assert parse_event("shed router-1:abc") == Shed("router-1:abc")
    assert parse_event(drain_message("n1", True)) == Drained("n1", True)
    assert parse_event(drain_message("n1", False)) == Drained("n1", False)
    for unreadable in ("node {not json", "granted r1 n1", "hello n1", ""):
        assert parse_event(unreadable) is None
