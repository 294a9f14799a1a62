-- A waiting request leaves the queue (Store.leave_queue): slots already handed to it, and those held back
-- for it, go to the next in line.
-- ARGS: rid, queue_lease (ms), nodes (those it could run on if it runs several generations at once: their
-- free slots were held back for it; the node it waits on, named in its record, need not be among them).
-- Returns 1, or 2 when slots had been handed to it (they were given back).
local rid = ARGS.rid
local meta = redis.call('HGET', K.qmeta, rid)
redis.call('ZREM', K.queue, rid)
redis.call('HDEL', K.qmeta, rid)
local out, nodes = 1, ARGS.nodes
if meta then
  local me = entry(rid, meta)
  if string.sub(me.mark, 1, 2) == 'g:' then
    release(string.sub(me.mark, 3), rid, me.tenant, NOW, ARGS.queue_lease)
    out = 2
  end
  local named = false
  for _, id in ipairs(nodes) do named = named or id == me.hold end
  if me.hold ~= '' and not named then nodes[#nodes + 1] = me.hold end
end
pass_on(nodes, NOW, ARGS.queue_lease)
return out
