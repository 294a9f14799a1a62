-- Extend running requests' leases (Store.renew); the call declares each lease's node.
-- ARGS: expiry (ms), lease (ms), leases (each {rid, node, tenant, slots, tokens, router}; router "": none
-- named).
-- Returns, for each lease, 1: renewed, or 2: re-created - it was gone (Redis lost its data, or the lease had
-- expired) while its request still runs, and is counted again.
local out = {}
for i, l in ipairs(ARGS.leases) do
  out[i] = extend(l.node, l.rid, l.tenant, l.slots, l.tokens, ARGS.expiry, ARGS.lease) and 1 or 2
  -- (a router counted dead and reclaimed holds it again: it was only slow, or cut off)
  track(l.router, l.rid, l.node, l.tenant, l.slots)
end
return out
