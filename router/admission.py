"""Admission: reserve a slot atomically in Redis, or wait in the bounded global queue, or reject.

The admitted path costs two Redis round trips in all: the reservation (one EVALSHA) and the release.
Live leases are renewed by one loop for the whole process, not one task per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import anyio
from redis.asyncio import Redis

from macpool.contract import LEAVE_QUEUE, RELEASE, RENEW, RESERVE_OR_ENQUEUE, Keys, NodeDoc, now_ms
from router.loops import every
from router.metrics import RouterMetrics
from router.pool import PoolView
from router.settings import Settings

log = logging.getLogger("macpool.router")

RejectReason = Literal["pool_full", "queue_timeout", "no_nodes", "pool_unavailable"]

# A queued request re-checks on its own this often even if no `freed` message arrives (a message lost
# during a pub/sub reconnect, or capacity that appeared through a new heartbeat rather than a release).
SAFETY_RECHECK_S = 0.5


class Rejected(Exception):
    """The pool cannot take the request now; the client should retry after ``retry_after`` seconds."""

    def __init__(self, reason: RejectReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after = 1


@dataclass(eq=False)
class Lease:
    """One reserved slot on one node, held until released exactly once."""

    request_id: str
    node: NodeDoc
    acquired_at: float = field(default_factory=time.monotonic)
    released: bool = False
    queued_s: float = 0.0
    local: bool = False  # taken while Redis was unreachable: counted by this router only


@dataclass(eq=False)
class _Waiter:
    nodes: set[str]
    woken: asyncio.Event = field(default_factory=asyncio.Event)


class Admission:
    def __init__(
        self, settings: Settings, redis: Redis, keys: Keys, pool: PoolView, metrics: RouterMetrics
    ) -> None:
        self.settings = settings
        self.redis = redis
        self.keys = keys
        self.pool = pool
        self.metrics = metrics
        self.lease_ms = max(int(settings.lease_seconds * 1000), 1)
        self.active: dict[str, Lease] = {}
        self._waiters: deque[_Waiter] = deque()
        self._reserve = redis.register_script(RESERVE_OR_ENQUEUE)
        self._release = redis.register_script(RELEASE)
        self._renew = redis.register_script(RENEW)
        self._leave = redis.register_script(LEAVE_QUEUE)
        self._renewer: asyncio.Task[None] | None = None
        pool.freed_listeners.append(self.wake)

    # --- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> None:
        interval = self.settings.lease_seconds / 3
        self._renewer = asyncio.create_task(every(interval, self.renew_all, "lease renewal"))

    async def stop(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewer
            self._renewer = None

    # --- acquire / release -------------------------------------------------------------------------

    async def acquire(self, candidates: Callable[[], list[NodeDoc]]) -> Lease:
        """Reserve a slot on the least-utilised candidate, queueing up to ``queue_timeout`` if none is free.

        ``candidates`` is re-evaluated on every attempt (the pool view changes while a request waits);
        it may raise NoNodes / ModelNotFound. Raises :class:`Rejected` when the pool cannot take it.
        """
        request_id = f"{self.settings.router_id}:{uuid.uuid4().hex}"
        docs = candidates()
        status, node_id, count = await self._try(request_id, docs, dequeue=False)
        if status == "reserved":
            return self._lease(request_id, docs, node_id, count)
        if status == "offline":
            return self._local_lease(request_id, docs)
        if status == "full":
            raise self.reject("pool_full", "every node is at capacity and the queue is full")
        return await self._wait(request_id, candidates, docs)

    async def _wait(
        self, request_id: str, candidates: Callable[[], list[NodeDoc]], docs: list[NodeDoc]
    ) -> Lease:
        started = time.monotonic()
        deadline = started + self.settings.queue_timeout
        waiter = _Waiter(nodes={doc.node_id for doc in docs})
        self._waiters.append(waiter)
        admitted = False
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise self.reject("queue_timeout", "no slot freed up within the queue timeout")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(waiter.woken.wait(), min(remaining, SAFETY_RECHECK_S))
                waiter.woken.clear()
                docs = candidates()
                waiter.nodes = {doc.node_id for doc in docs}
                status, node_id, count = await self._try(request_id, docs, dequeue=True)
                if status == "offline":
                    admitted = True
                    return self._local_lease(request_id, docs)
                if status == "reserved":
                    admitted = True
                    waited = time.monotonic() - started
                    self.metrics.queue_wait.observe(waited)
                    lease = self._lease(request_id, docs, node_id, count)
                    lease.queued_s = waited
                    return lease
                if status == "full":  # our queue entry expired and others took the room
                    raise self.reject("pool_full", "every node is at capacity and the queue is full")
        finally:
            with contextlib.suppress(ValueError):
                self._waiters.remove(waiter)
            if not admitted:
                await self._leave_queue(request_id)

    async def release(self, lease: Lease) -> None:
        """Give the slot back (exactly once; safe to call again, and from a cancelled task)."""
        if lease.released:
            return
        lease.released = True
        self.active.pop(lease.request_id, None)
        if lease.local:
            self.pool.freed.mark()
            return
        node_id = lease.node.node_id
        with anyio.move_on_after(5, shield=True):
            try:
                await self._release(
                    keys=[self.keys.reservations(node_id), self.keys.events], args=[lease.request_id, node_id]
                )
            except Exception as exc:  # the lease expires on its own
                log.warning("release of %s on %s failed (%s); the lease will expire", lease.request_id,
                            node_id, type(exc).__name__)

    def reject(self, reason: RejectReason, message: str) -> Rejected:
        rejected = Rejected(reason, message)
        rejected.retry_after = self.retry_after(reason)
        return rejected

    def retry_after(self, reason: RejectReason) -> int:
        """Whole seconds until a slot is likely free, from the observed rate of releases (1..30)."""
        if reason in ("no_nodes", "pool_unavailable"):
            seconds = max(self.settings.stale_after, 1.0)
        else:
            rate = self.pool.freed.rate()
            waiting = self.pool.snapshot.queue_depth + 1
            seconds = waiting / rate if rate > 0 else max(self.settings.queue_timeout, 1.0)
        return min(30, max(1, math.ceil(seconds)))

    # --- queue wake-up -----------------------------------------------------------------------------

    def wake(self, node_id: str) -> None:
        """A slot was freed on ``node_id``: wake the oldest waiter that could use it."""
        for waiter in self._waiters:
            if not waiter.woken.is_set() and (node_id in waiter.nodes or not waiter.nodes):
                waiter.woken.set()
                return

    # --- renewal -----------------------------------------------------------------------------------

    async def renew_all(self) -> None:
        leases = [lease for lease in self.active.values() if not lease.local]
        if not leases:
            return
        expiry = now_ms() + self.lease_ms
        async with self.redis.pipeline(transaction=False) as pipe:
            for lease in leases:
                await self._renew(
                    keys=[self.keys.reservations(lease.node.node_id)],
                    args=[lease.request_id, expiry, self.lease_ms],
                    client=pipe,
                )
            results = await pipe.execute()
        for lease, result in zip(leases, results, strict=True):
            if not result and not lease.released:
                log.warning("lease %s on %s had already expired", lease.request_id, lease.node.node_id)

    # --- Redis calls -------------------------------------------------------------------------------

    async def _try(self, request_id: str, docs: list[NodeDoc], dequeue: bool) -> tuple[str, str, int]:
        args: list[str | int | float] = [
            self.keys.prefix, now_ms(), self.lease_ms, request_id, self.settings.queue_size, 1, int(dequeue),
        ]
        for doc in docs:
            args += [doc.node_id, doc.tokens_per_s, random.random()]
        try:
            raw = await self._reserve(args=args)
        except Exception as exc:
            log.warning("reservation failed: %s: %s", type(exc).__name__, exc)
            if self.pool.redis_ok:
                # one failed call is not an outage (the pool view's refresh decides that, every second):
                # admitting past Redis now would let replicas over-fill a node they cannot see
                message = "the pool's coordination store did not answer"
                raise self.reject("pool_unavailable", message) from None
            return "offline", "", 0
        status, node_id, count = (_text(raw[0]), _text(raw[1]), int(raw[2]))
        if status == "queued":
            self.pool.snapshot.queue_depth = count
        return status, node_id, count

    def _local_lease(self, request_id: str, docs: list[NodeDoc]) -> Lease:
        """Redis is unreachable: admit from the last pool view, counting only this router's own leases.

        Other replicas cannot be seen meanwhile; each agent's hard cap refuses what would overfill its Mac
        (503 node_full), and the request then fails over to another node.
        """
        mine: dict[str, int] = {}
        for lease in self.active.values():
            mine[lease.node.node_id] = mine.get(lease.node.node_id, 0) + 1
        free = [doc for doc in docs if mine.get(doc.node_id, 0) < doc.capacity]
        if not free:
            raise self.reject("pool_full", "every node is at capacity (coordination store unreachable)")
        node = min(free, key=lambda d: (mine.get(d.node_id, 0) / d.capacity, random.random()))
        lease = Lease(request_id=request_id, node=node, local=True)
        self.active[request_id] = lease
        return lease

    def _lease(self, request_id: str, docs: list[NodeDoc], node_id: str, count: int) -> Lease:
        node = next(doc for doc in docs if doc.node_id == node_id)
        lease = Lease(request_id=request_id, node=node)
        self.active[request_id] = lease
        self.pool.reserved(node_id, count)
        return lease

    async def _leave_queue(self, request_id: str) -> None:
        with anyio.move_on_after(5, shield=True):
            try:
                await self._leave(keys=[self.keys.queue], args=[request_id])
            except Exception as exc:  # the queue entry expires on its own
                log.warning("leaving the queue failed: %s", type(exc).__name__)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
