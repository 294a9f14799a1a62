-- Reserve slots for one request on the best candidate node, or queue it, or say why not (Store.reserve).
-- ARGS: the request (ReserveRequest in macpool/store/api.py, by the same names; each candidate
-- {id, tokens_per_s, tie (a random number: the last tie-break), ttft, decode}).
-- Returns {status, node, count, affinity[, slots]}: status reserved (node, its reservations now, the
-- affinity outcome, the slots it holds), queued (count: the requests waiting), full, shed or limited (count:
-- what the tenant has in flight and queued).
local req = ARGS
local now, rid, lease, gens = NOW, req.rid, req.lease, req.generations
local prio, tenant, model = req.priority, req.tenant, req.model
local queue_lease = req.queue_lease  -- waiters renew their place every attempt, so this is short
local excluded = req.excluded  -- nodes its router no longer sends it to
local prefixes = req.prefixes  -- prompt-prefix hashes, longest first
local nodes = {}  -- every candidate's id, as given
for i, c in ipairs(req.candidates) do nodes[i] = c.id end

-- this request leaves the queue: if it runs several generations, the slots held back for it go on
local function leave(e)
  if e.generations > 1 then pass_on(nodes, now, queue_lease) end
end

local function dequeue(me)
  redis.call('ZREM', K.queue, rid)
  redis.call('HDEL', K.qmeta, rid)
  leave(me)
end

