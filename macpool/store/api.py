"""The pool's store in Redis, as one typed API: dataclasses in, dataclasses out.

Only this module knows the scripts' arguments and the records they keep (JSON documents whose fields
lib.lua names, written from these dataclasses); the key names are :mod:`macpool.store.keys`'. Every call
takes ``now`` (ms), so tests pass the time instead of sleeping.
"""

from __future__ import annotations

import json
import random
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast, get_args

from pydantic import BaseModel, Field
from redis.asyncio import RedisCluster
from redis.asyncio.sentinel import SentinelConnectionPool

from macpool.contract import DeclaredModel, NodeDoc, Priority, now_ms
from macpool.store.connect import AnyRedis
from macpool.store.events import drain_message
from macpool.store.keys import Keys
from macpool.store.scripts import source

ReserveStatus = Literal["reserved", "queued", "full", "shed", "limited"]
AffinityOutcome = Literal["", "hit", "miss", "overridden"]
ANONYMOUS = "anonymous"  # the tenant of every request when the router has no API keys
QUEUE_LEASE_MS = 3_000  # a waiter's place in the queue (renewed on every attempt), and a slot handed to it


@dataclass(frozen=True)
class Candidate:
    """A node a request may go to.

    ``ttft_s`` and ``decode_s`` (0: not measured) say how soon it would answer: reserve.lua expects
    ``b * ttft_s + decode_s * (1 + batch_cost * b)`` seconds with ``b`` requests running there, this one
    included (router/placement.py; ``batch_cost`` the candidate's own, else the request's). Without them,
    the least-utilised node wins, and the faster one (``tokens_per_s``) a tie.
    """

    node_id: str
    tokens_per_s: float = 0.0
    ttft_s: float = 0.0
    decode_s: float = 0.0
    # the request's own prompt processed there, none of it cached (0: not known): the expected answer time
    # adds it, less the share of it a prefix the node holds covers (affinity)
    prefill_s: float = 0.0
    # the prompts already sent there that it has not finished processing: the expected answer time waits
    # for them first
    backlog_s: float = 0.0
    # how much each request running there slows its decode, at the context its requests hold (0: the
    # request's ``batch_cost``)
    batch_cost: float = 0.0


@dataclass(frozen=True)
class ReserveRequest:
    """One attempt to reserve slots for a request, or to queue it (``enqueue``).

    ``candidates``: where it may go (the expected answer time decides when every one with room was
    measured, else the least utilisation). ``dequeue``: the request already waits in the queue (this is a
    re-check). ``prefixes``: its prompt-prefix hashes, longest first (affinity). ``excluded``: nodes that
    serve the model but that its router no longer sends it to (tried already, circuit open): while it
    waits, no slot there is handed to it nor held back for it. ``generations``: how many it runs at once;
    on each node it needs ``slots_needed`` free slots.

    ``prompt_tokens`` (0: not counted) and ``output_tokens`` (its own output limit; 0: it sets none): what it
    holds of a node's KV cache, ``min(prompt + output, seq_ctx)`` tokens, its output being the node's
    ``n_predict`` when it sets none, else the rest of the context (``NodeDoc``; ``seq_ctx`` unknown:
    ``prompt + output_tokens``). A node whose slots share one pool of cells admits it only while the tokens
    reserved there leave room for it, and one that could never hold it is no candidate. Not counted: it holds
    no tokens, and slots alone bound it.
    """

    request_id: str
    candidates: Sequence[Candidate]
    lease_ms: int
    queue_size: int = 0
    enqueue: bool = False
    dequeue: bool = False
    priority: Priority = "interactive"
    tenant: str = ANONYMOUS
    model: str = ""
    key_limit: int = 0  # requests in flight + queued for this tenant (0: no limit)
    batch_queue_max: int = 0
    prefixes: Sequence[str] = ()
    # for each prefix, the share of the prompt it covers (-1: a session, which covers what the content
    # prefixes its node holds cover)
    prefix_shares: Sequence[float] = ()
    affinity_abs: int = 4
    affinity_rel: float = 1.5
    affinity_max_entries: int = 100_000
    # how long a session (the first prefix, share -1) that sent nothing since still holds a slot's cache on
    # the node it last ran on: a new session costs more where every slot holds another one (0: not counted)
    session_window_ms: int = 0
    queue_lease_ms: int = QUEUE_LEASE_MS
    excluded: Collection[str] = ()
    generations: int = 1
    router: str = ""  # the router that will hold the slots ("": none named, so no liveness tracking)
    batch_cost: float = 0.0  # how much each request running beside it slows a node's decode (Candidate)
    prompt_tokens: int = 0
    output_tokens: int = 0
    # the depth (tokens) at which a prompt token costs twice one at the start (0: depth not counted): a
    # candidate's ``prefill_s`` is the whole prompt's, from depth 0; the part its cache does not hold starts
    # deeper, and costs more a token (router/placement.py)
    prefill_halving: float = 0.0


