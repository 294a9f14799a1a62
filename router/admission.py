"""Admission: reserve a slot atomically in Redis, or wait in the bounded global queue, or reject.

The admitted path costs two Redis round trips in all: the reservation (one EVALSHA, which also applies
prefix affinity, the queue order and the per-key limit) and the release (which hands the slot straight to
the first queued request that node can serve). Live leases are renewed by one loop for the whole process,
not one task per request. Every Redis call goes through the store (macpool/store). The leases this router
holds and gives back are router/leases.py, its waiting requests router/waiters.py, the memo of a "full"
answer router/full_memo.py, Retry-After router/retry_after.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import statistics
import time
import uuid
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import anyio
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from macpool.contract import NodeDoc, Priority, slots_needed
from macpool.loops import raise_if_cancelled, wait_event
from macpool.store import (
    ANONYMOUS,
    Candidate,
    Reservation,
    ReserveRequest,
    Store,
)
from router.full_memo import FullMemo
from router.leases import Lease as Lease  # (callers take Lease from here, with Admission)
from router.leases import Leases
from router.metrics import RouterMetrics
from router.placement import BATCH_COST, PREFILL_HALVING_DEPTH, STRATEGIES
from router.pool import PoolView
from router.retry_after import RejectReason, RetryAfter
from router.settings import Settings
from router.waiters import Waiters

log = logging.getLogger("macpool.router")

# A queued request re-checks on its own this often even if no `freed` message arrives (a message lost
# during a pub/sub reconnect, or capacity that appeared through a new heartbeat rather than a release).
SAFETY_RECHECK_S = 0.5
FULL_MESSAGE = "every node is at capacity and the queue is full"


class Rejected(Exception):
    """The pool cannot take the request now; the client should retry after ``retry_after`` seconds."""

    def __init__(self, reason: RejectReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after = 1


class Limited(Exception):
    """The tenant (API key) has its maximum of requests in flight; 429, retry after ``retry_after`` s."""

    def __init__(self, tenant: str, limit: int, retry_after: int) -> None:
        super().__init__(f"this API key already has {limit} requests in flight or queued (its limit)")
        self.tenant = tenant
        self.retry_after = retry_after


@dataclass(frozen=True)
class Ticket:
    """Who asks, how urgently, and for what prompt: what admission needs besides the candidates."""

    tenant: str = ANONYMOUS
    priority: Priority = "interactive"
    key_limit: int = 0  # requests in flight + queued for this tenant (0: no limit)
    model: str = ""
    prefixes: tuple[str, ...] = ()  # prompt-prefix hashes, longest first (router/affinity.py)
    prefix_shares: tuple[float, ...] = ()  # the share of the prompt each covers
    # run at once by llama-server, each in a slot (several prompts, n > 1: macpool/contract.py generations);
    # such a request's candidates are the nodes large enough, so its "full" says nothing of the others
    generations: int = 1
    # its prompt (router/tokens.py: a bound, or a node's exact count; 0: not counted) and its own output
    # limit (0: none): what it holds of a node's KV cache
    prompt_tokens: int = 0
    output_tokens: int = 0


# the prompt speed assumed of a node that has measured none yet: a slow Mac's, so a wait is not cut short
ASSUMED_PREFILL_TOKENS_PER_S = 200.0


def prefill_seconds(prompt_tokens: int, docs: Collection[NodeDoc]) -> float:
    """How long ``prompt_tokens`` take to process on the fastest of ``docs``, as measured (or assumed)."""
    if not prompt_tokens:
        return 0.0
    rates = [doc.prefill_tokens_per_s or ASSUMED_PREFILL_TOKENS_PER_S for doc in docs]
    return prompt_tokens / max(rates, default=ASSUMED_PREFILL_TOKENS_PER_S)


class Admission:
    def __init__(
        self, settings: Settings, store: Store, pool: PoolView, metrics: RouterMetrics
    ) -> None:
        self.settings = settings
        self.store = store
        self.pool = pool
        self.metrics = metrics
        self.batch_queue_max = int(settings.queue_size * settings.batch_queue_share)
        self.waiters = Waiters()
        # this replica's recent queue waits, for the dashboard: (priority, tenant, seconds)
        self.recent_waits: deque[tuple[str, str, float]] = deque(maxlen=512)
        self.retry_after = RetryAfter(settings, pool)
        self.leases = Leases(settings, store, pool, self.retry_after)
        self.active = self.leases.active  # request id -> the lease it holds
        self.affinity_counts: dict[str, int] = dict.fromkeys(("hit", "miss", "overridden"), 0)
        self.full = FullMemo(lambda: pool.version)
        self.place = STRATEGIES[settings.placement]  # a node as a candidate, weighed as --placement says
        pool.freed_listeners.append(self.waiters.wake)
        pool.waiter_listeners.append(self.waiters.wake_request)
        pool.grown_listeners.append(self._node_grew)
        self._offers: set[asyncio.Task[None]] = set()

    # --- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> None:
        self.leases.start()

    async def settle(self, within: float) -> None:
        """Wait (up to ``within`` seconds) until no request holds a lease or a queue place and no release is
        on its way: at shutdown, the requests the server has just cancelled give them back in their own
        cleanup, which needs Redis still open."""
        deadline = time.monotonic() + within
        while (self.leases.busy() or self.waiters) and time.monotonic() < deadline:  # noqa: ASYNC110 (once, at shutdown)
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        for task in self._offers:
            task.cancel()
        await asyncio.gather(*self._offers, return_exceptions=True)
        await self.leases.stop()

    def _node_grew(self, node_id: str) -> None:
        """A node shows free slots no release announced: while requests wait here, have them handed over
        (each router with waiters asks; the script hands over only slots still free)."""
        if not self.waiters:
            return
        task = asyncio.get_running_loop().create_task(self._offer(node_id))
        self._offers.add(task)
        task.add_done_callback(self._offers.discard)

    async def _offer(self, node_id: str) -> None:
        try:
            await self.store.offer(node_id)
        except RedisError as exc:  # the waiters still look for themselves (SAFETY_RECHECK_S)
            log.warning("handing node %s's new slots to the queue failed: %s", node_id, exc)

    # --- acquire / release -------------------------------------------------------------------------

    async def acquire(
        self,
        candidates: Callable[[], list[NodeDoc]],
        ticket: Ticket | None = None,
        tried: Collection[str] = (),
    ) -> Lease:
        """Reserve a slot (on the node holding the prompt's prefix, or the least-utilised candidate),
        queueing up to ``queue_timeout`` if none is free.

        ``candidates`` is re-evaluated on every attempt (the pool view changes while a request waits);
        it may raise NoNodes / ModelNotFound. ``tried`` are nodes the request failed on already: like nodes
        whose circuit is open here, a waiting request is not handed their slots (nor holds them back from
        others). Raises :class:`Rejected` when the pool cannot take it and :class:`Limited` when the ticket's
        tenant is at its concurrency limit.
        """
        ticket = ticket or Ticket()
        docs = candidates()
        if self.full.knows_full(ticket.model):
            raise self.reject("pool_full", FULL_MESSAGE)
        if not docs:  # none of the model's nodes can run it now (too small for its generations, or tried)
            raise self.reject("pool_full", "no node that could run this request is ready for it")
        request_id = f"{self.settings.router_id}:{uuid.uuid4().hex}"
        # a "full" that lapsed by age: this request asks Redis again for every request of the model
        with self.full.asking(ticket.model) as asked_again:
            attempt = await self._try(request_id, docs, ticket, tried, dequeue=False)
        # (a batch request's "full" may leave room for an interactive one, which displaces queued batch)
        anywhere = ticket.priority == "interactive" and ticket.generations == 1
        full = anywhere and attempt is not None and attempt.status == "full"
        self.full.answered(ticket.model, full, asked_again)
        if attempt is None:
            return self._local_lease(request_id, docs, ticket)
        if attempt.status == "reserved":
            return self._lease(request_id, docs, attempt, ticket)
        self.refuse(attempt, ticket)
        return await self._wait(request_id, candidates, docs, ticket, tried)

    async def _wait(
        self,
        request_id: str,
        candidates: Callable[[], list[NodeDoc]],
        docs: list[NodeDoc],
        ticket: Ticket,
        tried: Collection[str],
    ) -> Lease:
        started = time.monotonic()
        deadline = started + self.patience(ticket, docs)
        waiter = self.waiters.add(request_id, {doc.node_id for doc in docs})
        admitted = False
        try:
            while True:
                raise_if_cancelled()  # a client gone while a Redis call ran: leave the queue now
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise self.reject("queue_timeout", "no slot freed up within the queue timeout")
                await wait_event(waiter.woken, min(remaining, SAFETY_RECHECK_S))
                waiter.woken.clear()
                docs = candidates()
                waiter.nodes = {doc.node_id for doc in docs}
                attempt = await self._try(request_id, docs, ticket, tried, dequeue=True)
                if attempt is None:
                    admitted = True
                    return self._local_lease(request_id, docs, ticket)
                if attempt.status == "reserved":
                    admitted = True
                    waited = time.monotonic() - started
                    labels = {"priority": ticket.priority, "tenant": ticket.tenant}
                    self.metrics.queue_wait.labels(**labels).observe(waited)
                    self.recent_waits.append((ticket.priority, ticket.tenant, waited))
                    lease = self._lease(request_id, docs, attempt, ticket)
                    lease.queued_s = waited
                    return lease
                self.refuse(attempt, ticket)  # shed, limited, or our entry expired and others took the room
        finally:
            self.waiters.remove(waiter)
            if not admitted:
                # (a waiter running several generations: the free slots its nodes held back for it go on)
                await self._leave_queue(request_id, sorted(waiter.nodes) if ticket.generations > 1 else [])

    def patience(self, ticket: Ticket, docs: list[NodeDoc]) -> float:
        """How long a request may wait in the queue: ``--queue-timeout``, and as long again as its own prompt
        takes to process on the fastest of its nodes - a coding agent's turn, whose prefill takes a minute,
        may wait for a slot about as long as it will wait for its first token anyway."""
        return self.settings.queue_timeout + prefill_seconds(ticket.prompt_tokens, docs)

    def remembers_full(self) -> bool:
        """Whether a "full" answer is remembered for some model (it may have lapsed since)."""
        return self.full.remembers()

    def known_full(self, model: str) -> bool:
        """Whether arrivals for ``model`` are refused from memory (router/full_memo.py)."""
        return self.full.knows_full(model)

    def refuse(self, attempt: Reservation, ticket: Ticket) -> None:
        """Raise for every outcome but ``queued``."""
        if attempt.status == "full":
            raise self.reject("pool_full", FULL_MESSAGE)
        if attempt.status == "shed":
            raise self.reject("batch_shed", "the pool is saturated: batch requests are shed first")
        if attempt.status == "limited":
            raise Limited(ticket.tenant, ticket.key_limit, self.retry_after.limited(ticket.key_limit))

    async def release(self, lease: Lease, failed: bool = False) -> None:
        """Give the slot back, exactly once (router/leases.py)."""
        await self.leases.release(lease, failed)

    def reject(self, reason: RejectReason, message: str) -> Rejected:
        rejected = Rejected(reason, message)
        rejected.retry_after = self.retry_after.seconds(reason)
        return rejected

    # --- reporting ---------------------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        """This replica's affinity hit rate, recent queue waits by priority and tenant, and the prompts it
        sent each node that the node should still be processing, in seconds (for /api/pool)."""
        counts = self.affinity_counts
        looked_up = sum(counts.values())
        waits: dict[str, dict[str, list[float]]] = {"priority": {}, "tenant": {}}
        for priority, tenant, seconds in self.recent_waits:
            waits["priority"].setdefault(priority, []).append(seconds)
            waits["tenant"].setdefault(tenant, []).append(seconds)
        return {
            "affinity": {
                "enabled": self.settings.affinity,
                **counts,
                "hit_rate": round(counts["hit"] / looked_up, 4) if looked_up else None,
            },
            "queue_wait_p50_ms": {
                group: {name: round(statistics.median(values) * 1000, 1) for name, values in by.items()}
                for group, by in waits.items()
            },
            "prefill_backlog_s": {
                doc.node_id: round(seconds, 1) for doc in self.pool.fresh_nodes()
                if (seconds := self.leases.backlog_s(doc))
            },
        }

    # --- Redis calls -------------------------------------------------------------------------------

    async def _try(
        self, request_id: str, docs: list[NodeDoc], ticket: Ticket, tried: Collection[str], dequeue: bool
    ) -> Reservation | None:
        """One reservation attempt; None when Redis is unreachable (the router admits from its own view)."""
        settings = self.settings
        # a prompt's prefill weighs on every candidate or on none: one node not measured yet would look free
        prompt = ticket.prompt_tokens if all(doc.prefill_tokens_per_s for doc in docs) else 0
        request = ReserveRequest(
            request_id, [self._candidate(doc, prompt) for doc in docs],
            self.leases.lease_ms,
            queue_size=settings.queue_size, enqueue=True, dequeue=dequeue, priority=ticket.priority,
            tenant=ticket.tenant, model=ticket.model, key_limit=ticket.key_limit,
            batch_queue_max=self.batch_queue_max,
            prefixes=ticket.prefixes if settings.affinity else (),
            prefix_shares=ticket.prefix_shares if settings.affinity else (),
            affinity_abs=settings.affinity_abs_threshold, affinity_rel=settings.affinity_rel_threshold,
            affinity_max_entries=settings.affinity_max_entries, excluded=self._excluded(tried),
            session_window_ms=int(settings.session_ttl * 1000),
            generations=ticket.generations, router=settings.router_id, batch_cost=BATCH_COST,
            prompt_tokens=ticket.prompt_tokens, output_tokens=ticket.output_tokens,
            prefill_halving=PREFILL_HALVING_DEPTH if prompt else 0.0,
        )
        try:
            attempt = await self.store.reserve(request)
        except asyncio.CancelledError:
            # the client left while the script was on its way: it may have reserved a slot all the same,
            # which nobody would hold (or renew) - it is given back, on whichever candidate it was taken
            self.leases.give_back(request_id, [doc.node_id for doc in docs], ticket.tenant)
            raise
        except Exception as exc:
            log.warning("reservation failed: %s: %s", type(exc).__name__, exc)
            if isinstance(exc, RedisTimeoutError):
                # written, but Redis did not answer in time: the script may still run once Redis goes on (its
                # connection dropped, so the give-back waits for Redis and goes twice: see _undo)
                self.leases.give_back(request_id, [doc.node_id for doc in docs], ticket.tenant, dropped=True)
            if self.pool.redis_ok:
                # one failed call is not an outage (the pool view's refresh decides that, every second):
                # admitting past Redis now would let replicas over-fill a node they cannot see
                message = "the pool's coordination store did not answer"
                raise self.reject("pool_unavailable", message) from None
            return None
        if attempt.status == "queued":
            self.pool.snapshot.queue_depth = attempt.count
        if attempt.affinity:
            self.affinity_counts[attempt.affinity] += 1
            self.metrics.affinity.labels(outcome=attempt.affinity).inc()
        return attempt

    def _candidate(self, doc: NodeDoc, prompt_tokens: int) -> Candidate:
        """``doc`` weighed as ``--placement`` says; where prompts count (their speed is known everywhere),
        with the prompts this router sent it that it is still processing."""
        candidate = self.place(doc, self.settings.placement_tokens, prompt_tokens)
        if not prompt_tokens or not candidate.prefill_s:
            return candidate
        backlog = self.leases.backlog_s(doc)
        return dataclasses.replace(candidate, backlog_s=backlog) if backlog else candidate

    def _excluded(self, tried: Collection[str]) -> list[str]:
        """The nodes a request is not sent to: those it failed on, and those whose circuit is open here."""
        circuits = self.pool.circuits
        if not tried and not circuits:
            return []
        return sorted({*tried, *(node_id for node_id in circuits if not self.pool.circuit_allows(node_id))})

    def _local_lease(self, request_id: str, docs: list[NodeDoc], ticket: Ticket) -> Lease:
        """Redis is unreachable: admit from the last pool view, counting only this router's own leases.

        Other replicas cannot be seen meanwhile; each agent's hard cap refuses what would overfill its Mac
        (503 node_full), and the request then fails over to another node.
        """
        mine: dict[str, int] = {}
        for lease in self.active.values():
            mine[lease.node.node_id] = mine.get(lease.node.node_id, 0) + lease.slots
        need = {doc.node_id: slots_needed(ticket.generations, doc.total_slots) for doc in docs}
        free = [doc for doc in docs if mine.get(doc.node_id, 0) + need[doc.node_id] <= doc.capacity]
        if not free:
            raise self.reject("pool_full", "every node is at capacity (coordination store unreachable)")
        node = min(free, key=lambda d: (mine.get(d.node_id, 0) / d.capacity, random.random()))
        return self.leases.hold(Lease(request_id, node, ticket.tenant, slots=need[node.node_id], local=True))

    def _lease(self, request_id: str, docs: list[NodeDoc], attempt: Reservation, ticket: Ticket) -> Lease:
        node_id = attempt.node_id
        node = next(doc for doc in docs if doc.node_id == node_id)
        lease = Lease(request_id=request_id, node=node, tenant=ticket.tenant, slots=attempt.slots,
                      tokens=attempt.tokens, affinity=attempt.affinity,
                      prefill_tokens=round(ticket.prompt_tokens * (1 - attempt.cached)),
                      prefill_from=round(ticket.prompt_tokens * attempt.cached))
        self.leases.hold(lease)
        self.pool.reserved(node_id, attempt.count)
        return lease

    async def _leave_queue(self, request_id: str, nodes: list[str]) -> None:
        with anyio.move_on_after(5, shield=True):
            try:
                await self.store.leave_queue(request_id, nodes)
            except Exception as exc:  # the queue entry expires on its own
                log.warning("leaving the queue failed: %s", type(exc).__name__)

