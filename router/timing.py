"""Time the router's own admission decision (pool view + reservation script) against a live pool.

``python -m router.timing REDIS_URL COUNT`` prints one JSON document; `macpool bench scale` runs it so that
the bench tooling (macpool.bench) imports no router code.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from typing import Any

from redis.asyncio import Redis as AsyncRedis

from macpool.bench.stats import ms, pct
from macpool.store import Keys, Store
from router.admission import Admission
from router.metrics import RouterMetrics
from router.pool import PoolView
from router.settings import Settings


async def decision_time(redis_url: str, count: int) -> dict[str, Any]:
    """Time the router's own admission code (pool view + reservation script) against the live pool."""
    settings = Settings(redis_url=redis_url, router_id=f"bench-{uuid.uuid4().hex[:6]}", queue_size=0)
    redis = AsyncRedis.from_url(redis_url)
    store = Store(redis, Keys(settings.key_prefix))
    pool = PoolView(settings, store)
    admission = Admission(settings, store, pool, RouterMetrics())
    await pool.start()
    admission.start()
    acquire_s: list[float] = []
    candidates_s: list[float] = []
    try:
        for _ in range(count):
            t0 = time.perf_counter()
            docs = pool.candidates("")
            t1 = time.perf_counter()
            lease = await admission.acquire(lambda docs=docs: docs)  # type: ignore[misc]
            t2 = time.perf_counter()
            await admission.release(lease)
            candidates_s.append(t1 - t0)
            acquire_s.append(t2 - t0)
        n_candidates = len(pool.candidates(""))
    finally:
        await admission.stop()
        await pool.stop()
        await redis.aclose()
    return {
        "decisions": count,
        "candidates": n_candidates,
        "decision_p50_ms": ms(pct(acquire_s, 50)),
        "decision_p99_ms": ms(pct(acquire_s, 99)),
        "candidate_filter_p50_ms": ms(pct(candidates_s, 50), 4),
    }



def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m router.timing REDIS_URL COUNT", file=sys.stderr)
        return 2
    print(json.dumps(asyncio.run(decision_time(args[0], int(args[1])))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
