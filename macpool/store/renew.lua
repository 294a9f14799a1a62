-- Extend a running request's lease (Store.renew).
-- KEYS: the node's reservations, the requests in flight and their counts by tenant, the reservations the
-- routers hold (Keys: resv:{id}, inflight, inflight:count, held). ARGV: the new expiry (ms), the lease (ms),
-- the tenant, the record its router keeps ("router \t node \t tenant \t slots"; '': no router named), the
-- request id, then its other reservation members (one per further slot it holds).
-- 1: renewed; 2: re-created - the lease was gone (Redis lost its data, or the lease had expired) while its
-- request still runs: counted again, or the pool would read idle and admit past what the nodes hold.
local expiry, lease, tenant, record, rid = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4], ARGV[5]
local had = redis.call('ZSCORE', KEYS[1], rid)
local zadd = {}
for i = 5, #ARGV do
  zadd[#zadd + 1] = expiry; zadd[#zadd + 1] = ARGV[i]
end
redis.call('ZADD', KEYS[1], unpack(zadd))
redis.call('PEXPIRE', KEYS[1], lease * 2)
if redis.call('ZADD', KEYS[2], expiry, tenant .. '\t' .. rid) == 1 then
  redis.call('HINCRBY', KEYS[3], tenant, 1)
end
if record ~= '' then  -- (a router counted dead and reclaimed holds it again: it was only slow, or cut off)
  redis.call('HSET', KEYS[4], rid, record)
end
if had then return 1 end
return 2
