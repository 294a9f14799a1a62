-- A router loads a model on one standby node, once for every router (ElasticStore.load_once).
-- KEYS: the model's loading marker, the node's desired mode. ARGV: the ask ("<node id>\t<unique id>", the
-- marker's value), how long the marker holds (ms): while it does, no other request triggers a load of the
-- model (a load that failed is tried again once it lapses); and an ask found over ('' for none): its node
-- refused the load, or loaded the model and unloaded it since, so the marker is replaced if it still holds
-- that ask.
-- 1: this call asked the node to load the model; 0: a load of it was already asked for.
if ARGV[3] ~= '' and redis.call('GET', KEYS[1]) == ARGV[3] then
  redis.call('DEL', KEYS[1])
end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  redis.call('SET', KEYS[2], 'active')
  return 1
end
return 0
