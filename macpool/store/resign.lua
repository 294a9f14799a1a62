-- Give the autoscaler's leader lease up, only if the caller holds it. KEYS: the lease key. ARGV: its id.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
