"""Retry-After: whole seconds until a slot is likely free, from how fast the pool frees its slots."""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from typing import Literal

from router.pool import PoolView
from router.settings import Settings

RejectReason = Literal[
    "pool_full", "queue_timeout", "no_nodes", "pool_unavailable", "batch_shed", "cold_start", "model_loading"
]
MAX_S = 30


class RetryAfter:
    def __init__(self, settings: Settings, pool: PoolView) -> None:
        self.settings = settings
        self.pool = pool
        # how long this replica's recent requests held their slot (Little's law)
        self.recent_holds: deque[float] = deque(maxlen=64)

    def held(self, acquired_at: float) -> None:
        """A request that took its slot at ``acquired_at`` (monotonic) gave it back now."""
        self.recent_holds.append(time.monotonic() - acquired_at)

    def seconds(self, reason: RejectReason) -> int:
        """Whole seconds until a slot is likely free, from the observed rate of releases (1..30)."""
        if reason in ("no_nodes", "pool_unavailable"):
            seconds = max(self.settings.stale_after, 1.0)
        elif reason in ("cold_start", "model_loading"):  # a node is still loading: in a while, not at once
            seconds = max(self.settings.cold_start_timeout / 2, 1.0)
        else:
            rate = self.release_rate()
            snapshot = self.pool.snapshot  # (in slots, as the rate is: a waiter may run several generations)
            waiting = max(snapshot.queued_slots, snapshot.queue_depth) + 1
            seconds = waiting / rate if rate > 0 else max(self.settings.queue_timeout, 1.0)
        return min(MAX_S, max(1, math.ceil(seconds)))

    def limited(self, limit: int) -> int:
        """Seconds until one of a tenant's ``limit`` requests is likely done (Little's law on the pool)."""
        rate = self.release_rate()
        busy = self.pool.busy()
        mean_duration = busy / rate if rate > 0 and busy else 1.0
        return min(MAX_S, max(1, math.ceil(mean_duration / max(limit, 1))))

    def release_rate(self) -> float:
        """Slots freed per second pool-wide: the rate observed over the last 30 s, or - when more - the busy
        slots over the mean time this replica's recent requests held theirs (Little's law).

        The observed rate alone lags: at the start of a burst after a quiet spell the window holds a
        release or two spread over 30 s, and (queue + 1) / rate would come out at the clamp for a pool whose
        slots were freeing every second.
        """
        observed = self.pool.freed.rate()
        if not self.recent_holds:
            return observed
        busy, held = self.pool.busy(), statistics.fmean(self.recent_holds)
        return max(observed, busy / held) if busy and held > 0 else observed
