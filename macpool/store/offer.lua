-- Free slots no release announced (a node that just became ready, or whose capacity grew): hand them to
-- waiting requests, as a release would (Store.offer). Without it a new node's slots wait for waiters to look
-- for them on their own, while the releases of the busy nodes keep serving the head of the queue.
-- ARGS: node, queue_lease (ms). Returns the slots handed over.
return hand_over(ARGS.node, NOW, ARGS.queue_lease)
