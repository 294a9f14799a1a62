-- One router's liveness beat (Store.beat): it counts as alive until the given time, and what the routers
-- that stopped beating held is given back. The call declares every node of the pool's index.
-- ARGV after the common three: the router id, until when it is alive (ms), the queue lease (ms).
-- Returns the slots given back.
redis.call('ZADD', K.routers, ARGV[5], ARGV[4])
return reclaim(NOW, tonumber(ARGV[6]))
