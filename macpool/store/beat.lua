-- One router's liveness beat (Store.beat): it counts as alive until the given time, and what the routers
-- that stopped beating held is given back. The call declares every node of the pool's index.
-- ARGS: router, alive_until (ms), queue_lease (ms). Returns the slots given back.
redis.call('ZADD', K.routers, ARGS.alive_until, ARGS.router)
return reclaim(NOW, ARGS.queue_lease)
