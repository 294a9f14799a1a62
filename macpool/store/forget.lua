-- Remove a lease without handing its slots on: a renewal that crossed its release brought it back
-- (Store.forget). KEYS as renew.lua's. ARGV: the tenant, the request id, then its other reservation members.
local tenant, rid = ARGV[1], ARGV[2]
redis.call('ZREM', KEYS[1], unpack(ARGV, 2))
if redis.call('ZREM', KEYS[2], tenant .. '\t' .. rid) == 1 then
  if redis.call('HINCRBY', KEYS[3], tenant, -1) <= 0 then redis.call('HDEL', KEYS[3], tenant) end
end
redis.call('HDEL', KEYS[4], rid)
return 1