@dataclass(frozen=True)
class Reservation:
    """The answer to a :class:`ReserveRequest`.

    ``reserved``: ``slots`` slots and ``tokens`` tokens on ``node_id``, which now has ``count`` reservations
    (``ReserveRequest``: tokens 0 when it was not counted). ``queued``: ``count``
    requests wait, this one included. ``full``; ``shed`` (a batch request turned away, or a queued one whose
    place an interactive request took); ``limited`` (the tenant has ``count`` requests in flight and queued,
    its limit). ``affinity``: "" (no prompt prefix), hit, miss or overridden. ``cached``: the share of the
    prompt a prefix the node holds was expected to cover (affinity's hit), 0 to 1.
    """

    status: ReserveStatus
    node_id: str = ""
    count: int = 0
    affinity: AffinityOutcome = ""
    slots: int = 0
    tokens: int = 0
    cached: float = 0.0


@dataclass(frozen=True)
class Release:
    """Give back the slots ``request_id`` holds on ``node_id`` (``slots`` 0: however many it holds there).
    ``failed``: the node failed the request, so its slots are not handed to a waiter."""

    request_id: str
    node_id: str
    tenant: str = ANONYMOUS
    slots: int = 0
    failed: bool = False
    queue_lease_ms: int = QUEUE_LEASE_MS
    router: str = ""


@dataclass(frozen=True)
class Lease:
    """What a running request holds in Redis: ``slots`` slots and ``tokens`` tokens on ``node_id`` (as its
    :class:`Reservation` said: a renewal writes them again if Redis lost them)."""

    request_id: str
    node_id: str
    tenant: str = ANONYMOUS
    slots: int = 1
    router: str = ""  # the router holding it (its reservations are given back when it stops beating)
    tokens: int = 0


class PoolSnapshot(BaseModel):
    """What Redis says about the pool at one moment."""

    nodes: dict[str, NodeDoc] = Field(default_factory=dict)
    reservations: dict[str, int] = Field(default_factory=dict)
    reserved_tokens: dict[str, int] = Field(default_factory=dict)  # node -> the tokens its reservations hold
    drained: set[str] = Field(default_factory=set)
    queue_depth: int = 0
    queued_slots: int = 0  # the slots the waiting requests will hold: one per generation each runs at once
    queued: dict[str, dict[str, int]] = Field(default_factory=dict)  # tenant -> priority -> waiting
    in_flight: dict[str, int] = Field(default_factory=dict)  # tenant -> requests in flight
    revocations: dict[str, str] = Field(default_factory=dict)  # node id -> its revocation record (JSON)
    declared: dict[str, DeclaredModel] = Field(default_factory=dict)  # the models the pool serves, by name


