-- Reserve slots for one request on the best candidate node, or queue it, or say why not (Store.reserve).
-- ARGS: the request (ReserveRequest in macpool/store/api.py, by the same names; each candidate
-- {id, tokens_per_s, tie (a random number: the last tie-break), ttft, decode, prefill, backlog}).
-- Returns {status, node, count, affinity[, slots, tokens, cached]}: status reserved (node, its reservations
-- now, the affinity outcome, the slots and the tokens it holds, the share of the prompt its cache was
-- expected to hold there, in thousandths), queued (count: the requests waiting), full, shed or limited
-- (count: what the tenant has in flight and queued).
local req = ARGS
local now, rid, lease, gens = NOW, req.rid, req.lease, req.generations
local prio, tenant, model = req.priority, req.tenant, req.model
local prompt, output = req.prompt_tokens, req.output_tokens  -- (tokens_on in lib.lua)
local queue_lease = req.queue_lease  -- waiters renew their place every attempt, so this is short
local excluded = req.excluded  -- nodes its router no longer sends it to
local prefixes = req.prefixes  -- prompt-prefix hashes, longest first (a session's first)
local shares = req.shares  -- the share of the prompt each covers (-1: a session)
-- the session the client named (its hash: the first prefix), and how long a session that sent nothing since
-- still holds a slot's cache where it ran (ms; 0: sessions are not counted)
local session = (#prefixes > 0 and shares[1] == -1) and prefixes[1] or nil
local session_window = req.session_window or 0
local nodes = {}  -- every candidate's id, as given
for i, c in ipairs(req.candidates) do nodes[i] = c.id end

-- this request leaves the queue: if it waited on a node, or on every node it could run on, the slots held
-- back for it go on
local function leave(e)
  if bulky(e) then pass_on(nodes, now, queue_lease) end
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
  if session and session_window > 0 then
    local skey = sess_key(node)
    redis.call('ZADD', skey, now, session)
    redis.call('ZREMRANGEBYSCORE', skey, '-inf', now - session_window)
    redis.call('PEXPIRE', skey, session_window * 2)
  end
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
    -- that the waiter is alive to take them, they get the full lease, and so do its tokens
    redis.call('ZREM', K.queue, rid)
    redis.call('HDEL', K.qmeta, rid)
    redis.call('ZADD', rkey, 'XX', unpack(scored(rid, k, now + lease)))
    redis.call('PEXPIRE', rkey, lease * 2)  -- (the hand-over may have created the key, with a short TTL)
    local t = tonumber(redis.call('HGET', toks_key(node), rid)) or 0
    if t > 0 then redis.call('PEXPIRE', toks_key(node), lease * 2) end
    in_flight(tenant, rid, now + lease, true)
    track(req.router, rid, node, tenant, k)
    remember(node)
    leave(me)
    local outcome = ''
    if me.hashed then
      outcome = me.preferred == node and 'hit' or (me.preferred ~= '' and 'overridden' or 'miss')
    end
    return {'reserved', node, redis.call('ZCOUNT', rkey, now, '+inf'), outcome, k, t}
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
-- the same model, and those ahead of it asking for another model that may wait on a node (bulky: they may
-- hold slots back on the nodes it could go to)
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
      elseif bulky(e) and before(now, e, mine) then
        q.others[#q.others + 1] = e
      end
    end
  end
  return q
end

-- the candidates that take requests now: candidate c is node at[c] (usable and tallied: lib.lua), with
-- tps[c] / rnd[c] to break ties and ttft[c] / decode[c] / prefill[c] / backlog[c] / bcost[c] for the time it
-- would take to answer (Candidate in api.py; decode 0: not measured; prefill 0: not known; backlog: the
-- prompts sent there that it has not finished processing, in seconds; bcost: how much each request running
-- there slows its decode)
local at, tps, rnd, ttft, decode, prefill, backlog, bcost, known = {}, {}, {}, {}, {}, {}, {}, {}, {}
-- others[c]: how many sessions other than this request's sent candidate c a request within the session window
-- (for a request of a session); evicts[c]: they hold every slot's cache there, so this session would take one
-- of them (which then processes its whole prompt again on its next turn); opening: this request opens its
-- session (no node holds it yet: set by choose)
local others, evicts, opening = {}, {}, false

local function other_sessions(node)
  local skey, since = sess_key(node.id), now - session_window
  local count = redis.call('ZCOUNT', skey, since, '+inf')
  local mine = tonumber(redis.call('ZSCORE', skey, session))
  if mine and mine >= since then count = count - 1 end
  return count
end

local function read_candidates()
  for _, cand in ipairs(req.candidates) do
    known[cand.id] = true
    local node = usable(cand.id)
    if node then
      local c = #at + 1
      at[c] = tally(node, now)
      tps[c], rnd[c], ttft[c], decode[c] = cand.tokens_per_s, cand.tie, cand.ttft, cand.decode
      prefill[c], backlog[c] = cand.prefill or 0, cand.backlog or 0
      bcost[c] = (cand.batch_cost or 0) > 0 and cand.batch_cost or req.batch_cost
      if session ~= nil and session_window > 0 then
        others[c] = other_sessions(at[c])
        evicts[c] = others[c] >= (at[c].slots > 0 and at[c].slots or at[c].cap)
      end
    end
  end
end

-- whether queue entry `e` could run on candidate `c`, and the slots and tokens it would hold there
local function runs_on(e, c)
  local node = at[c]
  local k, t = size_on(e, node)
  local ok = could_hold(node, k, t, e.prompt_tokens) and not declined(e, node.id)
    and (e.model == model or serves(node.models, e.model))
    and (not e.stay or e.stay == '' or e.stay == node.id)
  return ok, k, t
end

-- the node a bulky request waits on when it fits on none now: of those it could run on, the one with the most
-- free cells where they bind its tokens, then the most free slots (ties: the lowest id), so the least waits
-- idle for it. Its free slots are held back for it; the other nodes' go to the requests behind it meanwhile.
local function designate(e)
  local best, room, most = '', -1, -1
  for c = 1, #at do
    local ok, _, t = runs_on(e, c)
    if ok then
      local node = at[c]
      local r = (t > 0 and node.cells > 0) and node.cells - node.used or math.huge
      local f = node.cap - node.n
      if r > room or (r == room and (f > most or (f == most and node.id < best))) then
        best, room, most = node.id, r, f
      end
    end
  end
  return best
end

-- whether `node`, not one of the candidates, could run queue entry `e` now (the node it waits on, say, where
-- this request is not sent: its router tried it, or its circuit is open, or it is too small for this request)
local function runs_elsewhere(e, node)
  if not node_key(node) then return true end  -- (not declared: as far as this call can tell, it does)
  local n = usable(node)
  return n ~= nil and eligible(e, n)
end

-- A bulky request ahead that fits on none of the candidates now waits for room to free on one (its `hold`):
-- that node holds its free slots back for it (as hand_over does), from this request too, and the request is
-- not counted among those ahead taking the other nodes' free slots (waiting_on). Slots held back for one are
-- not room for those behind it, so they are looked at in queue order.
local function hold_back(q)
  local bulk = q.others
  for _, e in ipairs(q.ahead) do
    if bulky(e) then bulk[#bulk + 1] = e end
  end
  if #bulk > 1 then table.sort(bulk, function(a, b) return before(now, a, b) end) end
  local held_back, waiting_on = {}, {}
  for _, e in ipairs(bulk) do
    local room, runs = false, {}
    for c = 1, #at do
      local ok, k, t = runs_on(e, c)
      if ok then
        runs[at[c].id] = true
        if fits(at[c], k, t) and not held_back[at[c].id] then room = true; break end
      end
    end
    if not room then
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

-- `best` placed on candidate c
local function place(best, c)
  local node = at[c]
  best.c, best.id, best.n, best.cached = c, node.id, node.n, 0
  best.k, best.t = need(gens, node.slots), tokens_on(prompt, output, node)
  return best
end

-- the time to process the part of the prompt candidate c's cache does not hold (`cached`: the share it
-- holds): prefill[c] is the whole prompt's from depth 0; a token at depth d costs 1 + d / halving times one at
-- the start (attention), so the uncached part, which starts at the cached share, costs more a token
local function uncached_prefill(c, cached)
  local halving = req.prefill_halving or 0
  if halving <= 0 or prompt <= 0 then return prefill[c] * (1 - cached) end
  local k = prompt / (2 * halving)
  return prefill[c] * (1 - cached) * (1 + k * (1 + cached)) / (1 + k)
end

-- the answer expected on candidate c, with the m = n + k requests running there this one included: the
-- prompts sent there before it still being processed (their backlog), this one's own prompt (less the
-- `cached` share of it the node holds), then its tokens decoded beside the others. Where the prompt is not
-- counted (no prefill known), each of the m processes its prompt about once meanwhile instead (a step
-- processing a prompt holds every stream on the node for that time, which the first token measures); where
-- it is, the backlog is those prompts, and first tokens, which waited on each other's, would count them
-- twice. A session it would evict from the node's slots costs about as much prompt processing again, later:
-- counted as this prompt's. A request that opens a session also waits on the turns the node's other sessions
-- will send while its long first prompt is processed: a first token's time for each, running or thinking
-- (without it, every new session goes to the quicker Mac while its sessions think between turns, and the
-- slower Macs idle once they are back).
local function expected(c, cached)
  local m = at[c].n + need(gens, at[c].slots)
  local evicted = evicts[c] and prefill[c] or 0
  local waits = prefill[c] > 0 and (opening and others[c] or 0) * ttft[c] or m * ttft[c]
  return backlog[c] + waits + uncached_prefill(c, cached) + evicted
    + decode[c] * (1 + bcost[c] * m)
end

-- the share of the prompt `owner` holds cached: a prefix's own share; a session's, the largest share of the
-- content prefixes that node also holds (none: the session's prompt may have changed since)
local function cached_share(i, owner, owners)
  if shares[i] >= 0 then return shares[i] end
  local share = 0
  for j = 1, #prefixes do
    if owners[j] == owner and shares[j] > share then share = shares[j] end
  end
  return share
end

-- the share of the prompt each open candidate's cache holds, as the affinity map says (candidate -> share):
-- of each prefix, the node that served it last holds it
local function held_shares(open, owners)
  local held = {}
  for i = 1, #prefixes do
    local c = owners[i] and open[owners[i]]
    if c then
      local share = cached_share(i, owners[i], owners)
      if share > (held[c] or 0) then held[c] = share end
    end
  end
  return held
end

-- the candidate with the free slots (and cells) this request needs that would answer it soonest - the
-- least-utilised one when some such candidate has not been measured (ties: lower utilisation, faster node,
-- then random) - as {c, id, util, n (its reservations), k and t (the slots and the tokens it would hold),
-- cost (its expected time; 0: not measured), cached (the share of the prompt its cache holds)} or nil; the
-- free slots of the candidates not held back; and `open`: node id -> candidate number, for the nodes with
-- room for this request. A node that could never hold it is none of them. Where every one is measured and
-- the prompt counted (its prefill known on each), each is weighed with the share of the prompt its cache
-- holds (`owners`: the node that served each prefix last), and `best.weighed` says so.
local function choose(held_back, owners)
  local best, free, open = nil, 0, {}
  local measured = true
  for c = 1, #at do
    local node = at[c]
    if not held_back[node.id] then
      if node.n < node.cap then free = free + node.cap - node.n end
      local k, t = need(gens, node.slots), tokens_on(prompt, output, node)
      if fits(node, k, t) and could_hold(node, k, t, prompt) then
        open[node.id] = c
        measured = measured and decode[c] > 0
      end
    end
  end
  local weighed = measured
  for _, c in pairs(open) do weighed = weighed and prefill[c] > 0 end
  opening = session ~= nil and session_window > 0 and not owners[1]
  local cost, held = {}, weighed and held_shares(open, owners) or {}
  for _, c in pairs(open) do cost[c] = measured and expected(c, held[c] or 0) or 0 end
  local b = nil
  for _, c in pairs(open) do
    local better = b == nil or cost[c] < cost[b]
    if b ~= nil and cost[c] == cost[b] then
      local u, ub = at[c].n / at[c].cap, at[b].n / at[b].cap
      better = u < ub or (u == ub and (tps[c] > tps[b] or (tps[c] == tps[b] and rnd[c] < rnd[b])))
    end
    if better then b = c end
  end
  if b ~= nil then
    best = place({util = at[b].n / at[b].cap, cost = cost[b], weighed = weighed}, b)
    best.cached = held[b] or 0
  end
  return best, free, open
end

-- prefix affinity: the session's node, else the node that served the longest known prefix, unless it is much
-- busier (SGLang's rule). Where placement weighed each node with the prefill its cache saves (choose), that
-- is the choice, except that a session still stays on its node while that node can take it and is not much
-- busier; the outcome says whether the choice is the owner's. Returns the outcome ('' without prefixes, hit,
-- miss or overridden) and the node preferred (kept with a queued request); `best` moves there on a hit.
local function apply_affinity(best, open, owners)
  if #prefixes == 0 then return '', '' end
  local outcome, pref = 'miss', ''
  for i = 1, #prefixes do
    local owner = owners[i]
    if owner and pref == '' and known[owner] then pref = owner end
    local o = owner and open[owner]
    local busier = o and best and at[o].n - best.n >= req.affinity_abs
      and at[o].n / at[o].cap > best.util * req.affinity_rel
    if owner and best and best.weighed then
      -- a session stays on its node while that node can take it and is not much busier: a move processes
      -- its history again elsewhere, holding every stream there meanwhile, and lasts for the session's
      -- life, where a moment's backlog at home passes within a turn or two
      if i == 1 and session and o and o ~= best.c and not busier then
        place(best, o)
        best.util, best.cached = at[o].n / at[o].cap, cached_share(i, owner, owners)
        best.cost = expected(o, best.cached)
      end
      outcome = best.id == owner and 'hit' or 'overridden'
      break
    end
    if owner and best then
      if o == nil then
        outcome = 'overridden'  -- full, gone or not a candidate: a shorter prefix may live elsewhere
      elseif busier then
        outcome = 'overridden'
        break
      else
        place(best, o)
        best.cached = cached_share(i, owner, owners)
        outcome = 'hit'
        break
      end
    end
  end
  return outcome, pref
end

-- Where placement weighed the nodes (best.weighed), the node worth waiting for rather than taking `best` now:
-- one that cannot take this request now (full, or its free slots held back for a waiter ahead) but could hold
-- it, whose cache holds more of the prompt (a session's Mac, say, its slots or cells taken by other turns for
-- the moment), and would answer sooner than `best` by more than this request has waited so far (`waited`,
-- ms). Waiting at most as long as the cache saves costs at most that much over moving at once, however the
-- wait turns out (as renting skis does until they would have been paid for); moving throws the cache away,
-- and a session's history processed again on another Mac takes it tens of seconds. Only a node whose slots
-- keep their own caches is waited for: where the slots share one pool of cells, llama-server keeps an idle
-- session's cache only in its prompt cache in host memory, which the pool does not see, so what the map
-- credits there is a guess, and the wait would be paid for nothing when it is wrong. nil: take `best`.
local function worth_waiting(best, owners, waited)
  local every = {}
  for c = 1, #at do every[at[c].id] = c end
  local held = held_shares(every, owners)
  local off = {}
  for _, id in ipairs(excluded) do off[id] = true end
  local stay, most = nil, waited / 1000
  for c = 1, #at do
    local node, share = at[c], held[c] or 0
    if c ~= best.c and share > best.cached and prefill[c] > 0 and decode[c] > 0 and not off[node.id]
        and node.cells == 0
        and could_hold(node, need(gens, node.slots), tokens_on(prompt, output, node), prompt) then
      local gain = best.cost - expected(c, share)
      if gain > most then stay, most = node.id, gain end
    end
  end
  return stay
end

-- whether the queue has a place for this request (one that waits by choice takes no other's place)
local function queue_has_room(q, me)
  if me then return true end
  return q.waiting < req.queue_size and (prio ~= 'batch' or q.waiting_batch < req.batch_queue_max)
end

-- whether `best` leaves the requests ahead their share: the free slots of the candidates not held back
-- (`free`) cover theirs and this request's, and where `best`'s cells bind, its free cells cover the tokens of
-- those of them that fit there and this request's. Those ahead that turned down a slot there, could never run
-- there or wait on another node do not count.
local function leaves_room(best, free, q, waiting_on)
  local node = at[best.c]
  local k, t = best.k, best.t
  for _, e in ipairs(q.ahead) do
    local ok, ke, te = runs_on(e, best.c)
    if ok and not waiting_on[e.rid] then
      k = k + ke
      if node.cells > 0 and fits(node, ke, te) then t = t + te end
    end
  end
  return k <= free and (node.cells == 0 or node.used + t <= node.cells)
end

-- still waiting: renew its place (and the nodes it turns down: circuits close, and open), waiting for the
-- node `stay` (nil: for any it could run on)
local function renew_place(me, q, stay)
  redis.call('ZADD', K.queue, now + queue_lease, rid)
  local was, changed = me.hold, false
  if not turned_down and table.concat(me.declined, '\n') ~= table.concat(excluded, '\n') then
    me.declined, changed = excluded, true
  end
  if (me.stay or '') ~= (stay or '') then me.stay, changed = stay or '', true end
  if bulky(me) then me.hold = designate(me) end
  if changed or me.hold ~= was then redis.call('HSET', K.qmeta, rid, record(me)) end
  if me.hold ~= was and was ~= '' then pass_on({was}, now, queue_lease) end  -- it waits elsewhere now
  return {'queued', '', q.waiting + 1, ''}
end

-- a new arrival joins the queue if there is room (an interactive one takes the last batch request's place),
-- waiting for the node `stay` (nil: for any it could run on)
local function join_queue(q, pref, stay)
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
             hashed = #prefixes > 0, passes = 0, declined = excluded, generations = gens,
             prompt_tokens = prompt, output_tokens = output, hold = '', stay = stay or ''}
  if bulky(e) then e.hold = designate(e) end
  redis.call('HSET', K.qmeta, rid, record(e))
  redis.call('PEXPIRE', K.queue, lease * 2)
  redis.call('PEXPIRE', K.qmeta, lease * 2)
  return {'queued', '', waiting + 1, ''}
end

-- the share of the prompt `node`'s cache holds, as the affinity map says
local function share_on(node)
  if #prefixes == 0 then return 0 end
  return held_shares({[node] = 1}, redis.call('HMGET', K.affinity, unpack(prefixes)))[1] or 0
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
      local share = share_on(string.sub(me.mark, 3))  -- (before taking them tells the map it holds all)
      local taken = take_handed_over(me)
      if taken then
        taken[7] = math.floor(share * 1000)
        return taken
      end
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
  local owners = #prefixes > 0 and redis.call('HMGET', K.affinity, unpack(prefixes)) or {}
  local best, free, open = choose(held_back, owners)
  local outcome, pref = apply_affinity(best, open, owners)
  local stay = nil
  if best and best.weighed and req.enqueue and queue_has_room(q, me) then
    stay = worth_waiting(best, owners, me and now - me.arrival or 0)
  end
  if best and not stay and leaves_room(best, free, q, waiting_on) then
    reserve(best.id, rid, tenant, now + lease, lease * 2, best.k, best.t)
    track(req.router, rid, best.id, tenant, best.k)
    if me then dequeue(me) end
    if session and session_window > 0 and owners[1] and owners[1] ~= best.id and sess_key(owners[1]) then
      redis.call('ZREM', sess_key(owners[1]), session)  -- it moved: its old node no longer counts it
    end
    remember(best.id)
    return {'reserved', best.id, best.n + best.k, outcome, best.k, best.t, math.floor(best.cached * 1000)}
  end
  if not req.enqueue then return {'full', '', q.waiting, ''} end
  if me then return renew_place(me, q, stay) end
  return join_queue(q, pref, stay)
end

return main()
