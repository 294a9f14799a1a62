-- A Mac gives its replica of a model back (ModelStore.release): it removed the model, or could not hold it.
-- KEYS: the declared models (HASH), the model's claims (ZSET), the Macs that want it (HASH). ARGV: the
-- model's name, the agent, now (ms).
-- A model being removed is forgotten with its last replica: 1 when this call forgot it, else 0.
redis.call('ZREM', KEYS[2], ARGV[2])
redis.call('HDEL', KEYS[3], ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', tonumber(ARGV[3]))
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if raw and cjson.decode(raw).removing and redis.call('ZCARD', KEYS[2]) == 0 then
  redis.call('HDEL', KEYS[1], ARGV[1])
  redis.call('DEL', KEYS[2], KEYS[3])
  return 1
end
return 0