class Store:
    """The pool's state in the Redis that ``redis`` points at, under ``keys``' prefix."""

    def __init__(self, redis: AnyRedis, keys: Keys | None = None) -> None:
        self.redis = redis
        self.keys = keys or Keys()
        self._reserve = redis.register_script(source("reserve"))
        self._release = redis.register_script(source("release"))
        self._offer = redis.register_script(source("offer"))
        self._leave = redis.register_script(source("leave"))
        self._renew = redis.register_script(source("renew"))
        self._heartbeat = redis.register_script(source("heartbeat"))
        self._deregister = redis.register_script(source("deregister"))
        self._beat = redis.register_script(source("beat"))
        self._forget = redis.register_script(source("forget"))
        # the nodes the last read_pool found: a reservation or a queue exit declares them all, so that a
        # slot handed to a waiter on any of them can be taken, turned down or given back (lib.lua)
        self.known_nodes: frozenset[str] = frozenset()

    @property
    def address(self) -> str:
        """Where the Redis client connects (host:port, or a unix socket's path), never its password."""
        if isinstance(self.redis, RedisCluster):
            return ",".join(node.name for node in self.redis.get_nodes())
        pool = self.redis.connection_pool
        if isinstance(pool, SentinelConnectionPool):
            return f"the primary of {pool.service_name} (Sentinel)"
        kwargs = pool.connection_kwargs
        return str(kwargs["path"]) if "path" in kwargs else f"{kwargs.get('host')}:{kwargs.get('port')}"

    def _admission(
        self, nodes: Iterable[str], now: int | None, call: dict[str, Any],
    ) -> tuple[list[str], list[str | int]]:
        """An admission script's KEYS, declaring ``nodes``, and its ARGV (lib.lua): the nodes declared, the
        events channel, the time, then the call's own arguments by name (``call``, as one JSON document)."""
        keys, declared = self.keys.admission(nodes)
        return keys, [declared, self.keys.events, now_ms() if now is None else now, _json(call)]

    # --- admission ---------------------------------------------------------------------------------

    async def reserve(self, request: ReserveRequest, now: int | None = None) -> Reservation:
        """Reserve slots on the node holding the prompt's prefix or the candidate that would answer soonest
        (least utilised, unmeasured), or queue the request, or say why not - in one atomic call."""
        nodes = [*(c.node_id for c in request.candidates), *request.excluded, *self.known_nodes]
        keys, args = self._admission(nodes, now, _reserve_call(request))
        raw = await self._reserve(keys=keys, args=args)
        status, affinity = _text(raw[0]), _text(raw[3])
        if status not in get_args(ReserveStatus) or affinity not in get_args(AffinityOutcome):
            raise ValueError(f"reserve.lua answered {raw!r}")
        slots, tokens = (int(raw[4]), int(raw[5])) if len(raw) > 5 else (0, 0)
        cached = int(raw[6]) / 1000 if len(raw) > 6 else 0.0
        return Reservation(cast(ReserveStatus, status), _text(raw[1]), int(raw[2]),
                           cast(AffinityOutcome, affinity), slots, tokens, cached)

    async def release(self, release: Release, now: int | None = None) -> int:
        """Give the slots back, handing them to waiting requests; the slots released."""
        call = {"rid": release.request_id, "node": release.node_id, "tenant": release.tenant,
                "slots": release.slots, "failed": release.failed, "queue_lease": release.queue_lease_ms}
        keys, args = self._admission([release.node_id], now, call)
        return int(await self._release(keys=keys, args=args))

    async def offer(self, node_id: str, queue_lease_ms: int = QUEUE_LEASE_MS, now: int | None = None) -> int:
        """Hand ``node_id``'s free slots to waiting requests, as a release does, for slots no release
        announces (the node just became ready, or its capacity grew); the slots handed over."""
        keys, args = self._admission([node_id], now, {"node": node_id, "queue_lease": queue_lease_ms})
        return int(await self._offer(keys=keys, args=args))

    async def leave_queue(
        self, request_id: str, nodes: Sequence[str] = (), queue_lease_ms: int = QUEUE_LEASE_MS,
        now: int | None = None,
    ) -> bool:
        """Take a waiting request out of the queue; ``nodes``: those it could run on if it runs several
        generations (their free slots were held back for it). True when slots had been handed to it (they go
        to the next in line)."""
        # the node that handed it slots, if one did: declared, so that they can be given back (were it
        # to hand it others before the script runs, those lapse with the queue lease); and the node it
        # waits on, whose free slots were held back for it
        raw = await self.redis.hget(self.keys.queue_meta, request_id)
        record = _QueueRecord.parse(raw) if raw else None
        mark, hold = (record.mark, record.hold) if record else ("", "")
        granted = [mark[2:]] if mark.startswith("g:") else []
        call = {"rid": request_id, "queue_lease": queue_lease_ms, "nodes": list(nodes)}
        keys, args = self._admission([*nodes, *granted, *([hold] if hold else []), *self.known_nodes], now,
                                     call)
        return int(await self._leave(keys=keys, args=args)) == 2

    async def renew(self, leases: Sequence[Lease], lease_ms: int, now: int | None = None) -> list[bool]:
        """Extend each lease to ``now + lease_ms``, in one call. For each, True when it was gone (Redis
        restarted empty, or it had expired) and has been counted again."""
        if not leases:
            return []
        now = now_ms() if now is None else now
        call = {"expiry": now + lease_ms, "lease": lease_ms, "leases": [_lease(lease) for lease in leases]}
        keys, args = self._admission([lease.node_id for lease in leases], now, call)
        return [int(result) == 2 for result in await self._renew(keys=keys, args=args)]

    async def drain(self, node_id: str, drained: bool) -> None:
        """Mark a node drained (routers send it nothing new) or not, and tell every router at once."""
        async with self.redis.pipeline(transaction=True) as pipe:
            if drained:
                pipe.sadd(self.keys.drained, node_id)
            else:
                pipe.srem(self.keys.drained, node_id)
            pipe.publish(self.keys.events, drain_message(node_id, drained))
            await pipe.execute()

    async def set_revocation(self, node_id: str, record: str) -> None:
        """Write the operator's signed word on ``node_id`` (macpool/identity.py ``Revocation``)."""
        await self.redis.hset(self.keys.revoked, node_id, record)

    async def forget(self, lease: Lease) -> None:
        """Remove a lease without handing its slots on: a renewal that crossed its release brought it back."""
        keys, args = self._admission([lease.node_id], None, _lease(lease))
        await self._forget(keys=keys, args=args)

    # --- router liveness ---------------------------------------------------------------------------

    async def beat(self, router: str, alive_ms: int, queue_lease_ms: int = QUEUE_LEASE_MS,
                   now: int | None = None) -> int:
        """``router`` counts as alive for ``alive_ms`` more; what routers that stopped beating held is given
        back (handed to waiters). The slots given back."""
        now = now_ms() if now is None else now
        index = await self.redis.zrange(self.keys.nodes, 0, -1)
        nodes = [_text(cast(str | bytes, node_id)) for node_id in index]
        call = {"router": router, "alive_until": now + alive_ms, "queue_lease": queue_lease_ms}
        keys, args = self._admission(nodes, now, call)  # (reclaim may give back slots on any node)
        return int(await self._beat(keys=keys, args=args))

    # --- the node agent ----------------------------------------------------------------------------

    async def heartbeat(self, doc: NodeDoc, ttl_ms: int) -> str | None:
        """Write one heartbeat atomically and announce it. None when written, else the URL of the agent
        started later that holds this node id ("" if unknown): this beat was refused."""
        keys = [self.keys.node(doc.node_id), self.keys.nodes]
        call = {"id": doc.node_id, "ttl": ttl_ms, "at": doc.updated_at_ms or now_ms(),
                "fields": _node_fields(doc)}
        result = await self._heartbeat(keys=keys, args=[self.keys.events, doc.encode(), _json(call)])
        if result == 1:
            return None
        return NodeDoc.decode(result).url if result else ""

    async def deregister(self, node_id: str, instance: str = "") -> bool:
        """Clean shutdown: the node leaves the pool at once instead of after its TTL. False (nothing
        removed) when another agent process holds the id: one started later."""
        keys = [self.keys.node(node_id), self.keys.nodes]
        return bool(await self._deregister(keys=keys, args=[self.keys.events, node_id, instance]))

    # --- reading the pool --------------------------------------------------------------------------

    async def read_pool(self, tenants: Sequence[str] = (), now: int | None = None) -> PoolSnapshot:
        """Every live node, its live reservations, the drained set and who waits in the queue; ``tenants``
        also get their requests in flight counted. Two round trips whatever the pool size; index entries
        whose node key expired are pruned."""
        now = now_ms() if now is None else now
        keys = self.keys
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zrange(keys.nodes, 0, -1)
            pipe.smembers(keys.drained)
            pipe.zrangebyscore(keys.queue, now, "+inf")
            pipe.hgetall(keys.queue_meta)
            pipe.hgetall(keys.revoked)
            pipe.hgetall(keys.models)
            if tenants:
                pipe.hmget(keys.in_flight_count, list(tenants))
                pipe.zrangebyscore(keys.in_flight, "-inf", f"({now}")  # expired, not yet pruned
            ids_raw, drained_raw, waiting_raw, meta_raw, revoked_raw, declared_raw, *loads = (
                await pipe.execute())
        declared = (DeclaredModel.decode(raw) for raw in declared_raw.values())
        snapshot = PoolSnapshot(drained={_text(d) for d in drained_raw},
                                in_flight=_in_flight(tenants, *loads) if tenants else {},
                                revocations={_text(k): _text(v) for k, v in revoked_raw.items()},
                                declared={model.name: model for model in declared})
        records = {_text(k): _QueueRecord.parse(v) for k, v in meta_raw.items()}
        for rid in waiting_raw:
            record = records.get(_text(rid))
            if record is None or record.mark:
                continue  # not waiting any more: handed a slot, or shed
            by_priority = snapshot.queued.setdefault(record.tenant, {})
            by_priority[record.priority] = by_priority.get(record.priority, 0) + 1
            snapshot.queue_depth += 1
            snapshot.queued_slots += record.generations
        ids = [_text(i) for i in ids_raw]
        self.known_nodes = frozenset(ids)
        if ids:
            await self._read_nodes(ids, now, snapshot)
        return snapshot

    async def _read_nodes(self, ids: list[str], now: int, snapshot: PoolSnapshot) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            for node_id in ids:
                pipe.hget(self.keys.node(node_id), "doc")
                pipe.zrangebyscore(self.keys.reservations(node_id), now, "+inf")
                pipe.hgetall(self.keys.tokens(node_id))
            results = await pipe.execute()
        gone = []
        for node_id, raw, live, tokens in zip(ids, results[0::3], results[1::3], results[2::3], strict=True):
            if raw is None:
                gone.append(node_id)
                continue
            snapshot.nodes[node_id] = NodeDoc.decode(raw)
            snapshot.reservations[node_id] = len(live)
            # (an expired reservation's tokens stay until a script prunes it: only the live ones count)
            held = {_text(member) for member in live}
            snapshot.reserved_tokens[node_id] = sum(int(n) for rid, n in tokens.items() if _text(rid) in held)
        if gone:
            await self.redis.zrem(self.keys.nodes, *gone)


