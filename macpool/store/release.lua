-- Give back the slots a request holds on a node, handing them to waiting requests (Store.release).
-- ARGS: rid, node, tenant, slots (those it holds there; 0: however many), failed (the node failed this
-- request: its slots are not handed to a waiter, who would only meet the same failure; the waiters are told
-- they are free and choose among the nodes they still trust), queue_lease (ms: how long a slot handed to a
-- waiter is kept for it until it takes it).
-- Returns the slots released.
untrack(ARGS.rid)
return release(ARGS.node, ARGS.rid, ARGS.tenant, NOW, ARGS.queue_lease, ARGS.failed, ARGS.slots)
