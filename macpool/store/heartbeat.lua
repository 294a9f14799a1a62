-- Write one agent's heartbeat and announce it (Store.heartbeat).
-- KEYS: the node's key, the node index. ARGV: the events channel, the heartbeat document (NodeDoc's JSON,
-- kept as it is), then the call's arguments as one JSON document: id (the node's), ttl (ms), at (ms: the
-- beat's time, its score in the index), and fields - what the scripts read of the node, by name, as the
-- hash keeps them (macpool/store/api.py): instance and started among them.
-- 1: written. Refused (the holder's doc) when another agent process holds the id and started later (ties
-- by instance): the old agent of a restart drains while the new one serves, and two Macs given one id
-- settle on one instead of taking turns.
local key, index, events, doc = KEYS[1], KEYS[2], ARGV[1], ARGV[2]
local call = cjson.decode(ARGV[3])
local fields = call.fields
local instance, started = fields.instance, tonumber(fields.started)
local held = redis.call('HMGET', key, 'instance', 'started', 'doc')
if held[1] and held[1] ~= '' and held[1] ~= instance then
  local since = tonumber(held[2]) or 0
  if since > started or (since == started and held[1] > instance) then
    return held[3] or ''
  end
end
local hset = {'doc', doc}
for name, value in pairs(fields) do
  hset[#hset + 1] = name
  hset[#hset + 1] = value
end
redis.call('HSET', key, unpack(hset))
redis.call('PEXPIRE', key, call.ttl)
redis.call('ZADD', index, call.at, call.id)
redis.call('PUBLISH', events, 'node ' .. doc)
return 1
