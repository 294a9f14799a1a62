"""The autoscaler's loop: hold the leader lease, look at the pool, decide, act, say so.

Exactly one controller acts at a time: each tick takes or renews a lease in Redis (SET NX PX, renewed by
its holder only); the others watch and take over when it lapses. Acting is writing ``{p}desired:{id}``
(which the agents read on their heartbeat) and sending Wake-on-LAN magic packets. Each decision is one
log line and one ``autoscale`` message on the pool's events channel.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import RedisError

from macpool import wol
from macpool.contract import NodeDoc, heartbeat_ttl_ms, now_ms
from macpool.loops import every
from macpool.scaling import ScalePolicy, demand_of
from macpool.store import Keys, PoolSnapshot, Store
from macpool.store.connect import AnyRedis
from macpool.store.elastic import ElasticStore, WakeTarget

from .policy import Action, Policy, PoolView

log = logging.getLogger("macpool.autoscale")

STANDBY_STATES = ("standby",)
# the instance of the placeholder record the controller writes for a known Mac whose agent does not beat
# ("asleep", or "waking" once sent a magic packet), so that routers and the dashboard show it - and a
# request for its model waits while it wakes (router/cold_start.py). Any agent's record wins over it.
WAKING_INSTANCE = "autoscale-waking"
SERVING_STATES = ("ready", "paging")


@dataclass
class ControllerConfig:
    policy: ScalePolicy = field(default_factory=ScalePolicy)
    cooldown_s: float = 30.0  # no scale-down this long after any action
    interval_s: float = 1.0
    lease_s: float = 5.0  # a leader that stops renewing is replaced this long after its last tick
    # a node told to load (or a Mac woken) counts as capacity coming this long, then may be told again
    wake_timeout_s: float = 120.0
    wol_port: int = wol.DEFAULT_PORT
    controller_id: str = field(default_factory=lambda: f"{socket.gethostname()}-{secrets.token_hex(4)}")


def pool_view(snapshot: PoolSnapshot, known: dict[str, WakeTarget], coming: Collection[str]) -> PoolView:
    """The policy's view of one snapshot. Drained nodes count for nothing; nodes told to load (``coming``:
    activated while in standby, or woken) count as capacity on its way until their heartbeat says so."""
    nodes = [doc for node_id, doc in snapshot.nodes.items() if node_id not in snapshot.drained]
    ready = [doc for doc in nodes if doc.state in SERVING_STATES and doc.capacity > 0]
    ready_capacity = sum(doc.capacity for doc in ready)
    pool = {
        "busy": sum(snapshot.reservations.values()),
        "queued": snapshot.queue_depth,
        "queued_slots": snapshot.queued_slots,
        "capacity": ready_capacity,
    }
    demand, _ = demand_of(pool)
    loading = [doc for doc in nodes if doc.elastic and doc.state in ("loading", "starting")]
    on_the_way: list[NodeDoc | WakeTarget] = [
        snapshot.nodes.get(i) or known[i] for i in coming if i in snapshot.nodes or i in known
    ]
    pending = sum(doc.standby_capacity for doc in [*loading, *on_the_way])
    idle = (d for d in nodes if d.elastic and d.state in STANDBY_STATES and d.node_id not in coming)
    standby = sorted(idle, key=lambda d: (-d.standby_capacity, d.node_id))
    shrinkable = sorted((d for d in ready if d.elastic),
                        key=lambda d: (snapshot.reservations.get(d.node_id, 0), d.capacity, d.node_id))
    asleep = [t for i, t in sorted(known.items())
              if i not in snapshot.nodes and i not in coming and t.wol_mac]
    active = len([d for d in nodes if d.state not in STANDBY_STATES]) + len(on_the_way)
    return PoolView(demand, ready_capacity, pending, active, standby, shrinkable, asleep)


class Controller:
    """One ``macpool autoscale`` process's controller over the pool in ``redis``."""

    def __init__(self, redis: AnyRedis, keys: Keys, config: ControllerConfig) -> None:
        self.redis = redis
        self.config = config
        self.store = Store(redis, keys)
        self.elastic = ElasticStore(redis, keys)
        self.policy = Policy(config.policy, config.cooldown_s)
        self.leading = False
        # node id -> when it was told to load (activated in standby, or woken): capacity on its way
        self.coming: dict[str, float] = {}
        self.woken: set[str] = set()  # those of ``coming`` that were asleep: shown "waking" until they beat
        self.decisions: list[dict[str, Any]] = []  # the last few, for tests and status

    @property
    def id(self) -> str:
        return self.config.controller_id

    async def run(self) -> None:
        await every(self.config.interval_s, self._tick_now, "autoscale", log, first_now=True)

    async def _tick_now(self) -> None:
        await self.tick(time.monotonic())

    async def tick(self, now: float) -> list[Action]:
        """One look at the pool and what it calls for; only the leader acts."""
        leading = await self.elastic.lead(self.id, int(self.config.lease_s * 1000))
        if leading != self.leading:
            self.leading = leading
            log.info("controller %s %s", self.id, "leads: it acts" if leading else "follows")
            await self._announce({"action": "leader" if leading else "follower", "node": "", "reason": ""})
        if not leading:
            return []
        snapshot = await self.store.read_pool()
        # the placeholders of Macs this controller woke are no nodes: the view counts those as coming
        snapshot.nodes = {i: d for i, d in snapshot.nodes.items() if d.instance != WAKING_INSTANCE}
        known = await self._remember(snapshot)
        await self._arrived(snapshot, now)
        view = pool_view(snapshot, known, self.coming)
        actions = self.policy.step(view, now)
        for action in actions:
            await self._act(action, view, now)
        await self._show_sleepers(snapshot, known)
        return actions

    async def resign(self) -> None:
        """A clean stop: give the lease up so another controller takes over at once."""
        if self.leading:
            await self.elastic.resign(self.id)
            self.leading = False

    async def _remember(self, snapshot: PoolSnapshot) -> dict[str, WakeTarget]:
        """Keep how to wake each elastic Mac seen, so it can be woken once its heartbeat is gone."""
        known = await self.elastic.known()
        for doc in snapshot.nodes.values():
            if not doc.elastic:
                continue
            target = _target(doc)
            if known.get(doc.node_id) != target:
                await self.elastic.remember(target)
                known[doc.node_id] = target
        return known

    async def _arrived(self, snapshot: PoolSnapshot, now: float) -> None:
        """Forget the nodes told to load once their heartbeat leaves standby (loading, ready: the view
        counts them from there), or once they had ``wake_timeout_s`` to do so (they may be told again)."""
        for node_id, since in list(self.coming.items()):
            doc = snapshot.nodes.get(node_id)
            if doc is not None and doc.state not in STANDBY_STATES:
                del self.coming[node_id]
            elif now - since >= self.config.wake_timeout_s:
                log.warning("node %s did not load within %.0fs of being told to", node_id,
                            self.config.wake_timeout_s)
                del self.coming[node_id]
                await self.store.deregister(node_id, WAKING_INSTANCE)  # its placeholder, if any
        self.woken &= self.coming.keys()

    async def _show_sleepers(self, snapshot: PoolSnapshot, known: dict[str, WakeTarget]) -> None:
        """Keep an "asleep" or "waking" record of each known Mac with a MAC whose agent does not beat."""
        ttl_ms = heartbeat_ttl_ms(self.config.interval_s)
        for node_id, target in known.items():
            if node_id in snapshot.nodes or not target.wol_mac:
                continue
            waking = node_id in self.woken
            reason = ("woken by the autoscaler (Wake-on-LAN): waiting for its agent" if waking
                      else "asleep: the autoscaler wakes it (Wake-on-LAN) when demand needs it")
            doc = NodeDoc(
                node_id=node_id, url="", models=target.models, state="waking" if waking else "asleep",
                elastic=True, standby_capacity=target.standby_capacity, wol_mac=target.wol_mac,
                wol_broadcast=target.wol_broadcast, instance=WAKING_INSTANCE, started_at_ms=0,
                reason=reason, updated_at_ms=now_ms(),
            )
            await self.store.heartbeat(doc, ttl_ms)

    async def _act(self, action: Action, view: PoolView, now: float) -> None:
        if action.kind == "wake":
            target = action.target
            assert target is not None
            try:
                broadcast = target.wol_broadcast or wol.DEFAULT_BROADCAST
                await asyncio.to_thread(wol.wake, target.wol_mac, broadcast, self.config.wol_port)
            except OSError as exc:
                log.warning("could not send the magic packet for %s: %s", action.node_id, exc)
            self.woken.add(action.node_id)
        if action.kind != "standby":
            self.coming[action.node_id] = now
        await self.elastic.set_desired(action.node_id, "standby" if action.kind == "standby" else "active")
        log.info("%s %s: %s", action.kind, action.node_id, action.reason)
        await self._announce({
            "action": action.kind, "node": action.node_id, "reason": action.reason,
            "demand": round(view.demand, 2), "ready_capacity": view.ready_capacity,
            "pending_capacity": view.pending_capacity, "active_nodes": view.active,
        })

    async def _announce(self, decision: dict[str, Any]) -> None:
        decision = {**decision, "controller": self.id, "ts_ms": now_ms()}
        self.decisions = [*self.decisions[-49:], decision]
        try:
            await self.elastic.announce(decision)
        except (RedisError, OSError) as exc:
            log.warning("could not publish the decision: %s", exc)


def _target(doc: NodeDoc) -> WakeTarget:
    return WakeTarget(node_id=doc.node_id, wol_mac=doc.wol_mac, wol_broadcast=doc.wol_broadcast,
                      models=doc.models, standby_capacity=doc.standby_capacity)
