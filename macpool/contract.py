"""The router/agent contract: Redis key names, the heartbeat document, and the Lua scripts.

Everything the router and the node agents agree on lives here, so a reader finds the whole
protocol in one file.

Keys (``{p}`` is the configurable prefix, default ``macpool:``):

``{p}node:{id}``      HASH, TTL = heartbeat TTL. Fields: ``doc`` (the :class:`NodeDoc` JSON),
                      ``capacity`` (int), ``state`` (str), ``models`` (newline-separated), ``slots``
                      (llama-server's slots, which bound the slots one request holds: :func:`slots_needed`),
                      ``instance`` and ``started`` (which agent process holds the id, and when it
                      started). Written by the agent every heartbeat (:data:`HEARTBEAT`); a dead Mac
                      disappears when the TTL runs out. Of two agents under one id, the one started
                      last holds it: the other's heartbeats and deregistration are refused.
``{p}nodes``          ZSET node id -> last heartbeat (ms). An index for routers; entries whose
                      ``node`` key expired are pruned by routers.
``{p}resv:{id}``      ZSET reservation id -> lease expiry (ms). One member per slot a router reserved
                      on that node: ``rid`` for a request, and ``rid#2`` .. ``rid#k`` more for one that
                      runs k generations at once (reserved, renewed and released together). Leases
                      expire, so a crashed router leaks nothing past the lease time; live streams
                      renew theirs.
``{p}drained``        SET of node ids an operator drained through a router's admin API.
``{p}queue``          ZSET waiter id -> lease expiry (ms): the global, bounded wait queue.
``{p}qmeta``          HASH waiter id -> its priority, tenant, model, arrival, mark and the nodes it
                      turns down (see the scripts).
``{p}tenant:{name}``  ZSET reservation id -> lease expiry: one tenant's (API key's) requests in flight,
                      for fair queueing and per-key concurrency limits.
``{p}affinity``       HASH prompt-prefix hash -> the node that last served it (prefix-cache affinity);
``{p}affinity:lru``   ZSET prefix hash -> last use (ms), which bounds it to the newest N entries.
``{p}events``         pub/sub channel. Messages: ``node <json doc>`` (a heartbeat),
                      ``gone <id>`` (clean agent shutdown), ``freed <id>`` (a slot was released; one
                      message per slot),
                      ``granted <request id> <node id> <k>`` (a release handed k slots to a queued request),
                      ``shed <request id>`` (a queued batch request lost its place),
                      ``drain <id>`` / ``undrain <id>``.

Admission is one atomic Lua call (:data:`RESERVE_OR_ENQUEUE`): pick the node holding the request's
prompt prefix or else the least-utilised candidate with a free slot and reserve it, or else join the
bounded queue in priority and fairness order, or else say full. A release hands its slot straight to
the first queued request that node can serve (:data:`RELEASE`).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Collection
from typing import Any, Literal

from pydantic import BaseModel, Field
from redis.asyncio import Redis

DEFAULT_PREFIX = "macpool:"
EVENTS_CHANNEL = "events"

NodeState = Literal["starting", "ready", "draining", "unhealthy", "paging"]
MemoryState = Literal["healthy", "near_ceiling", "paging", "collapsed"]
Priority = Literal["interactive", "batch"]


class Keys:
    """Key names under one prefix."""

    def __init__(self, prefix: str = DEFAULT_PREFIX) -> None:
        self.prefix = prefix
        self.nodes = f"{prefix}nodes"
        self.drained = f"{prefix}drained"
        self.queue = f"{prefix}queue"
        self.queue_meta = f"{prefix}qmeta"
        self.affinity = f"{prefix}affinity"
        self.events = f"{prefix}{EVENTS_CHANNEL}"

    def node(self, node_id: str) -> str:
        return f"{self.prefix}node:{node_id}"

    def reservations(self, node_id: str) -> str:
        return f"{self.prefix}resv:{node_id}"

    def tenant(self, name: str) -> str:
        return f"{self.prefix}tenant:{name}"


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
    instance: str = ""  # this agent process (random, per start): two agents under one id are told apart

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
#
# Queue entries: ``{p}queue`` holds each waiter's lease expiry (short, renewed on each attempt),
# ``{p}qmeta`` its record "priority \t tenant \t model \t arrival \t mark \t preferred \t hashed \t passes
# \t declined \t generations", mark being "" (waiting), "g:<node>" (a release reserved its slots on <node>
# for it: it only has to take them) or "shed" (an interactive request took its place); the preferred node
# holds its prompt prefix (affinity); declined lists (newline-separated) the nodes it turned a handed-over
# slot down on - nodes its router no longer sends it to (tried already, or circuit open there): no slot there
# is handed to it again, nor held back for it from later arrivals; generations is how many it runs at once
# (each holds a slot).
# A request holding k slots is k members of its node's reservations (see members()).
# Queue order, for each model: interactive before batch, then the tenant with the fewest requests in
# flight, then the oldest - except that a release may hand its slot to a request that prefers that node
# among the first AFFINITY_SKIP equally ranked ones (passing each over at most MAX_PASSES times). Both are
# trimmed when the waiter's lease runs out.

_PRELUDE = """
local AFFINITY_SKIP = 8  -- queued requests a hand-over may look past the head for one this node has cached
local MAX_PASSES = 4  -- ... and how often one request may be passed over that way

