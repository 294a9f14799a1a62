"""Every Redis key name of the pool, in one place.

``{p}`` is the configurable prefix (default ``macpool:``). Redis Cluster needs every key one script touches in
one hash slot: a prefix holding a hash tag, such as ``{macpool}:``, puts all of a pool's keys there.

``{p}node:{id}``      HASH, TTL = heartbeat TTL. Fields: ``doc`` (the NodeDoc JSON), ``capacity``, ``state``,
                      ``models`` (newline-separated), ``slots`` (llama-server's), ``instance`` and ``started``
                      (which agent process holds the id, and since when). A dead Mac disappears with its TTL;
                      of two agents under one id, the one started last holds it.
``{p}nodes``          ZSET node id -> last heartbeat (ms): the index routers read; expired entries are pruned.
``{p}resv:{id}``      ZSET reservation member -> lease expiry (ms): one member per slot a request holds on
                      that node (``rid``, then ``rid#2`` .. ``rid#k``: macpool/store/api.py ``members``).
``{p}drained``        SET of node ids an operator drained.
``{p}queue``          ZSET waiter id -> lease expiry (ms): the global, bounded wait queue.
``{p}qmeta``          HASH waiter id -> its record (the format is in lib.lua).
``{p}tenant:{name}``  ZSET request id -> lease expiry: one tenant's (API key's) requests in flight.
``{p}affinity``       HASH prompt-prefix hash -> the node that last served it;
``{p}affinity:lru``   ZSET prefix hash -> last use (ms), which bounds it to the newest N entries.
``{p}desired:{id}``   STRING ``active`` or ``standby``: what the autoscaler wants of a standby-capable agent,
                      which reads it on each heartbeat (absent: the mode it was started in).
``{p}autoscale:leader`` STRING, TTL = the lease: the id of the one ``macpool autoscale`` that acts.
``{p}autoscale:known``  HASH node id -> how to wake it (JSON: MAC, broadcast, models, standby capacity), kept
                      by the autoscaler from heartbeats, so a Mac asleep (its key expired) can be woken.
``{p}events``         pub/sub channel: ``node <doc json>``, ``gone <id>``, ``freed <id>`` (one per slot),
                      ``granted <request id> <node id> <k>``, ``shed <request id>``, ``drain <id>``,
                      ``undrain <id>``, ``autoscale <decision json>`` (macpool/store/elastic.py).
"""

from __future__ import annotations

DEFAULT_PREFIX = "macpool:"


class Keys:
    """Key names under one prefix."""

    def __init__(self, prefix: str = DEFAULT_PREFIX) -> None:
        self.prefix = prefix
        self.nodes = f"{prefix}nodes"
        self.drained = f"{prefix}drained"
        self.queue = f"{prefix}queue"
        self.queue_meta = f"{prefix}qmeta"
        self.affinity = f"{prefix}affinity"
        self.affinity_lru = f"{prefix}affinity:lru"
        self.events = f"{prefix}events"
        self.autoscale_leader = f"{prefix}autoscale:leader"
        self.autoscale_known = f"{prefix}autoscale:known"

    def node(self, node_id: str) -> str:
        return f"{self.prefix}node:{node_id}"

    def reservations(self, node_id: str) -> str:
        return f"{self.prefix}resv:{node_id}"

    def tenant(self, name: str) -> str:
        return f"{self.prefix}tenant:{name}"

    def desired(self, node_id: str) -> str:
        return f"{self.prefix}desired:{node_id}"

    def pool_wide(self) -> list[str]:
        """The KEYS of the admission scripts, in the order lib.lua reads them (its node and tenant keys are
        built there from the prefix, as :meth:`node`, :meth:`reservations` and :meth:`tenant` build them)."""
        return [self.queue, self.queue_meta, self.drained, self.affinity, self.affinity_lru]
