-- Shared by the admission scripts (reserve, release, leave, offer, beat, renew, forget), which are this file
-- followed by their own text (macpool/store/scripts.py).
--
-- Every key a script touches is in KEYS (Keys.admission): the pool-wide keys, in Keys.pool_wide() order,
-- then the heartbeat and reservations of each node the call declares, whose ids ARGV[1] lists one per line.
-- No key name is built here: a node not declared is one this call cannot see (node_key and resv_key answer
-- nil), and each use of them says what that means. ARGV[2] is the events channel, ARGV[3] the time (ms),
-- ARGV[4] the call's own arguments, one JSON document of named fields (ARGS; macpool/store/api.py writes it
-- and each script's header names its fields).
local K = {queue = KEYS[1], qmeta = KEYS[2], drained = KEYS[3], affinity = KEYS[4], lru = KEYS[5],
           routers = KEYS[6], inflight = KEYS[7], counts = KEYS[8], held = KEYS[9], events = ARGV[2]}
local NOW = tonumber(ARGV[3])
local ARGS = cjson.decode(ARGV[4])
local NODE, RESV = {}, {}  -- declared node id -> its heartbeat key, its reservations key
do
  local i = 10
  for id in string.gmatch(ARGV[1], '[^\n]+') do
    NODE[id], RESV[id] = KEYS[i], KEYS[i + 1]
    i = i + 2
  end
end
local function node_key(id) return NODE[id] end
local function resv_key(id) return RESV[id] end

-- The records the scripts keep are JSON documents; these are the only places that name their fields
-- (macpool/store/api.py reads the few it needs by the same names).
--
-- The queue record, K.qmeta: waiter id -> {priority, tenant, model, arrival (ms), mark, preferred, hashed,
-- passes, declined, generations, hold}. mark: "" (waiting), "g:<node>" (a release reserved its slots on
-- <node> for it: it only has to take them) or "shed" (an interactive request took its place). preferred: the
-- node holding its prompt prefix (affinity; hashed: it has prefixes at all); passes: how often a hand-over
-- passed it over for affinity. declined: the nodes it turned a handed-over slot down on - nodes its router
-- no longer sends it to (tried already, or circuit open there): no slot there is handed to it again, nor held
-- back for it from later arrivals. generations: how many it runs at once (each holds a slot); hold: the node
-- it waits on when it fits on none now ("": every node it could run on).
-- K.queue holds each waiter's lease expiry (short, renewed on each attempt): a queue entry is the record
-- with its id, `rid`.
local function record(e)
  return cjson.encode({priority = e.priority, tenant = e.tenant, model = e.model, arrival = e.arrival,
                       mark = e.mark, preferred = e.preferred, hashed = e.hashed, passes = e.passes,
                       declined = e.declined, generations = e.generations, hold = e.hold})
end

local function entry(rid, text)
  local e = cjson.decode(text)
  e.rid = rid
  return e
end

-- The held record, K.held: request id -> {router, node, tenant, slots}, the reservations each router holds
-- (see reclaim).
local function held_record(router, node, tenant, k)
  return cjson.encode({router = router, node = node, tenant = tenant, slots = k})
end

-- A request holding k slots is k members of its node's reservations (see members()).
-- Queue order, for each model: interactive before batch, then the tenant with the fewest requests in flight,
-- then the oldest - except that a release may hand its slot to a request that prefers that node among the
-- first AFFINITY_SKIP equally ranked ones (passing each over at most MAX_PASSES times). Both are trimmed when
-- the waiter's lease runs out.
local AFFINITY_SKIP = 8  -- queued requests a hand-over may look past the head for one this node has cached
local MAX_PASSES = 4  -- ... and how often one request may be passed over that way