local function fields(s)
  local out, start = {}, 1
  while true do
    local i = string.find(s, '\\t', start, true)
    if not i then out[#out + 1] = string.sub(s, start); return out end
    out[#out + 1] = string.sub(s, start, i - 1)
    start = i + 1
  end
end

-- every live queue entry as {rid, prio, tenant, model, enq, mark}; expired entries are dropped here
local function queue_entries(prefix, now)
  local qkey, mkey = prefix .. 'queue', prefix .. 'qmeta'
  if redis.call('EXISTS', qkey) == 0 then return {} end
  local expired = redis.call('ZRANGEBYSCORE', qkey, '-inf', now)
  if #expired > 0 then
    redis.call('ZREMRANGEBYSCORE', qkey, '-inf', now)
    redis.call('HDEL', mkey, unpack(expired))
  end
  local ids = redis.call('ZRANGE', qkey, 0, -1)
  local out = {}
  if #ids == 0 then return out end
  local metas = redis.call('HMGET', mkey, unpack(ids))
  for i, rid in ipairs(ids) do
    if metas[i] then
      local f = fields(metas[i])
      out[#out + 1] = {rid = rid, prio = f[1], tenant = f[2], model = f[3], enq = tonumber(f[4]),
                       mark = f[5] or '', pref = f[6] or '', hashed = f[7] or '',
                       passes = tonumber(f[8]) or 0, declined = f[9] or '', gens = tonumber(f[10]) or 1,
                       hold = f[11] or ''}
    end
  end
  return out
end

-- the qmeta record of queue entry `e`
local function record(e)
  local f = {e.prio, e.tenant, e.model, e.enq, e.mark, e.pref, e.hashed, e.passes, e.declined, e.gens,
             e.hold or ''}
  return table.concat(f, '\\t')
end

-- whether queue entry `e` turned down a slot on `node` before
local function declined(e, node)
  if e.declined == '' then return false end
  return string.find('\\n' .. e.declined .. '\\n', '\\n' .. node .. '\\n', 1, true) ~= nil
end

local loads = {}
-- requests a tenant has in flight (reserved), across every router
local function tenant_load(prefix, tenant, now)
  local n = loads[tenant]
  if n == nil then
    n = redis.call('ZCOUNT', prefix .. 'tenant:' .. tenant, now, '+inf')
    loads[tenant] = n
  end
  return n
end

-- queue order: interactive first, then the tenant with fewer requests in flight, then the oldest
local function before(prefix, now, a, b)
  local pa, pb = a.prio == 'batch' and 1 or 0, b.prio == 'batch' and 1 or 0
  if pa ~= pb then return pa < pb end
  local la, lb = tenant_load(prefix, a.tenant, now), tenant_load(prefix, b.tenant, now)
  if la ~= lb then return la < lb end
  if a.enq ~= b.enq then return a.enq < b.enq end
  return a.rid < b.rid
end

-- the slots a request running `gens` generations holds on a node of `slots` llama-server slots (nil or 0:
-- unknown): llama-server queues the generations past its slots (slots_needed() below)
local function need(gens, slots)
  if slots and slots > 0 and slots < gens then return slots end
  return gens
end

-- the reservation members of a request holding k slots: rid, rid#2, ..., rid#k
local function members(rid, k)
  local out = {rid}
  for i = 2, k do out[i] = rid .. '#' .. i end
  return out
end

-- the ZADD arguments giving each of a request's k members the expiry `score`
local function scored(rid, k, score)
  local out = {}
  for _, m in ipairs(members(rid, k)) do out[#out + 1] = score; out[#out + 1] = m end
  return out
end

-- how many slots `rid` holds in reservations `rkey` (its members come and go together: they are contiguous)
local function held(rkey, rid)
  if not redis.call('ZSCORE', rkey, rid) then return 0 end
  local k = 1
  while redis.call('ZSCORE', rkey, rid .. '#' .. (k + 1)) do k = k + 1 end
  return k
end

-- reserve k slots on `node` for `rid` until now + lease. A hand-over's lease is a short one, what is left of
-- the waiter's place in the queue (`short`): it must not cut short the TTL of the keys the node's and the
-- tenant's other reservations live in
local function reserve(prefix, node, rid, tenant, now, lease, k, short)
  local rkey, tkey, ttl = prefix .. 'resv:' .. node, prefix .. 'tenant:' .. tenant, lease * 2
  redis.call('ZADD', rkey, unpack(scored(rid, k, now + lease)))
  if not short or redis.call('PTTL', rkey) < ttl then redis.call('PEXPIRE', rkey, ttl) end
  redis.call('ZADD', tkey, now + lease, rid)
  if not short or redis.call('PTTL', tkey) < ttl then redis.call('PEXPIRE', tkey, ttl) end
  loads[tenant] = nil
end

local function serves(models, model)
  if model == '' then return true end
  if not models then return false end
  for m in string.gmatch(models, '[^\\n]+') do
    if m == model then return true end
  end
  return false
end

-- whether queue entry `e` waits for a slot `node` could give it (`models`, `slots`, `cap`: the node's)
local function eligible(e, node, models, slots, cap)
  return e.mark == '' and serves(models, e.model) and not declined(e, node) and need(e.gens, slots) <= cap
end

-- whether waiter `e` takes `free` slots of `node` (it fits), or holds them back for itself (it waits on it)
local function claims(e, node, free, slots)
  return need(e.gens, slots) <= free or e.hold == '' or e.hold == node
end

-- which of `ranked` (the waiters `node` could serve, in queue order) takes the node's next slots, `free` of
-- them, and the ones passed over for it. The head, or - prefix affinity within fairness - among the first few
-- requests exactly as deserving as the head (same class, same tenant load) one whose prompt this node holds;
-- a request can be passed over at most MAX_PASSES times, so nobody waits long for it. A request running
-- several generations that does not fit in `free` holds the slots back for itself only on the node it waits
-- on (`hold`; none known - an older router's entry - every node): elsewhere the requests behind it go first.
-- nil: the head needs more than `free` and nobody may pass it.
local function pick(prefix, now, node, ranked, free, slots)
  local live = {}  -- the places in `ranked` of those who take or hold this node's slots, the first few
  for i, e in ipairs(ranked) do
    if claims(e, node, free, slots) then
      live[#live + 1] = i
      if #live >= AFFINITY_SKIP then break end
    end
  end
  if #live == 0 then return nil end
  local head = ranked[live[1]]
  local head_load = tenant_load(prefix, head.tenant, now)
  for j, i in ipairs(live) do
    local e = ranked[i]
    if e.prio ~= head.prio or tenant_load(prefix, e.tenant, now) ~= head_load then break end
    if e.pref == node and need(e.gens, slots) <= free then return i, {unpack(live, 1, j - 1)} end
    if e.passes >= MAX_PASSES then break end
  end
  if need(head.gens, slots) <= free then return live[1], {} end
  return nil
end

-- slots on `node` are free: reserve them for the first waiting requests that node can serve, in queue order,
-- and return how many were handed over. A request waits for all the slots it needs on one node at once, and
-- the requests behind it wait too: freed slots are held back for it, or single requests taking each one as it
-- frees could starve it (as they can in llama-server's own deferred queue, which lets them pass).
local function hand_over(prefix, node, now, lease)
  if redis.call('EXISTS', prefix .. 'queue') == 0 then return 0 end  -- nobody waits: the common case
  local f = redis.call('HMGET', prefix .. 'node:' .. node, 'capacity', 'state', 'models', 'slots')
  local cap, slots = tonumber(f[1]), tonumber(f[4])
  if not cap or cap <= 0 or f[2] ~= 'ready' or redis.call('SISMEMBER', prefix .. 'drained', node) == 1 then
    return 0
  end
  local rkey = prefix .. 'resv:' .. node
  redis.call('ZREMRANGEBYSCORE', rkey, '-inf', now)
  local free = cap - redis.call('ZCARD', rkey)
  if free <= 0 then return 0 end
  local ranked = {}
  for _, e in ipairs(queue_entries(prefix, now)) do
    if eligible(e, node, f[3], slots, cap) then ranked[#ranked + 1] = e end
  end
  local handed = 0
  while #ranked > 0 do
    table.sort(ranked, function(a, b) return before(prefix, now, a, b) end)
    local i, passed = pick(prefix, now, node, ranked, free, slots)
    if not i then break end
    for _, j in ipairs(passed) do  -- passed over for affinity
      local p = ranked[j]
      p.passes = p.passes + 1
      redis.call('HSET', prefix .. 'qmeta', p.rid, record(p))
    end
    local e = ranked[i]
    local k = need(e.gens, slots)
    -- the slots are the waiter's while its place in the queue lasts: they lapse with it (a waiter whose place
    -- lapsed asks again as a new arrival, which could take other slots besides, or wait behind these)
    local place = tonumber(redis.call('ZSCORE', prefix .. 'queue', e.rid)) - now
    reserve(prefix, node, e.rid, e.tenant, now, math.min(lease, place), k, true)
    e.mark = 'g:' .. node
    redis.call('HSET', prefix .. 'qmeta', e.rid, record(e))
    redis.call('PUBLISH', prefix .. 'events', 'granted ' .. e.rid .. ' ' .. node .. ' ' .. k)
    table.remove(ranked, i)
    free, handed = free - k, handed + k
    if free == 0 then break end
  end
  return handed
end

-- a waiter running several generations left the queue (it got its slots, was shed, or gave up): the free
-- slots the nodes it could run on held back for it go to the next in line now, not at their next release.
-- The queue is read and ranked once, not once per node: a full hand-over runs only on a node that will
-- hand a slot over.
local function pass_on(prefix, nodes, now, lease)
  local waiting = nil  -- every waiter not yet handed a slot, in queue order
  for _, node in ipairs(nodes) do
    local f = redis.call('HMGET', prefix .. 'node:' .. node, 'capacity', 'state', 'models', 'slots')
    local cap, slots = tonumber(f[1]), tonumber(f[4])
    local free = 0
    if cap and cap > 0 and f[2] == 'ready' and redis.call('SISMEMBER', prefix .. 'drained', node) == 0 then
      -- (a lease ending at `now` is over, as hand_over drops it)
      free = cap - redis.call('ZCOUNT', prefix .. 'resv:' .. node, '(' .. now, '+inf')
    end
    if free > 0 then
      if waiting == nil then
        waiting = {}
        for _, e in ipairs(queue_entries(prefix, now)) do
          if e.mark == '' then waiting[#waiting + 1] = e end
        end
        table.sort(waiting, function(a, b) return before(prefix, now, a, b) end)
      end
      local ranked = {}  -- the first of them this node could serve (pick looks no further)
      for _, e in ipairs(waiting) do
        if #ranked >= AFFINITY_SKIP then break end
        if eligible(e, node, f[3], slots, cap) and claims(e, node, free, slots) then
          ranked[#ranked + 1] = e
        end
      end
      if #ranked > 0 and pick(prefix, now, node, ranked, free, slots) then
        hand_over(prefix, node, now, lease)
        waiting = nil  -- it marked some
      end
    end
  end
end

-- give back the k slots `rid` holds on `node` (nil or 0: however many it holds) and hand them to waiting
-- requests, unless `keep`; the slots nobody was handed are announced, one `freed` message each
local function release(prefix, node, rid, tenant, now, lease, keep, k)
  local rkey = prefix .. 'resv:' .. node
  if not k or k <= 0 then k = held(rkey, rid) end
  local removed = 0
  if k > 0 then removed = redis.call('ZREM', rkey, unpack(members(rid, k))) end
  redis.call('ZREM', prefix .. 'tenant:' .. tenant, rid)
  loads[tenant] = nil
  if removed > 0 then
    local handed = keep and 0 or hand_over(prefix, node, now, lease)
    for _ = 1, removed - handed do
      redis.call('PUBLISH', prefix .. 'events', 'freed ' .. node)
    end
  end
  return removed
end
"""

RESERVE_OR_ENQUEUE = _PRELUDE + """
-- ARGV: see reserve_argv()
local prefix = ARGV[1]
local now, lease = tonumber(ARGV[2]), tonumber(ARGV[3])
local rid = ARGV[4]
local queue_size = tonumber(ARGV[5])
local enqueue, dequeue = ARGV[6] == '1', ARGV[7] == '1'
local prio, tenant, model = ARGV[8], ARGV[9], ARGV[10]
local key_limit, batch_max = tonumber(ARGV[11]), tonumber(ARGV[12])
local abs_t, rel_t, max_entries = tonumber(ARGV[13]), tonumber(ARGV[14]), tonumber(ARGV[15])
local queue_lease = tonumber(ARGV[16])  -- waiters renew their place every attempt, so this is short
local excluded = ARGV[17]  -- nodes this request's router no longer sends it to, newline-separated
local gens = tonumber(ARGV[18])  -- generations it runs at once: on each node it holds need(gens, slots) slots
local n_hashes = tonumber(ARGV[19])
local qkey, mkey = prefix .. 'queue', prefix .. 'qmeta'

-- this request leaves the queue: if it runs several generations, the slots held back for it go on
local function leave(e)
  if e.gens <= 1 then return end
  local nodes = {}
  for i = 20 + n_hashes, #ARGV, 3 do nodes[#nodes + 1] = ARGV[i] end
  pass_on(prefix, nodes, now, queue_lease)
end

-- remember that `node` now holds this request's prompt prefixes (least recently used ones dropped)
local function remember(node)
  if n_hashes == 0 then return end
  local akey, lkey = prefix .. 'affinity', prefix .. 'affinity:lru'
  local pairs_, scores = {}, {}
  for i = 20, 19 + n_hashes do
    pairs_[#pairs_ + 1] = ARGV[i]; pairs_[#pairs_ + 1] = node
    scores[#scores + 1] = now; scores[#scores + 1] = ARGV[i]
  end
  redis.call('HSET', akey, unpack(pairs_))
  redis.call('ZADD', lkey, unpack(scores))
  -- at most 1,000 of the oldest per call (Lua's unpack has a limit; a lowered bound converges over calls)
  local over = math.min(redis.call('ZCARD', lkey) - max_entries, 1000)
  if over > 0 then
    local old = redis.call('ZRANGE', lkey, 0, over - 1)
    redis.call('ZREMRANGEBYRANK', lkey, 0, over - 1)
    redis.call('HDEL', akey, unpack(old))
  end
end

local entries = queue_entries(prefix, now)
local me, turned_down = nil, false
if dequeue then
  for _, e in ipairs(entries) do
    if e.rid == rid then me = e end
  end
  if me and me.mark == 'shed' then
    redis.call('ZREM', qkey, rid)
    redis.call('HDEL', mkey, rid)
    leave(me)
    return {'shed', '', 0, ''}
  end
  if me and string.sub(me.mark, 1, 2) == 'g:' then
    local node = string.sub(me.mark, 3)
    local wanted = false  -- a release hands a slot over by model only: is its node one this request takes?
    for i = 20 + n_hashes, #ARGV, 3 do
      if ARGV[i] == node then wanted = true end
    end
    local rkey = prefix .. 'resv:' .. node
    local k = wanted and held(rkey, rid) or 0
    if k > 0 then
      -- the slots were handed over with the short queue lease (in case this waiter's router is dead): now
      -- that the waiter is alive to take them, they get the full lease
      redis.call('ZREM', qkey, rid)
      redis.call('HDEL', mkey, rid)
      redis.call('ZADD', rkey, 'XX', unpack(scored(rid, k, now + lease)))
      redis.call('PEXPIRE', rkey, lease * 2)  -- (the hand-over may have created the key, with a short TTL)
      redis.call('ZADD', prefix .. 'tenant:' .. tenant, 'XX', now + lease, rid)
      redis.call('PEXPIRE', prefix .. 'tenant:' .. tenant, lease * 2)
      remember(node)
      leave(me)
      local outcome = ''
      if me.hashed ~= '' then
        outcome = me.pref == node and 'hit' or (me.pref ~= '' and 'overridden' or 'miss')
      end
      return {'reserved', node, redis.call('ZCOUNT', rkey, now, '+inf'), outcome, k}
    end
    if not wanted then
      -- declined (a node this request already tried, or whose circuit is open in its router): the slots go
      -- on to the next in line (this request, still marked, is not among them) and this one waits on
      release(prefix, node, rid, me.tenant, now, queue_lease, false)
      me.declined, turned_down = excluded, true
      if not declined(me, node) then
        me.declined = excluded == '' and node or excluded .. '\\n' .. node
      end
    end
    -- (a handed-over slot that lapsed before it was taken: this request waits on like any other)
    me.mark = ''
    redis.call('HSET', mkey, rid, record(me))
    entries = queue_entries(prefix, now)  -- the hand-over may have marked another entry
  end
end

if me == nil and key_limit > 0 then
  local n = redis.call('ZCOUNT', prefix .. 'tenant:' .. tenant, now, '+inf')
  for _, e in ipairs(entries) do
    if e.tenant == tenant and e.mark == '' then n = n + 1 end
  end
  if n >= key_limit then return {'limited', '', n, ''} end
end

-- waiting requests queued ahead of this one for the same model; and, asking for another name (or none),
-- those ahead of it running several generations, who may hold slots back on the nodes it could go to
local mine = {rid = rid, prio = prio, tenant = tenant, enq = me and me.enq or now}
local ahead, others, waiting, waiting_batch, last_batch = {}, {}, 0, 0, nil
for _, e in ipairs(entries) do
  if e.mark == '' and e.rid ~= rid then
    waiting = waiting + 1
    if e.prio == 'batch' then
      waiting_batch = waiting_batch + 1
      if last_batch == nil or before(prefix, now, last_batch, e) then last_batch = e end
    end
    if e.model == model then
      if before(prefix, now, e, mine) then ahead[#ahead + 1] = e end
    elseif e.gens > 1 and before(prefix, now, e, mine) then
      others[#others + 1] = e
    end
  end
end

-- the candidates that take requests now: candidate c is node ids[c], with ns[c] reservations, capacity
-- caps[c] and llama-server's slots[c]; at[c] is its place in ARGV (arrays, not a table per candidate: this
-- runs for every request, over every candidate)
local ids, ns, caps, slots, at, known = {}, {}, {}, {}, {}, {}
local drained = prefix .. 'drained'
for i = 20 + n_hashes, #ARGV, 3 do
  local id = ARGV[i]
  known[id] = true
  local f = redis.call('HMGET', prefix .. 'node:' .. id, 'capacity', 'state', 'slots')
  local cap = tonumber(f[1])
  if cap and cap > 0 and f[2] == 'ready' and redis.call('SISMEMBER', drained, id) == 0 then
    local rkey = prefix .. 'resv:' .. id
    redis.call('ZREMRANGEBYSCORE', rkey, '-inf', now)
    local c = #ids + 1
    ids[c], ns[c], caps[c], slots[c], at[c] = id, redis.call('ZCARD', rkey), cap, tonumber(f[3]), i
  end
end

-- the models candidate `c` serves, read only for a waiter asking for another name than this request
local mods = {}
local function models_of(c)
  if mods[c] == nil then mods[c] = redis.call('HGET', prefix .. 'node:' .. ids[c], 'models') or '' end
  return mods[c]
end

-- whether queue entry `e` could run on candidate `c` (it needs k slots there)
local function runs_on(e, c)
  local k = need(e.gens, slots[c])
  return k <= caps[c] and not declined(e, ids[c]) and (e.model == model or serves(models_of(c), e.model)), k
end

-- the node a request running several generations waits on when it fits on none now: of those it could run
-- on, the one with the most free slots (ties: the lowest id), so the fewest slots wait idle for it. Its free
-- slots are held back for it; the other nodes' go to the requests behind it meanwhile.
local function designate(e)
  local best_id, most = '', -1
  for c = 1, #ids do
    if runs_on(e, c) then
      local f = caps[c] - ns[c]
      if f > most or (f == most and ids[c] < best_id) then best_id, most = ids[c], f end
    end
  end
  return best_id
end

-- whether `node`, not one of the candidates, could run queue entry `e` now (the node it waits on, say, where
-- this request is not sent: its router tried it, or its circuit is open, or it is too small for this request)
local function runs_elsewhere(e, node)
  local f = redis.call('HMGET', prefix .. 'node:' .. node, 'capacity', 'state', 'models', 'slots')
  local cap = tonumber(f[1])
  return cap ~= nil and cap > 0 and f[2] == 'ready' and redis.call('SISMEMBER', drained, node) == 0
    and serves(f[3], e.model) and not declined(e, node) and need(e.gens, tonumber(f[4])) <= cap
end

-- a request ahead running several generations that fits on none of them now waits for slots to free on one
-- (its `hold`): that node holds its free slots back for it (as hand_over does), from this request too, and
-- the request is not counted among those ahead taking the other nodes' free slots. (An older router's entry
-- has no `hold`: it holds back every node it could run on.) Slots held back for one are not room for those
-- behind it, so they are looked at in queue order.
local several = others
for _, e in ipairs(ahead) do
  if e.gens > 1 then several[#several + 1] = e end
end
if #several > 1 then table.sort(several, function(a, b) return before(prefix, now, a, b) end) end
local held_back, waiting_on = {}, {}
for _, e in ipairs(several) do
  local fits, runs = false, {}
  for c = 1, #ids do
    local ok, k = runs_on(e, c)
    if ok then
      runs[ids[c]] = true
      if ns[c] + k <= caps[c] and not held_back[ids[c]] then fits = true; break end
    end
  end
  if not fits then
    waiting_on[e.rid] = true
    local hold = e.hold
    if hold ~= '' and not runs[hold] and (known[hold] or not runs_elsewhere(e, hold)) then
      hold = designate(e)  -- gone, drained, or turned down since
    end
    if hold == '' then
      for id in pairs(runs) do held_back[id] = true end
    else
      held_back[hold] = true
    end
  end
end

-- the least-utilised candidate with the free slots it needs (ties: faster node, then random)
local best, best_util, best_tps, best_rand, best_n, best_k = nil, 2.0, -1.0, 0.0, 0, 1
local free, open = 0, {}  -- open: node id -> its candidate number, for the nodes with room for this request
for c = 1, #ids do
  local n, cap = ns[c], caps[c]
  local k = need(gens, slots[c])
  if not held_back[ids[c]] then
    if n < cap then free = free + cap - n end
    if n + k <= cap then
      local util = n / cap
      open[ids[c]] = c
      local tps, rnd = tonumber(ARGV[at[c] + 1]), tonumber(ARGV[at[c] + 2])
      local better = util < best_util
      if util == best_util then
        better = tps > best_tps or (tps == best_tps and rnd < best_rand)
      end
      if better then
        best, best_util, best_tps, best_rand, best_n, best_k = ids[c], util, tps, rnd, n, k
      end
    end
  end
end

-- prefix affinity: the node that served the longest known prefix, unless it is much busier (SGLang's rule)
local outcome, pref = '', ''
if n_hashes > 0 then
  outcome = 'miss'
  local owners = redis.call('HMGET', prefix .. 'affinity', unpack(ARGV, 20, 19 + n_hashes))
  for i = 1, n_hashes do
    local owner = owners[i]
    if owner and pref == '' and known[owner] then pref = owner end  -- kept with a queued request
    if owner and best then
      local o = open[owner]
      if o == nil then
        outcome = 'overridden'  -- full, gone or not a candidate: a shorter prefix may live elsewhere
      elseif ns[o] - best_n >= abs_t and ns[o] / caps[o] > best_util * rel_t then
        outcome = 'overridden'
        break
      else
        best, best_n, best_k, outcome = owner, ns[o], need(gens, slots[o]), 'hit'
        break
      end
    end
  end
end

-- free slots are left to the requests ahead, except those that turned down a slot on the node it is on or
-- could never run there (more generations at once than it holds)
local n_ahead = 0
if best then
  for _, e in ipairs(ahead) do
    local ok, k = runs_on(e, open[best])
    if ok and not waiting_on[e.rid] then n_ahead = n_ahead + k end
  end
end

if best and n_ahead + best_k <= free then
  reserve(prefix, best, rid, tenant, now, lease, best_k)
  if me then
    redis.call('ZREM', qkey, rid)
    redis.call('HDEL', mkey, rid)
    leave(me)
  end
  remember(best)
  return {'reserved', best, best_n + best_k, outcome, best_k}
end
if not enqueue then
  return {'full', '', waiting, ''}
end
if me then  -- still waiting: renew its place (and the nodes it turns down: circuits close, and open)
  redis.call('ZADD', qkey, now + queue_lease, rid)
  local was, changed = me.hold, false
  if not turned_down and me.declined ~= excluded then me.declined, changed = excluded, true end
  if me.gens > 1 then me.hold = designate(me) end
  if changed or me.hold ~= was then redis.call('HSET', mkey, rid, record(me)) end
  if me.hold ~= was and was ~= '' then pass_on(prefix, {was}, now, queue_lease) end  -- it waits elsewhere now
  return {'queued', '', waiting + 1, ''}
end
if waiting >= queue_size or (prio == 'batch' and waiting_batch >= batch_max) then
  if prio == 'batch' then
    return {waiting < queue_size and 'shed' or 'full', '', waiting, ''}
  end
  if last_batch == nil then
    return {'full', '', waiting, ''}
  end
  -- an interactive request takes the place of the last queued batch request
  last_batch.mark = 'shed'
  redis.call('HSET', mkey, last_batch.rid, record(last_batch))
  redis.call('PUBLISH', prefix .. 'events', 'shed ' .. last_batch.rid)
  waiting = waiting - 1
end
redis.call('ZADD', qkey, now + queue_lease, rid)
local hashed = n_hashes > 0 and '1' or ''
local entry = {prio = prio, tenant = tenant, model = model, enq = now, mark = '', pref = pref,
               hashed = hashed, passes = 0, declined = excluded, gens = gens, hold = ''}
if gens > 1 then entry.hold = designate(entry) end
redis.call('HSET', mkey, rid, record(entry))
redis.call('PEXPIRE', qkey, lease * 2)
redis.call('PEXPIRE', mkey, lease * 2)
return {'queued', '', waiting + 1, ''}
"""

RELEASE = _PRELUDE + """
-- ARGV: prefix, now_ms, queue_lease_ms (of a slot handed to a waiter until it takes it), request_id, node_id,
-- tenant, failed ('1': the node failed this request - its slots are not handed to a waiter, who would only
-- meet the same failure; waiters are told they are free and choose among the nodes they still trust), the
-- slots it holds (0: however many it holds there). Returns the slots released.
return release(ARGV[1], ARGV[5], ARGV[4], ARGV[6], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[7] == '1',
               tonumber(ARGV[8]))
"""

RENEW = """
-- KEYS: reservations key, tenant key; ARGV: request_id, new expiry ms, lease ms, the slots it holds
-- 1: renewed; 2: re-created - the lease was gone (Redis lost its data, or the lease had expired) while its
-- request still runs: counted again, or the pool would read idle and admit past what the nodes hold
local had = redis.call('ZSCORE', KEYS[1], ARGV[1])
local zadd = {ARGV[2], ARGV[1]}
for i = 2, tonumber(ARGV[4]) or 1 do
  zadd[#zadd + 1] = ARGV[2]; zadd[#zadd + 1] = ARGV[1] .. '#' .. i
end
redis.call('ZADD', KEYS[1], unpack(zadd))
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[3]) * 2)
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
redis.call('PEXPIRE', KEYS[2], tonumber(ARGV[3]) * 2)
if had then return 1 end
return 2
"""

LEAVE_QUEUE = _PRELUDE + """
-- ARGV: prefix, now_ms, queue_lease_ms, request_id, then the nodes it could run on if it runs several
-- generations at once (their free slots were held back for it). Slots already handed to it, and those held
-- back, go to the next in line.
local prefix, rid = ARGV[1], ARGV[4]
local now, queue_lease = tonumber(ARGV[2]), tonumber(ARGV[3])
local meta = redis.call('HGET', prefix .. 'qmeta', rid)
redis.call('ZREM', prefix .. 'queue', rid)
redis.call('HDEL', prefix .. 'qmeta', rid)
local out = 1
if meta then
  local f = fields(meta)
  if string.sub(f[5] or '', 1, 2) == 'g:' then
    release(prefix, string.sub(f[5], 3), rid, f[2], now, queue_lease)
    out = 2
  end
end
pass_on(prefix, {unpack(ARGV, 5)}, now, queue_lease)
return out
"""


HEARTBEAT = """
-- ARGV: prefix, node_id, doc, capacity, state, models, ttl_ms, updated_ms, instance, started_ms, slots
-- 1: written. Refused (the holder's doc) when another agent process holds the id and started later (ties
-- by instance): the old agent of a restart drains while the new one serves, and two Macs given one id
-- settle on one instead of taking turns.
local prefix, id, instance, started = ARGV[1], ARGV[2], ARGV[9], tonumber(ARGV[10])
local key = prefix .. 'node:' .. id
local held = redis.call('HMGET', key, 'instance', 'started', 'doc')
if held[1] and held[1] ~= '' and held[1] ~= instance then
  local since = tonumber(held[2]) or 0
  if since > started or (since == started and held[1] > instance) then
    return held[3] or ''
  end
end
redis.call('HSET', key, 'doc', ARGV[3], 'capacity', ARGV[4], 'state', ARGV[5], 'models', ARGV[6],
           'instance', instance, 'started', ARGV[10], 'slots', ARGV[11])
redis.call('PEXPIRE', key, tonumber(ARGV[7]))
redis.call('ZADD', prefix .. 'nodes', ARGV[8], id)
redis.call('PUBLISH', prefix .. 'events', 'node ' .. ARGV[3])
return 1
"""

DEREGISTER = """
-- ARGV: prefix, node_id, instance. 0 (nothing removed) when another agent process holds the id.
local prefix, id = ARGV[1], ARGV[2]
local key = prefix .. 'node:' .. id
local held = redis.call('HGET', key, 'instance')
if held and held ~= '' and held ~= ARGV[3] then return 0 end
redis.call('DEL', key)
redis.call('ZREM', prefix .. 'nodes', id)
redis.call('PUBLISH', prefix .. 'events', 'gone ' .. id)
return 1
"""

def reserve_argv(
    keys: Keys,
    request_id: str,
    lease_ms: int,
    candidates: list[tuple[str, float]],
    *,
    queue_size: int = 0,
    enqueue: bool = False,
    dequeue: bool = False,
    priority: Priority = "interactive",
    tenant: str = "anonymous",
    model: str = "",
    key_limit: int = 0,
    batch_queue_max: int = 0,
    prefixes: tuple[str, ...] = (),
    affinity_abs: int = 4,
    affinity_rel: float = 1.5,
    affinity_max_entries: int = 100_000,
    queue_lease_ms: int = 3_000,
    excluded: Collection[str] = (),
    generations: int = 1,
    now: int | None = None,
) -> list[str | int | float]:
    """The ARGV of :data:`RESERVE_OR_ENQUEUE`; candidates are (node id, tokens/s), prefixes longest first;
    ``excluded`` are nodes that serve the model but that the request's router no longer sends it to (tried
    already, circuit open): while it waits, no slot there is handed to it nor held back for it.
    ``generations``: how many the request runs at once (:func:`generations`); on each node it needs
    :func:`slots_needed` free slots, and holds that many.

    Returns ``[status, node_id, count, affinity]``, and for ``reserved`` a fifth: the slots it holds. Status
    is reserved, queued, full, shed (a batch request turned away, or a queued one whose place an interactive
    request took) or limited (the tenant is at its concurrency limit); affinity is "" (no prompt prefix),
    hit, miss or overridden - also for a request a release handed a slot to (hit when that node held its
    prefix).
    """
    args: list[str | int | float] = [
        keys.prefix, now_ms() if now is None else now, lease_ms, request_id, queue_size, int(enqueue),
        int(dequeue), priority, tenant, model, key_limit, batch_queue_max, affinity_abs, affinity_rel,
        affinity_max_entries, queue_lease_ms, "\n".join(excluded), generations, len(prefixes), *prefixes,
    ]
    for node_id, tokens_per_s in candidates:
        args += [node_id, tokens_per_s, random.random()]
    return args


# --- What a request costs a node ------------------------------------------------------------------

def generations(payload: dict[str, Any]) -> int:
    """How many generations llama-server runs for one request: one per prompt of a list of prompts, times
    ``n_cmpl`` (or its alias ``n``); each takes a slot, and its memory, while it runs. A value llama-server
    would refuse counts 1 (its own 400 answers the request)."""
    n = payload.get("n_cmpl")
    if n is None:  # absent or null: llama-server reads n
        n = payload.get("n")
    if type(n) is float and math.isfinite(n):
        n = int(n)  # llama-server reads a JSON number as an integer: 2.5 runs 2
    return _prompts(payload.get("prompt")) * (n if type(n) is int and n > 1 else 1)


def _prompts(prompt: object) -> int:
    """The prompts in a request's ``prompt``: a list of them, unless it is one prompt - token ids, or strings
    and token ids mixed (llama-server tokenizes the strings in place)."""
    if not isinstance(prompt, list) or any(type(token) is int for token in prompt):
        return 1
    return len(prompt) or 1


def slots_needed(generations: int, total_slots: int) -> int:
    """The slots a request of ``generations`` holds at once on a llama-server of ``total_slots`` (0: unknown):
    past its slots, llama-server queues the rest of a request's generations."""
    return min(generations, total_slots) if total_slots > 0 else generations


# --- The heartbeat path and the pool read, shared by both sides -----------------------------------

async def write_heartbeat(redis: Redis, keys: Keys, doc: NodeDoc, ttl_ms: int) -> str | None:
    """Write one heartbeat atomically and announce it on the events channel.

    Returns None when written, else the URL of the agent started later that holds this node id (this beat
    was refused). Sent with EVAL, not EVALSHA: once a second per node, and the scale benchmark tells the
    heartbeats (background) from the admission scripts (per request) by the command.
    """
    result = await redis.eval(
        HEARTBEAT, 0, keys.prefix, doc.node_id, doc.encode(), doc.capacity, doc.state, "\n".join(doc.models),
        ttl_ms, doc.updated_at_ms or now_ms(), doc.instance, doc.started_at_ms, doc.total_slots,
    )
    if result == 1:
        return None
    holder = NodeDoc.decode(result) if result else None
    return holder.url if holder is not None else ""


async def remove_node(redis: Redis, keys: Keys, node_id: str, instance: str = "") -> bool:
    """Clean shutdown: the node leaves the pool at once instead of after its TTL.

    False (nothing removed) when another agent process (``instance``) holds the id: one started later.
    """
    result = await redis.eval(DEREGISTER, 0, keys.prefix, node_id, instance)
    return bool(result)


class PoolSnapshot(BaseModel):
    """What Redis says about the pool at one moment."""

    nodes: dict[str, NodeDoc] = Field(default_factory=dict)
    reservations: dict[str, int] = Field(default_factory=dict)
    drained: set[str] = Field(default_factory=set)
    queue_depth: int = 0
    queued_slots: int = 0  # the slots the waiting requests will hold: one per generation each runs at once
    queued: dict[str, dict[str, int]] = Field(default_factory=dict)  # tenant -> priority -> waiting
    in_flight: dict[str, int] = Field(default_factory=dict)  # tenant -> requests in flight


async def read_pool(redis: Redis, keys: Keys, tenants: list[str] | None = None) -> PoolSnapshot:
    """Read every live node, its live reservations, the drained set and who waits in the queue.

    Two round trips whatever the pool size; index entries whose node key expired are pruned. ``tenants``
    also get their requests in flight counted.
    """
    now = now_ms()
    tenants = tenants or []
    async with redis.pipeline(transaction=False) as pipe:
        pipe.zrange(keys.nodes, 0, -1)
        pipe.smembers(keys.drained)
        pipe.zrangebyscore(keys.queue, now, "+inf")
        pipe.hgetall(keys.queue_meta)
        for tenant in tenants:
            pipe.zcount(keys.tenant(tenant), now, "+inf")
        ids_raw, drained_raw, waiting_raw, meta_raw, *loads = await pipe.execute()
    ids = [_text(i) for i in ids_raw]
    snapshot = PoolSnapshot(drained={_text(d) for d in drained_raw},
                            in_flight=dict(zip(tenants, (int(n) for n in loads), strict=True)))
    meta = {_text(k): _text(v).split("\t") for k, v in meta_raw.items()}
    for rid in waiting_raw:
        record = meta.get(_text(rid))
        if record is None or len(record) < 5 or record[4]:
            continue  # not waiting any more: handed a slot, or shed
        priority, tenant = record[0], record[1]
        by_priority = snapshot.queued.setdefault(tenant, {})
        by_priority[priority] = by_priority.get(priority, 0) + 1
        snapshot.queue_depth += 1
        snapshot.queued_slots += int(record[9]) if len(record) > 9 and record[9].isdigit() else 1
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
