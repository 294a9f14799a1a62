-- Shared by the admission scripts (reserve, release, leave, offer, beat, renew, forget), which are this file
-- followed by their own text (macpool/store/scripts.py).
--
-- Every key a script touches is in KEYS (Keys.admission): the pool-wide keys, in Keys.pool_wide() order,
-- then the heartbeat, reservations, tokens and sessions of each node the call declares, whose ids ARGV[1]
-- lists one per line. No key name is built here: a node not declared is one this call cannot see (node_key,
-- resv_key, toks_key and sess_key answer nil), and each use of them says what that means. ARGV[2] is the
-- events channel, ARGV[3] the time (ms), ARGV[4] the call's own arguments, one JSON document of named fields
-- (ARGS; macpool/store/api.py writes it and each script's header names its fields).
local K = {queue = KEYS[1], qmeta = KEYS[2], drained = KEYS[3], affinity = KEYS[4], lru = KEYS[5],
           routers = KEYS[6], inflight = KEYS[7], counts = KEYS[8], held = KEYS[9], events = ARGV[2]}
local NOW = tonumber(ARGV[3])
local ARGS = cjson.decode(ARGV[4])
-- declared node id -> its heartbeat, reservations, tokens and sessions keys
local NODE, RESV, TOKS, SESS = {}, {}, {}, {}
do
  local i = 10
  for id in string.gmatch(ARGV[1], '[^\n]+') do
    NODE[id], RESV[id], TOKS[id], SESS[id] = KEYS[i], KEYS[i + 1], KEYS[i + 2], KEYS[i + 3]
    i = i + 4
  end
end
local function node_key(id) return NODE[id] end
local function resv_key(id) return RESV[id] end
local function toks_key(id) return TOKS[id] end
local function sess_key(id) return SESS[id] end

-- The records the scripts keep are JSON documents; these are the only places that name their fields
-- (macpool/store/api.py reads the few it needs by the same names).
--
-- The queue record, K.qmeta: waiter id -> {priority, tenant, model, arrival (ms), mark, preferred, hashed,
-- passes, declined, generations, prompt_tokens, output_tokens, hold, stay}. mark: "" (waiting), "g:<node>" (a
-- release reserved its slots on <node> for it: it only has to take them) or "shed" (an interactive request
-- took its place). preferred: the node holding its prompt prefix (affinity; hashed: it has prefixes at
-- all); passes: how often a hand-over passed it over for affinity. declined: the nodes it turned a
-- handed-over slot down on - nodes its router no longer sends it to (tried already, or circuit open there):
-- no slot there is handed to it again, nor held back for it from later arrivals. generations: how many it
-- runs at once (each holds a slot); prompt_tokens and output_tokens: what it holds of a node's KV cache
-- (tokens_on); hold: the node it waits on when it fits on none now ("": every node it could run on); stay:
-- the node it chose to wait for, though it fits elsewhere, because that node's cache holds more of its prompt
-- (reserve.lua's worth_waiting; "": none): until it asks again, no other node's slots are its.
-- K.queue holds each waiter's lease expiry (short, renewed on each attempt): a queue entry is the record
-- with its id, `rid`.
local function record(e)
  return cjson.encode({priority = e.priority, tenant = e.tenant, model = e.model, arrival = e.arrival,
                       mark = e.mark, preferred = e.preferred, hashed = e.hashed, passes = e.passes,
                       declined = e.declined, generations = e.generations, prompt_tokens = e.prompt_tokens,
                       output_tokens = e.output_tokens, hold = e.hold, stay = e.stay})
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

-- A request holding k slots is k members of its node's reservations (see members()); one holding t tokens
-- there (t > 0) is also an entry rid -> t of the node's tokens, which come and go with its reservations.
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

-- the tokens a request of `prompt` tokens (0: not counted) and output limit `output` (0: none) holds of
-- `node`'s KV cache: prompt and output within the context one sequence may hold (seq_ctx), the output being
-- the node's default limit (n_predict) when the request sets none, else the rest of that context
local function tokens_on(prompt, output, node)
  if prompt <= 0 then return 0 end
  if node.seq_ctx <= 0 then return prompt + output end
  if output <= 0 then output = node.n_predict > 0 and node.n_predict or node.seq_ctx - prompt end
  return math.min(prompt + output, node.seq_ctx)
end

-- whether `node` could ever hold a request of k slots, t tokens and `prompt` tokens of prompt: within its
-- capacity, its shared cells (if its slots share them), and a prompt shorter than one sequence's context
local function could_hold(node, k, t, prompt)
  return k <= node.cap and (node.cells == 0 or t <= node.cells)
    and (node.seq_ctx <= 0 or prompt < node.seq_ctx)
end

-- whether k slots and t tokens fit in what `node` (tallied) has free now
local function fits(node, k, t)
  return node.n + k <= node.cap and (node.cells == 0 or node.used + t <= node.cells)
end

-- the slots and the tokens queue entry `e` would hold on `node`
local function size_on(e, node)
  return need(e.generations, node.slots), tokens_on(e.prompt_tokens, e.output_tokens, node)
end

-- reserve k slots and t tokens on `node` (declared) for `rid` until `expiry`, in keys that live at least
-- `ttl` ms more. A hand-over's lease is a short one, what is left of the waiter's place in the queue
-- (`short`): it must not cut short the TTL of the keys the node's other reservations live in
local function reserve(node, rid, tenant, expiry, ttl, k, t, short)
  local rkey = resv_key(node)
  redis.call('ZADD', rkey, unpack(scored(rid, k, expiry)))
  if not short or redis.call('PTTL', rkey) < ttl then redis.call('PEXPIRE', rkey, ttl) end
  if t > 0 then
    local tkey = toks_key(node)
    redis.call('HSET', tkey, rid, t)
    if not short or redis.call('PTTL', tkey) < ttl then redis.call('PEXPIRE', tkey, ttl) end
  end
  in_flight(tenant, rid, expiry)
  loads[tenant] = nil
end

-- a running request's k slots and t tokens on `node` (declared) last until `expiry`; false when they were
-- gone (Redis lost its data, or the lease had expired) and have been written again: the request still runs,
-- and were it not counted the pool would read idle and admit past what the node holds
local function extend(node, rid, tenant, k, t, expiry, lease)
  local rkey, tkey = resv_key(node), toks_key(node)
  local had = redis.call('ZSCORE', rkey, rid)
  redis.call('ZADD', rkey, unpack(scored(rid, k, expiry)))
  redis.call('PEXPIRE', rkey, lease * 2)
  if not had and t > 0 then redis.call('HSET', tkey, rid, t) end
  redis.call('PEXPIRE', tkey, lease * 2)  -- (the tokens a lease holds live as long as its slots)
  in_flight(tenant, rid, expiry)
  loads[tenant] = nil
  return had ~= false
end

-- take the k slots `rid` holds on `node` (nil or 0: however many it holds), and its tokens, out of the
-- node's reservations, and the request out of those in flight; the slots removed. On a node not declared,
-- only its count in flight goes: its slots and tokens lapse with their lease.
local function drop(node, rid, tenant, k)
  not_in_flight(tenant, rid)
  loads[tenant] = nil
  local rkey = resv_key(node)
  if not rkey then return 0 end
  redis.call('HDEL', toks_key(node), rid)
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
-- {id, cap (capacity), models (newline-separated), slots (llama-server's; 0: unknown), seq_ctx (the tokens
-- one sequence may hold; 0: unknown), cells (the cells its slots share, which bound the tokens reserved
-- there; 0: none shared or unknown, and slots alone bound it), n_predict}; else nil
local function usable(id)
  local key = node_key(id)
  if not key then return nil end
  local f = redis.call('HMGET', key, 'capacity', 'state', 'models', 'slots', 'seq_ctx', 'kv_unified',
                       'kv_cells', 'n_predict')
  local cap = tonumber(f[1])
  if not cap or cap <= 0 or f[2] ~= 'ready' or redis.call('SISMEMBER', K.drained, id) == 1 then return nil end
  return {id = id, cap = cap, models = f[3], slots = tonumber(f[4]) or 0, seq_ctx = tonumber(f[5]) or 0,
          cells = f[6] == '1' and tonumber(f[7]) or 0, n_predict = tonumber(f[8]) or -1}
end

-- `node` (usable) with its reservations whose lease ended by `now` dropped (and their tokens), and what the
-- others hold: n (reservations) and used (tokens; read only where cells bound them)
local function tally(node, now)
  local rkey = resv_key(node.id)
  local over = redis.call('ZRANGEBYSCORE', rkey, '-inf', now)
  if #over > 0 then
    redis.call('ZREMRANGEBYSCORE', rkey, '-inf', now)
    redis.call('HDEL', toks_key(node.id), unpack(over))
  end
  node.n, node.used = redis.call('ZCARD', rkey), 0
  if node.cells > 0 then
    for _, t in ipairs(redis.call('HVALS', toks_key(node.id))) do node.used = node.used + tonumber(t) end
  end
  return node
end

-- whether queue entry `e` waits for a slot `node` (usable) could give it
local function eligible(e, node)
  if e.mark ~= '' or not serves(node.models, e.model) or declined(e, node.id) then return false end
  if e.stay and e.stay ~= '' and e.stay ~= node.id then return false end
  local k, t = size_on(e, node)
  return could_hold(node, k, t, e.prompt_tokens)
end

-- whether waiter `e` fits in what `node` (tallied) has free
local function fits_in(e, node)
  return fits(node, size_on(e, node))
end

-- whether waiter `e` takes `node`'s free slots (it fits), or holds them back for itself (it waits on it)
local function claims(e, node)
  return fits_in(e, node) or e.hold == '' or e.hold == node.id
end

-- which of `ranked` (the waiters `node` could serve, in queue order) takes the node's next free slots, and
-- the ones passed over for it. The head, or - prefix affinity within fairness - among the first few requests
-- exactly as deserving as the head (same class, same tenant load) one whose prompt this node holds; a
-- request can be passed over at most MAX_PASSES times, so nobody waits long for it. A request that does not
-- fit in what is free (several generations, or more tokens than the shared cells have free) holds the slots
-- back for itself only on the node it waits on (`hold`; none: every node): elsewhere the requests behind it
-- go first.
-- nil: the head needs more than is free and nobody may pass it.
local function pick(now, node, ranked)
  local live = {}  -- the places in `ranked` of those who take or hold this node's slots, the first few
  for i, e in ipairs(ranked) do
    if claims(e, node) then
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
    if e.preferred == node.id and fits_in(e, node) then return i, {unpack(live, 1, j - 1)} end
    if e.passes >= MAX_PASSES then break end
  end
  if fits_in(head, node) then return live[1], {} end
  return nil
end

-- whether a waiter running several generations or counting its tokens may not fit where one slot is free:
-- the kind that waits on one node (`hold`)
local function bulky(e)
  return e.generations > 1 or e.prompt_tokens > 0
end

-- slots on node `id` are free: reserve them for the first waiting requests that node can serve, in queue
-- order, and return how many were handed over. A request waits for all the slots (and tokens) it needs on
-- one node at once, and the requests behind it wait too: freed slots are held back for it, or small requests
-- taking each one as it frees could starve it (as they can in llama-server's own deferred queue, which lets
-- them pass).
local function hand_over(id, now, lease)
  if redis.call('EXISTS', K.queue) == 0 then return 0 end  -- nobody waits: the common case
  local node = usable(id)  -- (not declared: its slots wait for the waiters' next look)
  if not node then return 0 end
  tally(node, now)
  if node.n >= node.cap then return 0 end
  local ranked = {}
  for _, e in ipairs(queue_entries(now)) do
    if eligible(e, node) then ranked[#ranked + 1] = e end
  end
  local handed = 0
  while #ranked > 0 do
    table.sort(ranked, function(a, b) return before(now, a, b) end)
    local i, passed = pick(now, node, ranked)
    if not i then break end
    for _, j in ipairs(passed) do  -- passed over for affinity
      local p = ranked[j]
      p.passes = p.passes + 1
      redis.call('HSET', K.qmeta, p.rid, record(p))
    end
    local e = ranked[i]
    local k, t = size_on(e, node)
    -- the slots are the waiter's while its place in the queue lasts: they lapse with it (a waiter whose place
    -- lapsed asks again as a new arrival, which could take other slots besides, or wait behind these)
    local place = tonumber(redis.call('ZSCORE', K.queue, e.rid)) - now
    reserve(id, e.rid, e.tenant, now + math.min(lease, place), lease * 2, k, t, true)
    e.mark = 'g:' .. id
    redis.call('HSET', K.qmeta, e.rid, record(e))
    redis.call('PUBLISH', K.events, 'granted ' .. e.rid .. ' ' .. id .. ' ' .. k)
    table.remove(ranked, i)
    node.n, node.used, handed = node.n + k, node.used + t, handed + k
    if node.n >= node.cap then break end
  end
  return handed
end

-- a waiter that waited on one node, or on every node it could run on, left the queue (it got its slots, was
-- shed, or gave up): the free slots the nodes it could run on held back for it go to the next in line now,
-- not at their next release. The queue is read and ranked once, not once per node: a full hand-over runs only
-- on a node that will hand a slot over.
local function pass_on(ids, now, lease)
  local waiting = nil  -- every waiter not yet handed a slot, in queue order
  for _, id in ipairs(ids) do
    local node = usable(id)
    if node and tally(node, now).n < node.cap then
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
        if eligible(e, node) and claims(e, node) then ranked[#ranked + 1] = e end
      end
      if #ranked > 0 and pick(now, node, ranked) then
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
