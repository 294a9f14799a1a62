-- An agent's clean shutdown: its node leaves the pool at once (Store.deregister).
-- KEYS: the node's key, the node index. ARGV: the events channel, node id, instance.
-- 0 (nothing removed) when another agent process holds the id.
local key, index = KEYS[1], KEYS[2]
local events, id, instance = ARGV[1], ARGV[2], ARGV[3]
local held = redis.call('HGET', key, 'instance')
if held and held ~= '' and held ~= instance then return 0 end
redis.call('DEL', key)
redis.call('ZREM', index, id)
redis.call('PUBLISH', events, 'gone ' .. id)
return 1
