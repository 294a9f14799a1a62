-- A waiting request leaves the queue (Store.leave_queue): slots already handed to it, and those held back
-- for it, go to the next in line.
-- ARGV after the common three: the request id, the queue lease, then the nodes it could run on if it runs
-- several generations at once (their free slots were held back for it).
-- Returns 1, or 2 when slots had been handed to it (they were given back).
local rid, queue_lease = ARGV[4], tonumber(ARGV[5])
local meta = redis.call('HGET', K.qmeta, rid)
redis.call('ZREM', K.queue, rid)
redis.call('HDEL', K.qmeta, rid)
local out = 1
if meta then
  local f = fields(meta)
  if string.sub(f[5] or '', 1, 2) == 'g:' then
    release(string.sub(f[5], 3), rid, f[2], NOW, queue_lease)
    out = 2
  end
end
pass_on({unpack(ARGV, 6)}, NOW, queue_lease)
return out
