"""The router/agent contract: Redis key names, the heartbeat document, and the Lua scripts.

Everything the router and the node agents agree on lives here, so a reader finds the whole
protocol in one file.

Keys (``{p}`` is the configurable prefix, default ``macpool:``):

``{p}node:{id}``      HASH, TTL = heartbeat TTL. Fields: ``doc`` (the :class:`NodeDoc` JSON),
                      ``capacity`` (int), ``state`` (str). Written by the agent every heartbeat;
                      a dead Mac disappears when the TTL runs out.
``{p}nodes``          ZSET node id -> last heartbeat (ms). An index for routers; entries whose
                      ``node`` key expired are pruned by routers.
``{p}resv:{id}``      ZSET reservation id -> lease expiry (ms). One member per request a router
                      admitted to that node. Leases expire, so a crashed router leaks nothing
                      past the lease time; live streams renew theirs.
``{p}drained``        SET of node ids an operator drained through a router's admin API.
``{p}queue``          ZSET waiter id -> lease expiry (ms): the global, bounded wait queue.
``{p}events``         pub/sub channel. Messages: ``node <json doc>`` (a heartbeat),
                      ``gone <id>`` (clean agent shutdown), ``freed <id>`` (a slot was released),
                      ``drain <id>`` / ``undrain <id>``.

Admission is one atomic Lua call (:data:`RESERVE_OR_ENQUEUE`): pick the least-utilised
candidate with a free slot and reserve it, or else join the bounded queue, or else say full.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, Field
from redis.asyncio import Redis

DEFAULT_PREFIX = "macpool:"
EVENTS_CHANNEL = "events"

NodeState = Literal["starting", "ready", "draining", "unhealthy", "paging"]
MemoryState = Literal["healthy", "near_ceiling", "paging", "collapsed"]


class Keys:
    """Key names under one prefix."""

    def __init__(self, prefix: str = DEFAULT_PREFIX) -> None:
        self.prefix = prefix
        self.nodes = f"{prefix}nodes"
        self.drained = f"{prefix}drained"
        self.queue = f"{prefix}queue"
        self.events = f"{prefix}{EVENTS_CHANNEL}"

    def node(self, node_id: str) -> str:
        return f"{self.prefix}node:{node_id}"

    def reservations(self, node_id: str) -> str:
        return f"{self.prefix}resv:{node_id}"


def now_ms() -> int:
    return int(time.time() * 1000)


class MemoryFigures(BaseModel):
    """Unified-memory figures of one Mac, in GB (10**9 bytes)."""

    total_gb: float = 0.0
    wired_limit_gb: float = 0.0
    weights_gb: float = 0.0
    pinned_gb: float = 0.0
    per_request_gb: float = 0.0
    swap_used_gb: float = 0.0
    pressure: Literal["normal", "warning", "critical"] = "normal"
    state: MemoryState = "healthy"


class CapacityBreakdown(BaseModel):
    """Each term of ``capacity = min(configured, memory, calibrated)`` (None: no such limit)."""

    configured: int | None = None
    memory: int | None = None
    calibrated: int | None = None
    pressure_limited: bool = False


class NodeDoc(BaseModel):
    """The heartbeat document an agent writes for its Mac every interval."""

    node_id: str
    url: str  # how routers reach the agent's gateway
    models: list[str] = Field(default_factory=list)
    capacity: int = 0
    in_flight: int = 0
    total_slots: int = 0
    state: NodeState = "starting"
    reason: str = ""  # why the state/capacity is what it is, for operators
    memory: MemoryFigures = Field(default_factory=MemoryFigures)
    capacity_breakdown: CapacityBreakdown = Field(default_factory=CapacityBreakdown)
    tokens_per_s: float = 0.0
    ttft_p50_ms: float | None = None
    ctx_per_slot: int = 0
    llama_build: str = ""
    agent_version: str = ""
    started_at_ms: int = 0
    updated_at_ms: int = 0

    def encode(self) -> str:
        return self.model_dump_json()

    @classmethod
    def decode(cls, raw: str | bytes) -> NodeDoc:
        return cls.model_validate_json(raw)


def heartbeat_ttl_ms(interval_s: float) -> int:
    """A node key lives about three heartbeat intervals."""
    return max(int(interval_s * 3000), 1000)


# --- Lua scripts -------------------------------------------------------------------------------
# Keys are built inside the scripts from the prefix (ARGV), so the candidate list can be any length.
# This is fine for a single Redis (or a replicated primary); it is not Redis Cluster-safe.

RESERVE_OR_ENQUEUE = """
-- ARGV: prefix, now_ms, lease_ms, request_id, queue_size, enqueue (0/1), dequeue (0/1),
--       then candidates as triples: node_id, tokens_per_s, random tiebreak
local prefix = ARGV[1]
local now = tonumber(ARGV[2])
local lease = tonumber(ARGV[3])
local rid = ARGV[4]
local queue_size = tonumber(ARGV[5])
local enqueue = ARGV[6] == '1'
local dequeue = ARGV[7] == '1'
local best, best_util, best_tps, best_rand, best_n = nil, 2.0, -1.0, 0.0, 0
local drained = prefix .. 'drained'
for i = 8, #ARGV, 3 do
  local id = ARGV[i]
  local fields = redis.call('HMGET', prefix .. 'node:' .. id, 'capacity', 'state')
  local cap = tonumber(fields[1])
  if cap and cap > 0 and fields[2] == 'ready' and redis.call('SISMEMBER', drained, id) == 0 then
    local rkey = prefix .. 'resv:' .. id
    redis.call('ZREMRANGEBYSCORE', rkey, '-inf', now)
    local n = redis.call('ZCARD', rkey)
    if n < cap then
      local util = n / cap
      local tps = tonumber(ARGV[i + 1])
      local rnd = tonumber(ARGV[i + 2])
      local better = util < best_util
      if util == best_util then
        better = tps > best_tps or (tps == best_tps and rnd < best_rand)
      end
      if better then
        best, best_util, best_tps, best_rand, best_n = id, util, tps, rnd, n
      end
    end
  end
