-- Extend a running request's lease (Store.renew).
-- KEYS: the node's reservations, the tenant's requests in flight[, the reservations its router holds]. ARGV:
-- the new expiry (ms), the lease (ms), the record of it its router keeps ("node \t tenant \t slots"), the
-- request id, then its other reservation members (one per further slot it holds).
-- 1: renewed; 2: re-created - the lease was gone (Redis lost its data, or the lease had expired) while its
-- request still runs: counted again, or the pool would read idle and admit past what the nodes hold.
local expiry, lease, rid = ARGV[1], tonumber(ARGV[2]), ARGV[4]
local had = redis.call('ZSCORE', KEYS[1], rid)
local zadd = {}
for i = 4, #ARGV do
  zadd[#zadd + 1] = expiry; zadd[#zadd + 1] = ARGV[i]
end
redis.call('ZADD', KEYS[1], unpack(zadd))
redis.call('PEXPIRE', KEYS[1], lease * 2)
redis.call('ZADD', KEYS[2], expiry, rid)
redis.call('PEXPIRE', KEYS[2], lease * 2)
if KEYS[3] then  -- (a router counted dead and reclaimed holds it again: it was only slow, or cut off)
  redis.call('HSET', KEYS[3], rid, ARGV[3])
  if redis.call('PTTL', KEYS[3]) < lease * 2 then redis.call('PEXPIRE', KEYS[3], lease * 2) end
end
if had then return 1 end
return 2
