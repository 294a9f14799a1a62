-- Take or renew the autoscaler's leader lease. KEYS: the lease key. ARGV: this controller's id, lease (ms).
-- 1 when the caller holds the lease now (taken, or renewed), 0 when another controller holds it.
local holder = redis.call('GET', KEYS[1])
if holder == false then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