@dataclass(frozen=True)
class _QueueRecord:
    """The fields of a queue record (lib.lua's ``record``) the pool read needs."""

    priority: str
    tenant: str
    mark: str  # "": waiting
    generations: int
    hold: str  # the node it waits on ("": none, or every node it could run on)

    @classmethod
    def parse(cls, raw: str | bytes) -> _QueueRecord:
        doc = json.loads(raw)
        return cls(doc["priority"], doc["tenant"], doc["mark"], doc["generations"], doc["hold"])


def _node_fields(doc: NodeDoc) -> dict[str, str]:
    """What the scripts read of a node's heartbeat, by name, as its hash keeps them (heartbeat.lua writes
    them beside the document; lib.lua's ``usable`` reads them)."""
    return {"capacity": str(doc.capacity), "state": doc.state, "models": "\n".join(doc.models),
            "slots": str(doc.total_slots), "seq_ctx": str(doc.seq_ctx), "kv_cells": str(doc.kv_cells),
            "kv_unified": "1" if doc.kv_unified else "0", "n_predict": str(doc.n_predict),
            "instance": doc.instance, "started": str(doc.started_at_ms)}


def _lease(lease: Lease) -> dict[str, Any]:
    """A lease as renew.lua and forget.lua read it."""
    return {"rid": lease.request_id, "node": lease.node_id, "tenant": lease.tenant, "slots": lease.slots,
            "tokens": lease.tokens, "router": lease.router}


