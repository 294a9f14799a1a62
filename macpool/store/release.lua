-- Give back the slots a request holds on a node, handing them to waiting requests (Store.release).
-- ARGV after the common three: the request id, the node id, its tenant, the slots it holds there (0: however
-- many), failed ('1': the node failed this request - its slots are not handed to a waiter, who would only
-- meet the same failure; the waiters are told they are free and choose among the nodes they still trust),
-- the queue lease (how long a slot handed to a waiter is kept for it until it takes it).
-- Returns the slots released.
local rid, node, tenant = ARGV[4], ARGV[5], ARGV[6]
local slots, failed, queue_lease = tonumber(ARGV[7]), ARGV[8] == '1', tonumber(ARGV[9])
untrack(rid)
return release(node, rid, tenant, NOW, queue_lease, failed, slots)
