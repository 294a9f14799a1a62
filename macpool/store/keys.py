"""Every Redis key name of the pool, in one place.

``{p}`` is the configurable prefix (default ``macpool:{pool}:``). Its hash tag (``{pool}``) puts every key of
one pool in one Redis Cluster hash slot, so the scripts run unchanged on Redis Cluster and on managed Redis in
cluster mode; a prefix without a tag (``macpool:``) works on a single Redis or behind Sentinel only.

``{p}node:{id}``      HASH, TTL = heartbeat TTL. Fields: ``doc`` (the NodeDoc JSON), and what the scripts read
                      of it (macpool/store/api.py ``_node_fields``): ``capacity``, ``state``, ``models``
                      (newline-separated), ``slots`` (llama-server's), its KV cache (``seq_ctx``,
                      ``kv_unified``, ``kv_cells``, ``n_predict``), ``instance`` and ``started`` (which
                      agent process holds the id, and since when). A dead Mac disappears with its TTL; of two
                      agents under one id, the one started last holds it.
``{p}nodes``          ZSET node id -> last heartbeat (ms): the index routers read; expired entries are pruned.
``{p}resv:{id}``      ZSET reservation member -> lease expiry (ms): one member per slot a request holds on
                      that node (``rid``, then ``rid#2`` .. ``rid#k``: lib.lua ``members``).
``{p}tokens:{id}``    HASH request id -> the tokens it holds of that node's KV cache (one holding none has no
                      entry): written, pruned and removed with its reservations, with the same TTL.
``{p}drained``        SET of node ids an operator drained.
``{p}queue``          ZSET waiter id -> lease expiry (ms): the global, bounded wait queue.
``{p}qmeta``          HASH waiter id -> its record, a JSON document (its fields: lib.lua ``record``).
``{p}inflight``       ZSET "tenant \t request id" -> lease expiry: every request in flight, by tenant.
``{p}inflight:count`` HASH tenant -> how many members ``{p}inflight`` holds for it (the scripts prune
                      expired members and keep the count with them).
``{p}routers``        ZSET router id -> until when it counts as alive (ms), which each router beats.
``{p}held``           HASH request id -> {router, node, tenant, slots} (JSON; lib.lua ``held_record``): the
                      reservations each router holds, given back by any router's next beat once that router
                      stops beating.
``{p}affinity``       HASH prompt-prefix hash -> the node that last served it;
``{p}affinity:lru``   ZSET prefix hash -> last use (ms), which bounds it to the newest N entries.
``{p}desired:{id}``   STRING ``active`` or ``standby``: what the autoscaler wants of a standby-capable agent,
                      which reads it on each heartbeat (absent: the mode it was started in).
``{p}loading:{model}`` STRING, TTL = the cold-start timeout: the node a router asked to load the model, so
                      that the requests waiting for it, on every router, trigger one load.
``{p}autoscale:leader`` STRING, TTL = the lease: the id of the one ``macpool autoscale`` that acts.
``{p}autoscale:known``  HASH node id -> how to wake it (JSON: MAC, broadcast, models, standby capacity), kept
                      by the autoscaler from heartbeats, so a Mac asleep (its key expired) can be woken.
``{p}models``         HASH model name -> its declaration (``DeclaredModel`` JSON): the models the pool serves
                      and on how many Macs (``macpool models``; macpool/store/models.py).
``{p}model:claims:{name}`` ZSET agent node id -> lease expiry (ms): the Macs holding a replica of the model,
                      each renewing its lease while it has it (claim.lua: never more than its replicas).
``{p}model:wants:{name}``  HASH agent node id -> ``{"load", "until"}`` (JSON): Macs that would take a replica,
                      with how many declared models each holds already: the one holding fewest takes it.
``{p}revoked``        HASH node id -> the operator's signed word on it (macpool/identity.py ``Revocation``:
                      revoked or not, since when); routers remember every one they have seen.
``{p}events``         pub/sub channel: ``node <doc json>``, ``gone <id>``, ``freed <id>`` (one per slot),
                      ``granted <request id> <node id> <k>``, ``shed <request id>``, ``drain <id>``,
                      ``undrain <id>``, ``autoscale <decision json>`` (macpool/store/elastic.py).
"""

from __future__ import annotations

from collections.abc import Iterable

DEFAULT_PREFIX = "macpool:{pool}:"


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
        self.routers = f"{prefix}routers"
        self.in_flight = f"{prefix}inflight"
        self.in_flight_count = f"{prefix}inflight:count"
        self.held = f"{prefix}held"
        self.autoscale_leader = f"{prefix}autoscale:leader"
        self.autoscale_known = f"{prefix}autoscale:known"
        self.models = f"{prefix}models"
        self.revoked = f"{prefix}revoked"

    def node(self, node_id: str) -> str:
        return f"{self.prefix}node:{node_id}"

    def reservations(self, node_id: str) -> str:
        return f"{self.prefix}resv:{node_id}"

    def tokens(self, node_id: str) -> str:
        return f"{self.prefix}tokens:{node_id}"

    def sessions(self, node_id: str) -> str:
        return f"{self.prefix}sessions:{node_id}"

    def desired(self, node_id: str) -> str:
        return f"{self.prefix}desired:{node_id}"

    def loading(self, model: str) -> str:
        return f"{self.prefix}loading:{model}"

    def model_claims(self, name: str) -> str:
        return f"{self.prefix}model:claims:{name}"

    def model_wants(self, name: str) -> str:
        return f"{self.prefix}model:wants:{name}"

    def pool_wide(self) -> list[str]:
        """The pool-wide KEYS of the admission scripts, in the order lib.lua reads them."""
        return [self.queue, self.queue_meta, self.drained, self.affinity, self.affinity_lru, self.routers,
                self.in_flight, self.in_flight_count, self.held]

    def admission(self, nodes: Iterable[str] = ()) -> tuple[list[str], str]:
        """The KEYS and the first ARGV of an admission script: the pool-wide keys, then each of ``nodes``'
        heartbeat, reservations, tokens and sessions; ARGV[1] names those nodes, one per line. A script
        touches no other key: a node not declared is one it cannot see (lib.lua)."""
        declared = list(dict.fromkeys(nodes))
        per_node = [key for node_id in declared
                    for key in (self.node(node_id), self.reservations(node_id), self.tokens(node_id),
                                self.sessions(node_id))]
        return [*self.pool_wide(), *per_node], "\n".join(declared)