def _in_flight(tenants: Sequence[str], counts: list[Any], expired: list[Any]) -> dict[str, int]:
    """Each tenant's requests in flight: its count in ``{p}inflight:count`` less its members that expired
    and that no script has pruned yet."""
    out = {tenant: int(n or 0) for tenant, n in zip(tenants, counts, strict=True)}
    for member in expired:
        tenant = _text(member).split("\t", 1)[0]
        if tenant in out:
            out[tenant] = max(out[tenant] - 1, 0)
    return out


def _reserve_call(request: ReserveRequest) -> dict[str, Any]:
    """The request as reserve.lua reads it (a random number per candidate breaks the last ties)."""
    return {
        "rid": request.request_id, "lease": request.lease_ms, "queue_size": request.queue_size,
        "enqueue": request.enqueue, "dequeue": request.dequeue, "priority": request.priority,
        "tenant": request.tenant, "model": request.model, "key_limit": request.key_limit,
        "batch_queue_max": request.batch_queue_max, "prefixes": list(request.prefixes),
        "shares": list(request.prefix_shares) or [0] * len(request.prefixes),
        "affinity_abs": request.affinity_abs, "affinity_rel": request.affinity_rel,
        "affinity_max_entries": request.affinity_max_entries, "queue_lease": request.queue_lease_ms,
        "session_window": request.session_window_ms,
        "excluded": list(request.excluded), "generations": request.generations, "router": request.router,
        "batch_cost": request.batch_cost, "prompt_tokens": request.prompt_tokens,
        "output_tokens": request.output_tokens, "prefill_halving": request.prefill_halving,
        "candidates": [{"id": c.node_id, "tokens_per_s": c.tokens_per_s, "tie": random.random(),
                        "ttft": c.ttft_s, "decode": c.decode_s, "prefill": c.prefill_s,
                        "backlog": c.backlog_s, "batch_cost": c.batch_cost}
                       for c in request.candidates],
    }


def _json(document: dict[str, Any]) -> str:
    return json.dumps(document, separators=(",", ":"))


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
