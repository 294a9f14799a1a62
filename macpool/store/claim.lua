-- A Mac takes a replica of a declared model, or keeps the one it holds (ModelStore.claim).
-- KEYS: the declared models (HASH), the model's claims (ZSET agent -> lease expiry), the Macs that want it
-- (HASH agent -> {"load", "since", "until"}). ARGV: the model's name, the agent, now (ms), the lease (ms), how
-- many declared models the agent holds already, and how long (ms) a Mac wants a replica before it may take
-- one: meanwhile the other Macs that would take it say so too.
-- 'claimed': it holds a replica until now + lease; 'taken': every replica is held by other Macs; 'wait': it
-- has not wanted the model for long enough yet, or a Mac holding fewer models (the lower id, of two holding
-- as many) wants it too and takes it first - replicas spread over the Macs; 'gone': the model is not
-- declared, or is being removed.
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw then return 'gone' end
local model = cjson.decode(raw)
if model.removing then return 'gone' end
local agent, now, lease, load = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local settle = tonumber(ARGV[6])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
if redis.call('ZSCORE', KEYS[2], agent) then
  redis.call('ZADD', KEYS[2], now + lease, agent)
  redis.call('PEXPIRE', KEYS[2], lease * 2)
  return 'claimed'
end
if redis.call('ZCARD', KEYS[2]) >= tonumber(model.replicas) then
  redis.call('HDEL', KEYS[3], agent)
  return 'taken'
end
local mine = redis.call('HGET', KEYS[3], agent)
local since = now
if mine then
  local before = cjson.decode(mine)
  if before['until'] > now then since = before.since end
end
redis.call('HSET', KEYS[3], agent, cjson.encode({load = load, since = since, ['until'] = now + lease}))
redis.call('PEXPIRE', KEYS[3], lease * 2)
if now - since < settle then return 'wait' end
local wants = redis.call('HGETALL', KEYS[3])
for i = 1, #wants, 2 do
  local other = cjson.decode(wants[i + 1])
  if other['until'] <= now then
    redis.call('HDEL', KEYS[3], wants[i])
  elseif wants[i] ~= agent and (other.load < load or (other.load == load and wants[i] < agent)) then
    return 'wait'
  end
end
redis.call('HDEL', KEYS[3], agent)
redis.call('ZADD', KEYS[2], now + lease, agent)
redis.call('PEXPIRE', KEYS[2], lease * 2)
return 'claimed'
