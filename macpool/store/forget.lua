-- Remove a lease without handing its slots on: a renewal that crossed its release brought it back
-- (Store.forget). ARGS: rid, node, tenant, slots.
drop(ARGS.node, ARGS.rid, ARGS.tenant, ARGS.slots)
untrack(ARGS.rid)
return 1
