-- Write one agent's heartbeat and announce it (Store.heartbeat).
-- KEYS: the node's key, the node index. ARGV: the events channel, node id, doc (JSON), capacity, state,
-- models (newline-separated), TTL (ms), updated (ms), instance, started (ms), llama-server's slots.
-- 1: written. Refused (the holder's doc) when another agent process holds the id and started later (ties
-- by instance): the old agent of a restart drains while the new one serves, and two Macs given one id
-- settle on one instead of taking turns.
local key, index = KEYS[1], KEYS[2]
local events, id, doc, instance, started = ARGV[1], ARGV[2], ARGV[3], ARGV[9], tonumber(ARGV[10])
local held = redis.call('HMGET', key, 'instance', 'started', 'doc')
if held[1] and held[1] ~= '' and held[1] ~= instance then
  local since = tonumber(held[2]) or 0
  if since > started or (since == started and held[1] > instance) then
    return held[3] or ''
  end
end
redis.call('HSET', key, 'doc', doc, 'capacity', ARGV[4], 'state', ARGV[5], 'models', ARGV[6],
           'instance', instance, 'started', ARGV[10], 'slots', ARGV[11])
redis.call('PEXPIRE', key, tonumber(ARGV[7]))
redis.call('ZADD', index, ARGV[8], id)
redis.call('PUBLISH', events, 'node ' .. doc)
return 1
