"""The router's cached view of the pool, kept current by the events channel and a periodic full read.

Requests never read Redis to find candidates: they look at this view. Admission itself is still decided
atomically in Redis (:mod:`router.admission`), so a slightly stale view can only cost a retry, never an
over-admission.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from redis.asyncio import RedisCluster
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_exponential_jitter

from macpool.contract import NODE_STATES, NodeDoc, now_ms
from macpool.loops import every, raise_if_cancelled
from macpool.store import PoolSnapshot, Store
from macpool.store.events import Autoscaled, Drained, Freed, Gone, Granted, Heartbeat, Shed, parse_event
from router.metrics import RouterMetrics
from router.settings import Settings
from router.trust import PENDING, NodeTrust

log = logging.getLogger("macpool.router")

CircuitState = Literal["closed", "open", "half_open"]
# while Redis is away, the events channel is subscribed again from 0.1 s later, doubling to 2 s, with jitter
LISTEN_WAIT = wait_exponential_jitter(multiplier=0.1, max=2.0, jitter=0.1)


class NoNodes(Exception):
    """No fresh, ready node could take the request."""


class ModelNotFound(Exception):
    """Nodes exist, but none of them serves the requested model."""


class RateMeter:
    """Events per second over a sliding window."""

    def __init__(self, window: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.window = window
        self.clock = clock
        self.started = clock()
        self.events: deque[float] = deque()

    def mark(self) -> None:
        now = self.clock()
        self.events.append(now)
        self._trim(now)

    def rate(self) -> float:
        now = self.clock()
        self._trim(now)
        span = min(self.window, max(now - self.started, 1e-3))
        return len(self.events) / span

    def _trim(self, now: float) -> None:
        while self.events and self.events[0] < now - self.window:
            self.events.popleft()


@dataclass
class Circuit:
    """Passive health of one node as seen by this router."""

    state: CircuitState = "closed"
    failures: int = 0
    opened_at: float = 0.0


class PoolView:
    """Nodes, reservations, drained set and queue depth as last heard from Redis."""

    def __init__(self, settings: Settings, store: Store, tenants: list[str] | None = None) -> None:
        self.settings = settings
        self.store = store
        self.redis = store.redis
        self.keys = store.keys
        self.tenants = tenants or []  # whose requests in flight the refresh counts (the configured API keys)
        self.snapshot = PoolSnapshot()  # its nodes: those trusted only
        self.trust = NodeTrust(settings)
        self.untrusted: dict[str, tuple[NodeDoc, str]] = {}  # node id -> its last heartbeat, why refused
        # node id -> the refusal last logged for it: apart from ``untrusted``, which a refresh read before a
        # heartbeat arrived may prune, so that a refusal is logged once
        self._refusals_told: dict[str, str] = {}
        self.redis_ok = False
        self.redis_seen = time.monotonic()  # when Redis last answered a full read
        self._outage_logged = False  # an outage is logged once, when it begins, and once when it ends
        self._subscribed = False  # to the events channel before: a new subscription follows a lost one
        self.heard: dict[str, float] = {}  # node id -> monotonic time its latest heartbeat arrived
        self.circuits: dict[str, Circuit] = {}
        self.freed = RateMeter(window=30.0)
        self.requests = RateMeter(window=10.0)
        self.rejections = RateMeter(window=10.0)
        # bumped by every event that may free room (a release, a hand-over, a node's capacity or state
        # changing, a drain, a full refresh): admission's memo of a "full" answer is good until it changes
        self.version = 0
        self.autoscale: deque[dict[str, Any]] = deque(maxlen=10)  # macpool autoscale's last decisions
        self.freed_listeners: list[Callable[[str], None]] = []  # called with a node id
        self.waiter_listeners: list[Callable[[str], None]] = []  # called with a request id (granted, shed)
        # called with a node id when a heartbeat shows it ready with more capacity than before (just ready,
        # or grown): slots no release will announce
        self.grown_listeners: list[Callable[[str], None]] = []
        self._tasks: list[asyncio.Task[None]] = []

    # --- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        """Read the pool once, then follow it; an unreachable Redis is retried by the loops."""
        await self.refresh()
        self._tasks = [
            asyncio.create_task(self._listen(), name="pool-events"),
            asyncio.create_task(every(self.settings.refresh_interval, self.refresh, "pool refresh", log)),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []

    async def refresh(self) -> None:
        """Re-read the whole pool (catches expired heartbeats and anything pub/sub missed); while Redis is
        unreachable, keep the last view."""
        try:
            snapshot = await self.store.read_pool(self.tenants)
        except Exception as exc:
            self._redis_failed("pool refresh", exc)
            return
        self.redis_ok = True
        self.redis_seen = time.monotonic()
        if self._outage_logged:
            self._outage_logged = False
            log.info("redis at %s answers again; pool view refreshed", self.store.address)
            await self._drop_idle_connections()
        self.version += 1
        self.trust.note_revocations(snapshot.revocations)
        await self.trust.resolve(list(snapshot.nodes.values()))
        for node_id in set(self.untrusted) - set(snapshot.nodes):
            del self.untrusted[node_id]
        for doc in list(snapshot.nodes.values()):
            refusal = self.trust.refusal(doc)
            if refusal is not None:
                self._distrust(doc, refusal)
                del snapshot.nodes[doc.node_id]
                snapshot.reservations.pop(doc.node_id, None)
                snapshot.reserved_tokens.pop(doc.node_id, None)
            else:
                self._trusted(doc)
        for doc in snapshot.nodes.values():
            self._heard(doc)
        self.snapshot = snapshot
        for node_id in list(self.heard):
            if node_id not in snapshot.nodes:
                self._forget(node_id)

    async def _listen(self) -> None:
        """Follow the events channel. A subscription lost after it worked is taken again at once; while Redis
        does not answer, the attempts back off (with jitter)."""
        while True:
            async for attempt in AsyncRetrying(wait=LISTEN_WAIT, retry=retry_if_exception_type(Exception),
                                               before_sleep=self._listen_failed):
                with attempt:
                    await self._follow_events()

    async def _follow_events(self) -> None:
        """One subscription to the events channel, until its connection is lost: an error when it never
        worked (to back off), a return when it did (to subscribe again at once)."""
        working = False
        try:
            async with self.redis.pubsub() as pubsub:
                await pubsub.subscribe(self.keys.events)
                while True:
                    message = await pubsub.get_message(timeout=None)
                    if message is None:
                        continue
                    if message["type"] == "subscribe":
                        # subscribed, by this loop or by redis-py after it reconnected on its own: the
                        # events published while nobody listened are lost, so the pool is read again
                        working = True
                        if self._subscribed:  # again: the connection was lost, Redis may have restarted
                            await self._drop_idle_connections()
                        self._subscribed = True
                        await self.refresh()
                    elif message["type"] == "message":
                        self._on_event(message["data"])
                    raise_if_cancelled()
        except Exception as exc:
            if not working:
                raise
            self._redis_failed("pool events", exc)

    def _listen_failed(self, state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome is not None else None
        if isinstance(exc, Exception):
            self._redis_failed("pool events", exc)

    async def _drop_idle_connections(self) -> None:
        """Close the pooled connections idle since before Redis went away: a restarted Redis closed them, and
        they would stay half-closed until each is next used."""
        if isinstance(self.redis, RedisCluster):
            return  # (each of its nodes' pools replaces a dead connection at its next use)
        try:
            await self.redis.connection_pool.disconnect(inuse_connections=False)
        except Exception as exc:  # (closing a dead connection can fail; the next use replaces it anyway)
            log.debug("closing idle Redis connections: %s: %s", type(exc).__name__, exc)

    def _redis_failed(self, where: str, exc: Exception) -> None:
        """Redis did not answer: one warning per outage (the refresh and the events retry every second)."""
        self.redis_ok = False
        if not self._outage_logged:
            self._outage_logged = True
            log.warning("redis at %s unreachable (%s: %s: %s); routing from the last view of the pool, "
                        "retrying", self.store.address, where, type(exc).__name__, exc)

    def _on_event(self, data: bytes) -> None:
        try:
            self.apply(data.decode())
        except Exception:  # one message that cannot be applied must not end the subscription
            log.exception("pool events: a message could not be applied")

    # --- events ------------------------------------------------------------------------------------

    def apply(self, message: str) -> None:
        """Apply one message of the events channel (macpool/store/events.py)."""
        event = parse_event(message)
        if event is None:
            log.warning("pool events: unreadable message ignored: %.80s", message)
            return
        if isinstance(event, Autoscaled):  # what the autoscaler decided: for the dashboard only
            self.autoscale.append(event.decision)
            return
        if not isinstance(event, Heartbeat):
            self.version += 1
        match event:
            case Heartbeat(doc):
                self._heartbeat(doc)
            case Gone(node_id):
                self._forget(node_id)
                self.untrusted.pop(node_id, None)
                self._refusals_told.pop(node_id, None)
            case Freed(node_id):
                self.freed.mark()
                if self.snapshot.reservations.get(node_id, 0) > 0:
                    self.snapshot.reservations[node_id] -= 1
                for listener in self.freed_listeners:
                    listener(node_id)
            case Granted(request_id, _, slots):  # slots freed and handed straight to a queued request
                for _ in range(slots):
                    self.freed.mark()
                for listener in self.waiter_listeners:
                    listener(request_id)
            case Shed(request_id):
                for listener in self.waiter_listeners:
                    listener(request_id)
            case Drained(node_id, True):
                self.snapshot.drained.add(node_id)
            case Drained(node_id, False):
                self.snapshot.drained.discard(node_id)

    def _heartbeat(self, doc: NodeDoc) -> None:
        refusal = self.trust.refusal(doc)
        if refusal is not None:
            if doc.node_id in self.snapshot.nodes:
                self.version += 1
                self._forget(doc.node_id)
            self._distrust(doc, refusal)
            return
        self._trusted(doc)
        previous = self.snapshot.nodes.get(doc.node_id)
        if previous is None or (previous.capacity, previous.state) != (doc.capacity, doc.state):
            self.version += 1
        self._heard(doc)
        self.snapshot.nodes[doc.node_id] = doc
        self.snapshot.reservations.setdefault(doc.node_id, 0)
        before = previous.capacity if previous is not None and previous.state == "ready" else 0
        if doc.state == "ready" and doc.capacity > before:
            for listener in self.grown_listeners:
                listener(doc.node_id)

    def _distrust(self, doc: NodeDoc, reason: str) -> None:
        """Keep ``doc`` out of the pool; say so once per node and reason."""
        self.untrusted[doc.node_id] = (doc, reason)
        if reason != PENDING and self._refusals_told.get(doc.node_id) != reason:
            self._refusals_told[doc.node_id] = reason
            log.warning("node %s (%s) is not trusted and gets no traffic: %s", doc.node_id, doc.url, reason,
                        extra={"node": doc.node_id})

    def _trusted(self, doc: NodeDoc) -> None:
        self.untrusted.pop(doc.node_id, None)
        if self._refusals_told.pop(doc.node_id, None) is not None:
            log.info("node %s (%s) is trusted again", doc.node_id, doc.url, extra={"node": doc.node_id})

    def reserved(self, node_id: str, count: int) -> None:
        """A reservation answer told us the exact count on a node."""
        if node_id in self.snapshot.nodes:
            self.snapshot.reservations[node_id] = count

    def _heard(self, doc: NodeDoc) -> None:
        previous = self.snapshot.nodes.get(doc.node_id)
        if previous is None or previous.updated_at_ms != doc.updated_at_ms or doc.node_id not in self.heard:
            self.heard[doc.node_id] = time.monotonic()

    def _forget(self, node_id: str) -> None:
        self.snapshot.nodes.pop(node_id, None)
        self.snapshot.reservations.pop(node_id, None)
        self.heard.pop(node_id, None)
        self.circuits.pop(node_id, None)

    # --- choosing ----------------------------------------------------------------------------------

    def fresh_nodes(self) -> list[NodeDoc]:
        # while Redis is unreachable no heartbeat can arrive: judge freshness as of the last good read, so
        # the router keeps serving from its last view (the agents' own caps are the safety net)
        now = time.monotonic() if self.redis_ok else self.redis_seen
        horizon = now - self.settings.stale_after
        return [doc for doc in self.snapshot.nodes.values() if self.heard.get(doc.node_id, 0.0) >= horizon]

    def is_ready(self, doc: NodeDoc) -> bool:
        return doc.state == "ready" and doc.capacity > 0 and doc.node_id not in self.snapshot.drained

    def candidates(self, model: str) -> list[NodeDoc]:
        """Nodes that may take a request for ``model`` ("" = any); raises NoNodes / ModelNotFound."""
        fresh = self.fresh_nodes()
        if not fresh:
            raise NoNodes("no node is in the pool")
        if model and not any(model in doc.models for doc in fresh):
            raise ModelNotFound(model)
        chosen = [
            doc for doc in fresh
            if (not model or model in doc.models) and self.is_ready(doc) and self.circuit_allows(doc.node_id)
        ]
        if not chosen:
            raise NoNodes(f"no ready node serves {model!r}" if model else "no node is ready")
        return chosen

    def models(self) -> list[str]:
        """The models a request can name: those of ready nodes, and of elastic nodes in standby (a request
        for one waits while a node loads it: router/cold_start.py)."""
        return list(self.model_states())

    def model_states(self) -> dict[str, dict[str, Any]]:
        """For each model a request can name (``models``): how many ready nodes serve it, how many elastic
        nodes would once loaded, how many are downloading it (and how far the furthest is), and the slots
        of the ready ones, free and in all; a model the pool declares (``macpool models``) that no node
        has yet is ``declared``, with its replicas."""
        out: dict[str, dict[str, Any]] = {}

        def entry(model: str) -> dict[str, Any]:
            return out.setdefault(model, {"loaded_on": 0, "loadable_on": 0, "downloading_on": 0, "slots": 0,
                                          "free_slots": 0})

        for doc in self.fresh_nodes():
            ready = self.is_ready(doc)
            if not ready and not doc.elastic:
                continue
            for model in doc.models:
                state = entry(model)
                if ready:
                    held = self.snapshot.reservations.get(doc.node_id, 0)
                    state["loaded_on"] += 1
                    state["slots"] += doc.capacity
                    state["free_slots"] += max(doc.capacity - held, 0)
                elif doc.state == "downloading":
                    state["downloading_on"] += 1
                    percent = max((m.download.percent for m in doc.model_states
                                   if m.name == model and m.download is not None), default=0.0)
                    state["download_percent"] = max(state.get("download_percent", 0.0), percent)
                else:
                    state["loadable_on"] += 1
        for name, declared in self.snapshot.declared.items():
            if not declared.removing:
                entry(name)["replicas"] = declared.replicas
        for state in out.values():
            state["state"] = ("loaded" if state["loaded_on"] else "loadable" if state["loadable_on"]
                              else "downloading" if state["downloading_on"] else "declared")
        return dict(sorted(out.items()))

    # --- passive health ----------------------------------------------------------------------------

    def circuit_state(self, node_id: str) -> CircuitState:
        circuit = self.circuits.get(node_id)
        if circuit is None:
            return "closed"
        if circuit.state == "open" and self._may_probe(node_id, circuit):
            circuit.state = "half_open"
        return circuit.state

    def circuit_allows(self, node_id: str) -> bool:
        return self.circuit_state(node_id) != "open"

    def connect_failed(self, node_id: str) -> None:
        circuit = self.circuits.setdefault(node_id, Circuit())
        circuit.failures += 1
        if circuit.state == "half_open" or circuit.failures >= self.settings.circuit_failures:
            if circuit.state != "open":
                log.warning("node %s: circuit open after %d connect failures", node_id, circuit.failures,
                            extra={"node": node_id})
            circuit.state = "open"
            circuit.opened_at = time.monotonic()

    def connected(self, node_id: str) -> None:
        circuit = self.circuits.pop(node_id, None)
        if circuit is not None and circuit.state != "closed":
            log.info("node %s: circuit closed", node_id, extra={"node": node_id})

    def _may_probe(self, node_id: str, circuit: Circuit) -> bool:
        # reopen for traffic only after the cooldown and a heartbeat that arrived after the circuit opened
        cooled = time.monotonic() - circuit.opened_at >= self.settings.circuit_cooldown
        return cooled and self.heard.get(node_id, 0.0) > circuit.opened_at

    # --- reporting ---------------------------------------------------------------------------------

    def busy(self) -> int:
        """Live reservations on the nodes with a fresh heartbeat."""
        return sum(self.snapshot.reservations.get(doc.node_id, 0) for doc in self.fresh_nodes())

    def totals(self) -> dict[str, Any]:
        fresh = self.fresh_nodes()
        ready = [doc for doc in fresh if self.is_ready(doc)]
        capacity = sum(doc.capacity for doc in ready)
        busy = self.busy()
        queued = self.snapshot.queue_depth
        # (a waiting request running several generations will hold a slot for each; the queue's depth is the
        # requests, as the dashboard shows it)
        queued_slots = max(self.snapshot.queued_slots, queued)
        demand = busy + queued_slots
        saturation = demand / capacity if capacity else (1.0 if demand else 0.0)
        return {
            "capacity": capacity,
            "busy": busy,
            "queued": queued,
            "queued_slots": queued_slots,
            "nodes_total": len(fresh),
            "nodes_ready": len(ready),
            "requests_per_s": round(self.requests.rate(), 3),
            "rejections_per_s": round(self.rejections.rate(), 3),
            "saturation": round(saturation, 4),
        }

    def to_json(self) -> dict[str, Any]:
        """The ``/api/pool`` document (the dashboard and ``macpool top`` build on this exact shape)."""
        nodes = []
        for doc in sorted(self.fresh_nodes(), key=lambda d: d.node_id):
            nodes.append({
                **doc.model_dump(mode="json"),
                "reserved": self.snapshot.reservations.get(doc.node_id, 0),
                "reserved_tokens": self.snapshot.reserved_tokens.get(doc.node_id, 0),
                "drained": doc.node_id in self.snapshot.drained,
                "circuit": self.circuit_state(doc.node_id),
                "identity": "signed" if doc.signature else "unsigned",
            })
        untrusted = [
            {"node_id": doc.node_id, "url": doc.url, "signer": doc.signer, "state": doc.state,
             "models": doc.models, "reason": reason,
             "trust": "pending" if reason == PENDING else "untrusted"}
            for doc, reason in sorted(self.untrusted.values(), key=lambda entry: entry[0].node_id)
        ]
        tenants = sorted(set(self.snapshot.queued) | set(self.snapshot.in_flight))
        return {
            "ts_ms": now_ms(),
            "router_id": self.settings.router_id,
            "redis_ok": self.redis_ok,
            "pool": self.totals(),
            "nodes": nodes,
            "untrusted": untrusted,
            "autoscale": list(self.autoscale),
            "tenants": [
                {"tenant": t, "in_flight": self.snapshot.in_flight.get(t),
                 "queued": {p: self.snapshot.queued.get(t, {}).get(p, 0) for p in ("interactive", "batch")}}
                for t in tenants
            ],
        }

    def export(self, metrics: RouterMetrics) -> None:
        """Set the pool gauges (called when /metrics is scraped)."""
        totals = self.totals()
        metrics.redis_up.set(1 if self.redis_ok else 0)
        metrics.pool_slots.labels(state="total").set(totals["capacity"])
        metrics.pool_slots.labels(state="busy").set(totals["busy"])
        metrics.queue_depth.set(totals["queued"])
        metrics.saturation.set(totals["saturation"])
        counts: dict[str, int] = dict.fromkeys(NODE_STATES, 0)
        for doc in self.fresh_nodes():
            state: str = "draining" if doc.node_id in self.snapshot.drained else doc.state
            counts[state] = counts.get(state, 0) + 1
        counts["untrusted"] = len(self.untrusted)
        for state, count in counts.items():
            metrics.nodes.labels(state=state).set(count)
        metrics.queued.clear()
        for tenant, by_priority in self.snapshot.queued.items():
            for priority, waiting in by_priority.items():
                metrics.queued.labels(priority=priority, tenant=tenant).set(waiting)
        for tenant, in_flight in self.snapshot.in_flight.items():
            metrics.tenant_in_flight.labels(tenant=tenant).set(in_flight)