end
local qkey = prefix .. 'queue'
if best then
  local rkey = prefix .. 'resv:' .. best
  redis.call('ZADD', rkey, now + lease, rid)
  redis.call('PEXPIRE', rkey, lease * 2)
  if dequeue then redis.call('ZREM', qkey, rid) end
  return {'reserved', best, best_n + 1}
end
if not enqueue then
  return {'full', '', 0}
end
redis.call('ZREMRANGEBYSCORE', qkey, '-inf', now)
if redis.call('ZSCORE', qkey, rid) then
  redis.call('ZADD', qkey, now + lease, rid)
  return {'queued', '', redis.call('ZCARD', qkey)}
end
local depth = redis.call('ZCARD', qkey)
if depth >= queue_size then
  return {'full', '', depth}
end
redis.call('ZADD', qkey, now + lease, rid)
redis.call('PEXPIRE', qkey, lease * 2)
return {'queued', '', depth + 1}
"""

RELEASE = """
-- KEYS: reservations key, events channel; ARGV: request_id, node_id
local removed = redis.call('ZREM', KEYS[1], ARGV[1])
if removed == 1 then
  redis.call('PUBLISH', KEYS[2], 'freed ' .. ARGV[2])
end
return removed
"""

RENEW = """
-- KEYS: reservations key; ARGV: request_id, new expiry ms, lease ms
local r = redis.call('ZADD', KEYS[1], 'XX', 'CH', ARGV[2], ARGV[1])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[3]) * 2)
return r
"""

LEAVE_QUEUE = """
-- KEYS: queue key; ARGV: request_id
return redis.call('ZREM', KEYS[1], ARGV[1])
"""


# --- The heartbeat path and the pool read, shared by both sides -----------------------------------

async def write_heartbeat(redis: Redis, keys: Keys, doc: NodeDoc, ttl_ms: int) -> None:
    """Write one heartbeat in a single transaction and announce it on the events channel."""
    raw = doc.encode()
    async with redis.pipeline(transaction=True) as pipe:
        pipe.hset(keys.node(doc.node_id), mapping={"doc": raw, "capacity": doc.capacity, "state": doc.state})
        pipe.pexpire(keys.node(doc.node_id), ttl_ms)
        pipe.zadd(keys.nodes, {doc.node_id: doc.updated_at_ms or now_ms()})
        pipe.publish(keys.events, f"node {raw}")
        await pipe.execute()


async def remove_node(redis: Redis, keys: Keys, node_id: str) -> None:
    """Clean shutdown: the node leaves the pool at once instead of after its TTL."""
    async with redis.pipeline(transaction=True) as pipe:
        pipe.delete(keys.node(node_id))
        pipe.zrem(keys.nodes, node_id)
        pipe.publish(keys.events, f"gone {node_id}")
        await pipe.execute()


class PoolSnapshot(BaseModel):
    """What Redis says about the pool at one moment."""

    nodes: dict[str, NodeDoc] = Field(default_factory=dict)
    reservations: dict[str, int] = Field(default_factory=dict)
    drained: set[str] = Field(default_factory=set)
    queue_depth: int = 0


async def read_pool(redis: Redis, keys: Keys) -> PoolSnapshot:
    """Read every live node, its live reservations, the drained set and the queue depth.

    Two round trips whatever the pool size; index entries whose node key expired are pruned.
    """
    now = now_ms()
    async with redis.pipeline(transaction=False) as pipe:
        pipe.zrange(keys.nodes, 0, -1)
        pipe.smembers(keys.drained)
        pipe.zcount(keys.queue, now, "+inf")
        ids_raw, drained_raw, depth = await pipe.execute()
    ids = [_text(i) for i in ids_raw]
    snapshot = PoolSnapshot(drained={_text(d) for d in drained_raw}, queue_depth=int(depth))
    if not ids:
        return snapshot
    async with redis.pipeline(transaction=False) as pipe:
        for node_id in ids:
            pipe.hget(keys.node(node_id), "doc")
            pipe.zcount(keys.reservations(node_id), now, "+inf")
        results = await pipe.execute()
    gone = []
    for node_id, raw, count in zip(ids, results[0::2], results[1::2], strict=True):
        if raw is None:
            gone.append(node_id)
            continue
        snapshot.nodes[node_id] = NodeDoc.decode(raw)
        snapshot.reservations[node_id] = int(count)
    if gone:
        await redis.zrem(keys.nodes, *gone)
    return snapshot


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
