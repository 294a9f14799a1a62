"""Scale to zero, and models loaded on demand: a request for a model no ready node serves waits while a
node loads it.

The request takes a place in the pool's queue (no candidates: it only counts as demand, which the autoscaler
reads), bounded as any queued request is - by ``--queue-size`` (503 pool_full, batch_shed) and by its key's
limit (429) - and waits up to ``--cold-start-timeout`` for a node of its model to be ready; then it goes
through admission as any other request. With ``--load-on-demand`` (the default) it also asks the standby
node of its model that would load it soonest to load it (its last load time, then the most capacity), once
for every router: the first waiting request sets ``{p}loading:{model}`` for the timeout, and the others see
it.
An ask is over once its node, seen loading or serving since, is back in standby (it unloaded the model when
idle, or refused the load), or has stayed in standby for a few seconds: then the model is asked for again
rather than waited for until the marker lapses.
A model the pool declares (``macpool models add``) that no Mac serves yet - one is downloading it, or is
about to take it - is waited for the same way.
Past the timeout it is a 503 with a Retry-After: ``model_loading`` when a load was asked for or the pool
declares the model (it is on its way), ``cold_start`` when only the autoscaler could act (Macs asleep, or
load on demand off).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass

from macpool.contract import LOAD_COST_ORDER, NodeDoc
from macpool.store import ReserveRequest
from macpool.store.elastic import ElasticStore, LoadAsk
from router.admission import Admission, Ticket
from router.pool import ModelNotFound, NoNodes, PoolView
from router.settings import Settings

log = logging.getLogger("macpool.router")

# the states of an elastic node that become "ready" without anyone but the autoscaler acting
WARMING_STATES = ("standby", "asleep", "waking", "loading", "draining-to-standby", "starting", "downloading")
POLL_S = 0.05  # the pool view is in memory: looking costs nothing
RENEW_S = 1.0  # the queue place's lease is 3 s (macpool/store QUEUE_LEASE_MS)
# how long an asked node may stay in standby before the ask counts as over (its heartbeats say it is
# loading within one or two intervals of the ask)
ASK_GRACE_S = 5.0


@dataclass
class _Seen:
    """A load ask this router found in the loading marker: when first seen, and whether its node has been
    seen out of standby since (loading the model, or serving it)."""

    ask: LoadAsk
    first_seen: float
    busy: bool = False


class ColdStart:
    def __init__(self, settings: Settings, pool: PoolView, admission: Admission) -> None:
        self.settings = settings
        self.pool = pool
        self.admission = admission
        self.elastic = ElasticStore(admission.store.redis, admission.store.keys)
        self._asks: dict[str, _Seen] = {}  # model -> the last ask seen in its loading marker

    def ready(self, model: str) -> bool:
        try:
            return bool(self.pool.candidates(model))
        except (NoNodes, ModelNotFound):
            return False

    def needed(self, model: str) -> bool:
        """No node of ``model`` is ready, and an elastic one in the pool would be once loaded - or the pool
        declares the model (``macpool models``): a Mac will take it, download it and load it."""
        if self.settings.cold_start_timeout <= 0 or self.ready(model):
            return False
        return self.declared(model) or any(self._warms(doc, model) for doc in self.pool.fresh_nodes())

    def declared(self, model: str) -> bool:
        """The pool declares ``model`` and is not removing it."""
        declared = self.pool.snapshot.declared.get(model)
        return declared is not None and not declared.removing

    @staticmethod
    def _warms(doc: NodeDoc, model: str) -> bool:
        return doc.elastic and doc.state in WARMING_STATES and (not model or model in doc.models)

    async def wait(self, ticket: Ticket) -> None:
        """Until a node of the ticket's model is ready. Meanwhile the request holds a place in the pool's
        queue, so the queue's bound and its key's limit hold for it as for any waiting request: Rejected
        (pool_full, batch_shed) or Limited as they would be; Rejected too past the cold-start timeout."""
        started = time.monotonic()
        deadline = started + self.settings.cold_start_timeout
        rid = f"{self.settings.router_id}:cold:{uuid.uuid4().hex}"
        renew_at = started
        log.info("no ready node serves %r: waiting up to %.0fs for one to load", ticket.model,
                 self.settings.cold_start_timeout)
        # a load of the model was asked for (by this request or another), or the pool declares it: it is on
        # its way
        asked = self.declared(ticket.model)
        try:
            # (until ready, or until nothing would make it ready: its nodes gone, the pool not declaring it)
            while self.needed(ticket.model):
                now = time.monotonic()
                if now >= deadline:
                    if asked:
                        raise self.admission.reject(
                            "model_loading", f"model {ticket.model!r} is loading; it was not ready within "
                            f"the cold-start timeout ({self.settings.cold_start_timeout:.0f}s)")
                    raise self.admission.reject(
                        "cold_start", f"no node of {ticket.model or 'the pool'!r} was ready within the "
                        f"cold-start timeout ({self.settings.cold_start_timeout:.0f}s); one is loading")
                if now >= renew_at:
                    # the load first: a request the queue has no room for still has its model loaded for
                    # when it comes back
                    asked = await self._load(ticket.model) or asked
                    await self._queue(rid, ticket, again=renew_at > started)
                    renew_at = now + RENEW_S
                elif not asked and self.loader(ticket.model) is not None:
                    # a node that could load it appeared (a Mac's busy models went idle): ask now, not at
                    # the next renewal (the check is the pool view in memory; Redis only when it holds)
                    asked = await self._load(ticket.model)
                await asyncio.sleep(min(POLL_S, deadline - now))
        finally:
            with contextlib.suppress(Exception):
                await asyncio.shield(self.admission.store.leave_queue(rid))

    def loader(self, model: str) -> NodeDoc | None:
        """The standby node of ``model`` that would serve it soonest: one whose Mac has the memory free,
        then one that must evict idle models first; among those the shortest last load (one never seen
        loading after those seen), then the most capacity, then the lowest id. None when none is in standby
        (a Mac asleep is the autoscaler's to wake) or every one's memory is held by busy models."""
        standby = [doc for doc in self.pool.fresh_nodes()
                   if doc.elastic and doc.state == "standby" and model in doc.models
                   and doc.load_cost != "full" and doc.node_id not in self.pool.snapshot.drained]

        def cost(doc: NodeDoc) -> tuple[int, bool, float, int, str]:
            load_s = next((m.load_s for m in doc.model_states if m.name == model and m.load_s is not None),
                          None)
            return (LOAD_COST_ORDER[doc.load_cost], load_s is None, load_s or 0.0, -doc.standby_capacity,
                    doc.node_id)

        return min(standby, key=cost, default=None)

    def _over(self, model: str, ask: LoadAsk) -> bool:
        """Whether the ask in the loading marker is over: its node was seen loading (or serving) since and
        is back in standby - it loaded the model and unloaded it, or refused the load - or it has stayed
        in standby, or gone, for ``ASK_GRACE_S`` since this router first saw the ask."""
        now = time.monotonic()
        seen = self._asks.get(model)
        if seen is None or seen.ask != ask:
            seen = self._asks[model] = _Seen(ask, now)
        doc = next((d for d in self.pool.fresh_nodes() if d.node_id == ask.node_id), None)
        if doc is not None and doc.state != "standby":
            seen.busy = True
            return False
        return seen.busy or now - seen.first_seen > ASK_GRACE_S

    async def _load(self, model: str) -> bool:
        """Ask a standby node to load ``model`` unless one was asked already; whether a load is asked for."""
        if not self.settings.load_on_demand or not model:
            return False
        try:
            ask = await self.elastic.loading(model)
            if ask is not None and not self._over(model, ask):
                return True
            node = self.loader(model)
            if node is None:
                return False
            hold_ms = int(self.settings.cold_start_timeout * 1000)
            if await self.elastic.load_once(model, node.node_id, hold_ms, over=ask):
                log.info("asked %s to load %r for the requests waiting for it", node.node_id, model,
                         extra={"node": node.node_id})
            return True
        except Exception as exc:  # the wait goes on: the autoscaler may still load it
            log.warning("load on demand of %r failed: %s: %s", model, type(exc).__name__, exc)
            return False

    async def _queue(self, rid: str, ticket: Ticket, again: bool) -> None:
        """Take (or keep) a place in the queue: the demand the autoscaler sees, bounded as any request's
        (raises Rejected or Limited when the queue or the key has no room for it)."""
        admission = self.admission
        request = ReserveRequest(
            rid, [], admission.leases.lease_ms, queue_size=self.settings.queue_size, enqueue=True,
            dequeue=again, priority=ticket.priority, tenant=ticket.tenant, model=ticket.model,
            key_limit=ticket.key_limit, batch_queue_max=admission.batch_queue_max,
            generations=ticket.generations,
        )
        try:
            attempt = await admission.store.reserve(request)
        except Exception as exc:  # waiting goes on: the autoscaler also sees the standby nodes' states
            log.warning("cold start: queueing failed: %s: %s", type(exc).__name__, exc)
            return
        admission.refuse(attempt, ticket)
