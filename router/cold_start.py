"""Scale to zero: a request for a model whose every node is in standby waits while one loads.

The request takes a place in the pool's queue (no candidates: it only counts as demand, which the
autoscaler reads and answers by activating a standby node) and waits up to ``--cold-start-timeout`` for
a node of its model to be ready; then it goes through admission as any other request. Past the timeout it
is a 503 with reason ``cold_start`` and a Retry-After.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid

from macpool.contract import NodeDoc
from macpool.store import ReserveRequest
from router.admission import Admission, Rejected, Ticket
from router.pool import ModelNotFound, NoNodes, PoolView
from router.settings import Settings

log = logging.getLogger("macpool.router")

# the states of an elastic node that become "ready" without anyone but the autoscaler acting
WARMING_STATES = ("standby", "asleep", "waking", "loading", "draining-to-standby", "starting")
POLL_S = 0.05  # the pool view is in memory: looking costs nothing
RENEW_S = 1.0  # the queue place's lease is 3 s (macpool/store QUEUE_LEASE_MS)


class ColdStart:
    def __init__(self, settings: Settings, pool: PoolView, admission: Admission) -> None:
        self.settings = settings
        self.pool = pool
        self.admission = admission

    def ready(self, model: str) -> bool:
        try:
            return bool(self.pool.candidates(model))
        except (NoNodes, ModelNotFound):
            return False

    def needed(self, model: str) -> bool:
        """No node of ``model`` is ready, and an elastic one in the pool would be once loaded."""
        if self.settings.cold_start_timeout <= 0 or self.ready(model):
            return False
        return any(self._warms(doc, model) for doc in self.pool.fresh_nodes())

    @staticmethod
    def _warms(doc: NodeDoc, model: str) -> bool:
        return doc.elastic and doc.state in WARMING_STATES and (not model or model in doc.models)

    async def wait(self, ticket: Ticket) -> Rejected | None:
        """Until a node of the ticket's model is ready (None) or the cold-start timeout passes."""
        started = time.monotonic()
        deadline = started + self.settings.cold_start_timeout
        rid = f"{self.settings.router_id}:cold:{uuid.uuid4().hex}"
        renew_at = started
        log.info("no ready node serves %r: waiting up to %.0fs for one to load", ticket.model,
                 self.settings.cold_start_timeout)
        try:
            while not self.ready(ticket.model):
                now = time.monotonic()
                if now >= deadline:
                    return self.admission.reject(
                        "cold_start", f"no node of {ticket.model or 'the pool'!r} was ready within the "
                        f"cold-start timeout ({self.settings.cold_start_timeout:.0f}s); one is loading")
                if now >= renew_at:
                    await self._queue(rid, ticket, again=renew_at > started)
                    renew_at = now + RENEW_S
                await asyncio.sleep(min(POLL_S, deadline - now))
            return None
        finally:
            with contextlib.suppress(Exception):
                await asyncio.shield(self.admission.store.leave_queue(rid))

    async def _queue(self, rid: str, ticket: Ticket, again: bool) -> None:
        """Take (or keep) a place in the queue: the demand the autoscaler sees."""
        request = ReserveRequest(
            rid, [], self.admission.leases.lease_ms, queue_size=self.settings.queue_size, enqueue=True,
            dequeue=again, priority=ticket.priority, tenant=ticket.tenant, model=ticket.model,
            generations=ticket.generations,
        )
        try:
            await self.admission.store.reserve(request)
        except Exception as exc:  # waiting goes on: the autoscaler also sees the standby nodes' states
            log.warning("cold start: queueing failed: %s: %s", type(exc).__name__, exc)