-- every live queue entry; expired entries are dropped here
local function queue_entries(now)
  local qkey, mkey = K.queue, K.qmeta
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
    if metas[i] then out[#out + 1] = entry(rid, metas[i]) end
  end
  return out
end

-- whether queue entry `e` turned down a slot on `node` before
local function declined(e, node)
  for _, id in ipairs(e.declined) do
    if id == node then return true end
  end
  return false
end

-- Requests in flight, by tenant, across every router: K.inflight holds "tenant \t rid" -> lease expiry, and
-- K.counts tenant -> how many members K.inflight holds for it. The expired members are pruned (and the
-- counts with them) before a count is read.
local function count(tenant, delta)
  if redis.call('HINCRBY', K.counts, tenant, delta) <= 0 then redis.call('HDEL', K.counts, tenant) end
end

local function in_flight(tenant, rid, expiry, existing)
  local member = tenant .. '\t' .. rid
  if existing then  -- (only renew a lease still there)
    redis.call('ZADD', K.inflight, 'XX', expiry, member)
  elseif redis.call('ZADD', K.inflight, expiry, member) == 1 then
    count(tenant, 1)
  end
end

local function not_in_flight(tenant, rid)
  if redis.call('ZREM', K.inflight, tenant .. '\t' .. rid) == 1 then count(tenant, -1) end
end

local pruned = false
local function prune(now)
  if pruned then return end
  pruned = true
  -- at most 1,000 per call (Lua's unpack has a limit): counts read high meanwhile, never low
  local gone = redis.call('ZRANGEBYSCORE', K.inflight, '-inf', '(' .. now, 'LIMIT', 0, 1000)
  if #gone == 0 then return end
  redis.call('ZREM', K.inflight, unpack(gone))
  for _, member in ipairs(gone) do
    count(string.sub(member, 1, string.find(member, '\t', 1, true) - 1), -1)
  end
end

local loads = {}
-- requests a tenant has in flight (reserved), across every router
local function tenant_load(tenant, now)
  local n = loads[tenant]
  if n == nil then
    prune(now)
    n = tonumber(redis.call('HGET', K.counts, tenant)) or 0
    loads[tenant] = n
  end
  return n
end

-- queue order: interactive first, then the tenant with fewer requests in flight, then the oldest
local function before(now, a, b)
  local pa, pb = a.priority == 'batch' and 1 or 0, b.priority == 'batch' and 1 or 0
  if pa ~= pb then return pa < pb end
  local la, lb = tenant_load(a.tenant, now), tenant_load(b.tenant, now)
  if la ~= lb then return la < lb end
  if a.arrival ~= b.arrival then return a.arrival < b.arrival end
  return a.rid < b.rid
end

-- the slots a request running `gens` generations holds on a node of `slots` llama-server slots (nil or 0:
-- unknown): llama-server queues the generations past its slots (macpool/contract.py's slots_needed)
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

-- reserve k slots on `node` (declared) for `rid` until now + lease. A hand-over's lease is a short one, what
-- is left of the waiter's place in the queue (`short`): it must not cut short the TTL of the key the node's
-- other reservations live in
local function reserve(node, rid, tenant, now, lease, k, short)
  local rkey, ttl = resv_key(node), lease * 2
  redis.call('ZADD', rkey, unpack(scored(rid, k, now + lease)))
  if not short or redis.call('PTTL', rkey) < ttl then redis.call('PEXPIRE', rkey, ttl) end
  in_flight(tenant, rid, now + lease)
  loads[tenant] = nil
end

-- a running request's k slots on `node` (declared) last until `expiry`; false when they were gone (Redis
-- lost its data, or the lease had expired) and have been written again: the request still runs, and were it
-- not counted the pool would read idle and admit past what the node holds
local function extend(node, rid, tenant, k, expiry, lease)
  local rkey = resv_key(node)
  local had = redis.call('ZSCORE', rkey, rid)
  redis.call('ZADD', rkey, unpack(scored(rid, k, expiry)))
  redis.call('PEXPIRE', rkey, lease * 2)
  in_flight(tenant, rid, expiry)
  loads[tenant] = nil
  return had ~= false
end

-- take the k slots `rid` holds on `node` (nil or 0: however many it holds) out of its reservations, and the
-- request out of those in flight; the slots removed. On a node not declared, only its count in flight goes:
-- its slots lapse with their lease.
local function drop(node, rid, tenant, k)
  not_in_flight(tenant, rid)
  loads[tenant] = nil
  local rkey = resv_key(node)
  if not rkey then return 0 end
  if not k or k <= 0 then k = held(rkey, rid) end
  if k <= 0 then return 0 end
  return redis.call('ZREM', rkey, unpack(members(rid, k)))
end

local function serves(models, model)
  if model == '' then return true end
  if not models then return false end
  for m in string.gmatch(models, '[^\n]+') do
    if m == model then return true end
  end
  return false
end

-- node `id` as its heartbeat says, if it takes requests now - declared, ready, with capacity, not drained:
-- {id, cap (capacity), models (newline-separated), slots (llama-server's; 0: unknown)}; else nil
local function usable(id)
  local key = node_key(id)
  if not key then return nil end
  local f = redis.call('HMGET', key, 'capacity', 'state', 'models', 'slots')
  local cap = tonumber(f[1])
  if not cap or cap <= 0 or f[2] ~= 'ready' or redis.call('SISMEMBER', K.drained, id) == 1 then return nil end
  return {id = id, cap = cap, models = f[3], slots = tonumber(f[4]) or 0}
end

-- whether queue entry `e` waits for a slot `node` (usable) could give it
local function eligible(e, node)
  return e.mark == '' and serves(node.models, e.model) and not declined(e, node.id)
    and need(e.generations, node.slots) <= node.cap
end

-- whether waiter `e` takes `free` slots of `node` (it fits), or holds them back for itself (it waits on it)
local function claims(e, node, free)
  return need(e.generations, node.slots) <= free or e.hold == '' or e.hold == node.id
end

-- which of `ranked` (the waiters `node` could serve, in queue order) takes the node's next slots, `free` of
-- them, and the ones passed over for it. The head, or - prefix affinity within fairness - among the first few
-- requests exactly as deserving as the head (same class, same tenant load) one whose prompt this node holds;
-- a request can be passed over at most MAX_PASSES times, so nobody waits long for it. A request running
-- several generations that does not fit in `free` holds the slots back for itself only on the node it waits
-- on (`hold`; none: every node): elsewhere the requests behind it go first.
-- nil: the head needs more than `free` and nobody may pass it.
local function pick(now, node, ranked, free)
  local live = {}  -- the places in `ranked` of those who take or hold this node's slots, the first few
  for i, e in ipairs(ranked) do
    if claims(e, node, free) then
      live[#live + 1] = i
      if #live >= AFFINITY_SKIP then break end
    end
  end
  if #live == 0 then return nil end
  local head = ranked[live[1]]
  local head_load = tenant_load(head.tenant, now)
  for j, i in ipairs(live) do
    local e = ranked[i]
    if e.priority ~= head.priority or tenant_load(e.tenant, now) ~= head_load then break end
    if e.preferred == node.id and need(e.generations, node.slots) <= free then
      return i, {unpack(live, 1, j - 1)}
    end
    if e.passes >= MAX_PASSES then break end
  end
  if need(head.generations, node.slots) <= free then return live[1], {} end
  return nil
end

-- slots on node `id` are free: reserve them for the first waiting requests that node can serve, in queue
-- order, and return how many were handed over. A request waits for all the slots it needs on one node at
-- once, and the requests behind it wait too: freed slots are held back for it, or single requests taking each
-- one as it frees could starve it (as they can in llama-server's own deferred queue, which lets them pass).
local function hand_over(id, now, lease)
  if redis.call('EXISTS', K.queue) == 0 then return 0 end  -- nobody waits: the common case
  local node = usable(id)  -- (not declared: its slots wait for the waiters' next look)
  if not node then return 0 end
  local rkey = resv_key(id)
  redis.call('ZREMRANGEBYSCORE', rkey, '-inf', now)
  local free = node.cap - redis.call('ZCARD', rkey)
  if free <= 0 then return 0 end
  local ranked = {}
  for _, e in ipairs(queue_entries(now)) do
    if eligible(e, node) then ranked[#ranked + 1] = e end
  end
  local handed = 0
  while #ranked > 0 do
    table.sort(ranked, function(a, b) return before(now, a, b) end)
    local i, passed = pick(now, node, ranked, free)
    if not i then break end
    for _, j in ipairs(passed) do  -- passed over for affinity
      local p = ranked[j]
      p.passes = p.passes + 1
      redis.call('HSET', K.qmeta, p.rid, record(p))
    end
    local e = ranked[i]
    local k = need(e.generations, node.slots)
    -- the slots are the waiter's while its place in the queue lasts: they lapse with it (a waiter whose place
    -- lapsed asks again as a new arrival, which could take other slots besides, or wait behind these)
    local place = tonumber(redis.call('ZSCORE', K.queue, e.rid)) - now
    reserve(id, e.rid, e.tenant, now, math.min(lease, place), k, true)
    e.mark = 'g:' .. id
    redis.call('HSET', K.qmeta, e.rid, record(e))
    redis.call('PUBLISH', K.events, 'granted ' .. e.rid .. ' ' .. id .. ' ' .. k)
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
local function pass_on(ids, now, lease)
  local waiting = nil  -- every waiter not yet handed a slot, in queue order
  for _, id in ipairs(ids) do
    local node = usable(id)
    -- (a lease ending at `now` is over, as hand_over drops it)
    local free = node and node.cap - redis.call('ZCOUNT', resv_key(id), '(' .. now, '+inf') or 0
    if free > 0 then
      if waiting == nil then
        waiting = {}
        for _, e in ipairs(queue_entries(now)) do
          if e.mark == '' then waiting[#waiting + 1] = e end
        end
        table.sort(waiting, function(a, b) return before(now, a, b) end)
      end
      local ranked = {}  -- the first of them this node could serve (pick looks no further)
      for _, e in ipairs(waiting) do
        if #ranked >= AFFINITY_SKIP then break end
        if eligible(e, node) and claims(e, node, free) then ranked[#ranked + 1] = e end
      end
      if #ranked > 0 and pick(now, node, ranked, free) then
        hand_over(id, now, lease)
        waiting = nil  -- it marked some
      end
    end
  end
end

-- give back the k slots `rid` holds on `node` (nil or 0: however many it holds) and hand them to waiting
-- requests, unless `keep`; the slots nobody was handed are announced, one `freed` message each. On a node
-- not declared, only the request's count in flight is given back: its slots lapse with their lease.
local function release(node, rid, tenant, now, lease, keep, k)
  local removed = drop(node, rid, tenant, k)
  if removed > 0 then
    local handed = keep and 0 or hand_over(node, now, lease)
    for _ = 1, removed - handed do
      redis.call('PUBLISH', K.events, 'freed ' .. node)
    end
  end
  return removed
end

-- Router liveness. K.routers holds each router's id -> until when it counts as alive (ms): it beats from a
-- thread of its own, so a router that is only slow keeps beating. K.held holds the reservations each router
-- holds (held_record). A router that stops beating has them given back (and handed to waiters) by the next
-- beat of any router (beat.lua): its crash costs capacity for its liveness period, not for the lease.

-- `router` (if named) now holds k slots on `node` for `rid`
local function track(router, rid, node, tenant, k)
  if not router or router == '' then return end
  redis.call('HSET', K.held, rid, held_record(router, node, tenant, k))
end

local function untrack(rid)
  redis.call('HDEL', K.held, rid)
end

-- give back what the routers that stopped beating held (a few routers per call); the slots given back.
-- The caller declares every node of the pool: a reservation on a node not declared is on one gone, and
-- lapses with its lease.
local function reclaim(now, lease)
  local dead = redis.call('ZRANGEBYSCORE', K.routers, '-inf', '(' .. now, 'LIMIT', 0, 4)
  if #dead == 0 then return 0 end
  local is_dead = {}
  for _, router in ipairs(dead) do is_dead[router] = true end
  local n = 0
  local all = redis.call('HGETALL', K.held)
  for i = 1, #all, 2 do
    local h = cjson.decode(all[i + 1])
    if is_dead[h.router] then
      n = n + release(h.node, all[i], h.tenant, now, lease, false, h.slots)
      redis.call('HDEL', K.held, all[i])
    end
  end
  redis.call('ZREM', K.routers, unpack(dead))
  return n
end
