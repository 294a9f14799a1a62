"""Retry-After (router/retry_after.py): what waits, over how fast the pool frees slots."""

from __future__ import annotations

from redis.asyncio import Redis

from macpool.store import Store
from router.pool import PoolView, RateMeter
from router.retry_after import RetryAfter
from router.settings import Settings


def test_retry_after_counts_the_waiting_slots_against_the_slots_freed_per_second() -> None:
    # Retry-After = what waits / the release rate, both in slots: two waiting pairs and two singles wait
    # for 6 slots, not 4 requests' worth
    settings = Settings(router_id="r1")
    pool = PoolView(settings, Store(Redis()))  # the client is never used
    now = [0.0]
    pool.freed = RateMeter(window=30.0, clock=lambda: now[0])
    for second in range(30):  # one slot freed every second
        now[0] = float(second)
        pool.freed.mark()
    now[0] = 30.0
    pool.snapshot.queue_depth, pool.snapshot.queued_slots = 4, 6
    assert RetryAfter(settings, pool).seconds("pool_full") == 7  # (6 waiting + this one) / 1 per second


def test_a_pool_that_frees_nothing_is_retried_after_the_queue_timeout_and_a_gone_pool_after_stale_after(
) -> None:
    settings = Settings(router_id="r1", queue_timeout=4.0, stale_after=6.0)
    pool = PoolView(settings, Store(Redis()))
    retry = RetryAfter(settings, pool)
    assert retry.seconds("pool_full") == 4
    assert retry.seconds("no_nodes") == 6 and retry.seconds("pool_unavailable") == 6
    assert retry.limited(3) == 1  # nothing busy: a second