-- remember that `node` now holds this request's prompt prefixes (least recently used ones dropped)
local function remember(node)
  if #prefixes == 0 then return end
  local pairs_, scores = {}, {}
  for _, hash in ipairs(prefixes) do
    pairs_[#pairs_ + 1] = hash; pairs_[#pairs_ + 1] = node
    scores[#scores + 1] = now; scores[#scores + 1] = hash
  end
  redis.call('HSET', K.affinity, unpack(pairs_))
  redis.call('ZADD', K.lru, unpack(scores))
  -- at most 1,000 of the oldest per call (Lua's unpack has a limit; a lowered bound converges over calls)
  local over = math.min(redis.call('ZCARD', K.lru) - req.affinity_max_entries, 1000)
  if over > 0 then
    local old = redis.call('ZRANGE', K.lru, 0, over - 1)
    redis.call('ZREMRANGEBYRANK', K.lru, 0, over - 1)
    redis.call('HDEL', K.affinity, unpack(old))
  end
end

-- `me`, a waiter a release handed slots to: take them (the answer), or turn them down and wait on (nil).
-- `turned_down` is set when this request declined them (a node its router no longer sends it to).
local turned_down = false
local function take_handed_over(me)
  local node = string.sub(me.mark, 3)
  local wanted = false  -- a release hands a slot over by model only: is its node one this request takes?
  for _, id in ipairs(nodes) do
    if id == node then wanted = true end
  end
  local rkey = resv_key(node)  -- (nil: a node not declared, which this request does not take)
  local k = wanted and rkey and held(rkey, rid) or 0
  if k > 0 then
    -- the slots were handed over with the short queue lease (in case this waiter's router is dead): now
    -- that the waiter is alive to take them, they get the full lease
    redis.call('ZREM', K.queue, rid)
    redis.call('HDEL', K.qmeta, rid)
    redis.call('ZADD', rkey, 'XX', unpack(scored(rid, k, now + lease)))
    redis.call('PEXPIRE', rkey, lease * 2)  -- (the hand-over may have created the key, with a short TTL)
    in_flight(tenant, rid, now + lease, true)
    track(req.router, rid, node, tenant, k)
    remember(node)
    leave(me)
    local outcome = ''
    if me.hashed then
      outcome = me.preferred == node and 'hit' or (me.preferred ~= '' and 'overridden' or 'miss')
    end
    return {'reserved', node, redis.call('ZCOUNT', rkey, now, '+inf'), outcome, k}
  end
  if not wanted then
    -- declined: the slots go on to the next in line (this request, still marked, is not among them); on a
    -- node not declared they lapse with the short queue lease
    release(node, rid, me.tenant, now, queue_lease, false)
    me.declined, turned_down = {unpack(excluded)}, true
    if not declined(me, node) then me.declined[#me.declined + 1] = node end
  end
  -- (or a handed-over slot that lapsed before it was taken: this request waits on like any other)
  me.mark = ''
  redis.call('HSET', K.qmeta, rid, record(me))
  return nil
end

-- a new arrival of a tenant at its limit of requests in flight and queued: how many it has (else nil)
local function over_key_limit(entries)
  if req.key_limit <= 0 then return nil end
  local n = tenant_load(tenant, now)
  for _, e in ipairs(entries) do
    if e.tenant == tenant and e.mark == '' then n = n + 1 end
  end
  if n >= req.key_limit then return n end
  return nil
end

-- the other waiters: how many (and batch ones), the last batch one, those queued ahead of this request for
-- the same model, and those ahead of it asking for another model that run several generations (who may hold
-- slots back on the nodes it could go to)
local function scan_queue(entries, me)
  local mine = {rid = rid, priority = prio, tenant = tenant, arrival = me and me.arrival or now}
  local q = {ahead = {}, others = {}, waiting = 0, waiting_batch = 0, last_batch = nil}
  for _, e in ipairs(entries) do
    if e.mark == '' and e.rid ~= rid then
      q.waiting = q.waiting + 1
      if e.priority == 'batch' then
        q.waiting_batch = q.waiting_batch + 1
        if q.last_batch == nil or before(now, q.last_batch, e) then q.last_batch = e end
      end
      if e.model == model then
        if before(now, e, mine) then q.ahead[#q.ahead + 1] = e end
      elseif e.generations > 1 and before(now, e, mine) then
        q.others[#q.others + 1] = e
      end
    end
  end
  return q
end

-- the candidates that take requests now: candidate c is node ids[c], with ns[c] reservations, capacity
-- caps[c], llama-server's slots[c], the models mods[c], tps[c] / rnd[c] to break ties, and ttft[c] /
-- decode[c] for the time it would take to answer (Candidate in api.py; decode 0: not measured) (arrays,
-- not a table per candidate: this runs for every request, over every candidate)
local ids, ns, caps, slots, mods, tps, rnd, ttft, decode, known = {}, {}, {}, {}, {}, {}, {}, {}, {}, {}
local function read_candidates()
  for _, cand in ipairs(req.candidates) do
    local id = cand.id
    known[id] = true
    local node = usable(id)
    if node then
      local rkey = resv_key(id)
      redis.call('ZREMRANGEBYSCORE', rkey, '-inf', now)
      local c = #ids + 1
      ids[c], ns[c], caps[c], slots[c], mods[c] = id, redis.call('ZCARD', rkey), node.cap, node.slots,
        node.models
      tps[c], rnd[c], ttft[c], decode[c] = cand.tokens_per_s, cand.tie, cand.ttft, cand.decode
    end
  end
end

-- whether queue entry `e` could run on candidate `c` (it needs k slots there)
local function runs_on(e, c)
  local k = need(e.generations, slots[c])
  return k <= caps[c] and not declined(e, ids[c]) and (e.model == model or serves(mods[c], e.model)), k
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
  if not node_key(node) then return true end  -- (not declared: as far as this call can tell, it does)
  local n = usable(node)
  return n ~= nil and eligible(e, n)
end

-- A request ahead running several generations that fits on none of the candidates now waits for slots to
-- free on one (its `hold`): that node holds its free slots back for it (as hand_over does), from this request
-- too, and the request is not counted among those ahead taking the other nodes' free slots (waiting_on).
-- Slots held back for one are not room for those behind it, so they are looked at in queue order.
local function hold_back(q)
  local several = q.others
  for _, e in ipairs(q.ahead) do
    if e.generations > 1 then several[#several + 1] = e end
  end
  if #several > 1 then table.sort(several, function(a, b) return before(now, a, b) end) end
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
  return held_back, waiting_on
end

-- the candidate with the free slots this request needs that would answer it soonest - the least-utilised
-- one when some such candidate has not been measured (ties: lower utilisation, faster node, then random) - as
-- {id, util, n (its reservations), k (the slots it would hold)} or nil; the free slots of the candidates not
-- held back; and `open`: node id -> candidate number, for the nodes with room for this request
local function choose(held_back)
  local best, free, open = nil, 0, {}
  local measured = true
  for c = 1, #ids do
    local n, cap = ns[c], caps[c]
    local k = need(gens, slots[c])
    if not held_back[ids[c]] then
      if n < cap then free = free + cap - n end
      if n + k <= cap then
        open[ids[c]] = c
        measured = measured and decode[c] > 0
      end
    end
  end
  -- the answer expected on c, with the m = n + k requests running there this one included: each of them
  -- processes its prompt about once meanwhile (a step processing a prompt holds every stream on the node
  -- for that time, which the first token measures), then its tokens are decoded beside the others
  local cost = {}
  for _, c in pairs(open) do
    local m = ns[c] + need(gens, slots[c])
    cost[c] = measured and m * ttft[c] + decode[c] * (1 + req.batch_cost * m) or 0
  end
  local b = nil
  for _, c in pairs(open) do
    local better = b == nil or cost[c] < cost[b]
    if b ~= nil and cost[c] == cost[b] then
      local u, ub = ns[c] / caps[c], ns[b] / caps[b]
      better = u < ub or (u == ub and (tps[c] > tps[b] or (tps[c] == tps[b] and rnd[c] < rnd[b])))
    end
    if better then b = c end
  end
  if b ~= nil then best = {id = ids[b], util = ns[b] / caps[b], n = ns[b], k = need(gens, slots[b])} end
  return best, free, open
end

-- prefix affinity: the node that served the longest known prefix, unless it is much busier (SGLang's rule).
-- Returns the outcome ('' without prefixes, hit, miss or overridden) and the node preferred (kept with a
-- queued request); `best` moves to the prefix's node on a hit.
local function apply_affinity(best, open)
  if #prefixes == 0 then return '', '' end
  local outcome, pref = 'miss', ''
  local owners = redis.call('HMGET', K.affinity, unpack(prefixes))
  for i = 1, #prefixes do
    local owner = owners[i]
    if owner and pref == '' and known[owner] then pref = owner end
    if owner and best then
      local o = open[owner]
      if o == nil then
        outcome = 'overridden'  -- full, gone or not a candidate: a shorter prefix may live elsewhere
      elseif ns[o] - best.n >= req.affinity_abs and ns[o] / caps[o] > best.util * req.affinity_rel then
        outcome = 'overridden'
        break
      else
        best.id, best.n, best.k, outcome = owner, ns[o], need(gens, slots[o]), 'hit'
        break
      end
    end
  end
  return outcome, pref
end

-- the slots on `best` left to the requests ahead: all of theirs, except those that turned down a slot there,
-- could never run there (more generations at once than it holds) or wait on another node
local function slots_ahead(best, open, q, waiting_on)
  local n = 0
  for _, e in ipairs(q.ahead) do
    local ok, k = runs_on(e, open[best.id])
    if ok and not waiting_on[e.rid] then n = n + k end
  end
  return n
end

-- still waiting: renew its place (and the nodes it turns down: circuits close, and open)
local function renew_place(me, q)
  redis.call('ZADD', K.queue, now + queue_lease, rid)
  local was, changed = me.hold, false
  if not turned_down and table.concat(me.declined, '\n') ~= table.concat(excluded, '\n') then
    me.declined, changed = excluded, true
  end
  if me.generations > 1 then me.hold = designate(me) end
  if changed or me.hold ~= was then redis.call('HSET', K.qmeta, rid, record(me)) end
  if me.hold ~= was and was ~= '' then pass_on({was}, now, queue_lease) end  -- it waits elsewhere now
  return {'queued', '', q.waiting + 1, ''}
end

-- a new arrival joins the queue if there is room (an interactive one takes the last batch request's place)
local function join_queue(q, pref)
  local waiting = q.waiting
  if waiting >= req.queue_size or (prio == 'batch' and q.waiting_batch >= req.batch_queue_max) then
    if prio == 'batch' then
      return {waiting < req.queue_size and 'shed' or 'full', '', waiting, ''}
    end
    if q.last_batch == nil then
      return {'full', '', waiting, ''}
    end
    q.last_batch.mark = 'shed'
    redis.call('HSET', K.qmeta, q.last_batch.rid, record(q.last_batch))
    redis.call('PUBLISH', K.events, 'shed ' .. q.last_batch.rid)
    waiting = waiting - 1
  end
  redis.call('ZADD', K.queue, now + queue_lease, rid)
  local e = {priority = prio, tenant = tenant, model = model, arrival = now, mark = '', preferred = pref,
             hashed = #prefixes > 0, passes = 0, declined = excluded, generations = gens, hold = ''}
  if gens > 1 then e.hold = designate(e) end
  redis.call('HSET', K.qmeta, rid, record(e))
  redis.call('PEXPIRE', K.queue, lease * 2)
  redis.call('PEXPIRE', K.qmeta, lease * 2)
  return {'queued', '', waiting + 1, ''}
end

local function main()
  local entries = queue_entries(now)
  local me = nil
  if req.dequeue then
    for _, e in ipairs(entries) do
      if e.rid == rid then me = e end
    end
    if me and me.mark == 'shed' then
      dequeue(me)
      return {'shed', '', 0, ''}
    end
    if me and string.sub(me.mark, 1, 2) == 'g:' then
      local taken = take_handed_over(me)
      if taken then return taken end
      entries = queue_entries(now)  -- the hand-over may have marked another entry
    end
  end
  if me == nil then
    local n = over_key_limit(entries)
    if n then return {'limited', '', n, ''} end
  end
  local q = scan_queue(entries, me)
  read_candidates()
  local held_back, waiting_on = hold_back(q)
  local best, free, open = choose(held_back)
  local outcome, pref = apply_affinity(best, open)
  if best and slots_ahead(best, open, q, waiting_on) + best.k <= free then
    reserve(best.id, rid, tenant, now, lease, best.k)
    track(req.router, rid, best.id, tenant, best.k)
    if me then dequeue(me) end
    remember(best.id)
    return {'reserved', best.id, best.n + best.k, outcome, best.k}
  end
  if not req.enqueue then return {'full', '', q.waiting, ''} end
  if me then return renew_place(me, q) end
  return join_queue(q, pref)
end

return main()
