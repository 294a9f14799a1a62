"""Random sequences of admission-script calls on a real Redis, each followed by checks of what the scripts
promise, read straight from Redis. Seeded and bounded: a failure names its seed and the calls that led to it
(``MACPOOL_FUZZ_SEEDS=200 MACPOOL_FUZZ_OPS=500`` runs more).

The calls are those routers make, on 2-5 nodes of capacity 1-6 with llama-server's slots known or not, and its
KV cache known or not (one pool of cells the slots share, or a context per slot): arrivals (1-4 generations,
interactive or batch, 1-3 tenants, their prompt and output tokens counted or not, some with prompt prefixes,
some excluding a node, some naming the model's alias or no model; half of those with prompts counted from
routers that measured every node, whose placement weighs each node's cache, so that a request may choose to
wait for a busy node holding more of its prompt), waiters re-checking (taking the slots
handed to them, or turning them down), releases (by count, or 0: however many it holds; some failed, most of
those followed by the request's retry elsewhere), a cancelled reservation undone on every candidate, waiters
leaving the queue (with and without their nodes), renewals, routers dying or stalling past their waiters'
queue lease, and time passing the leases; heartbeats change a node's capacity, slots, KV cache and state, or
it goes; operators drain.

Checked after every call:
- a node gains reservations only while ready, undrained and within its capacity, and only while the tokens
  reserved on a node whose slots share their cells stay within those cells;
- the tokens a node records are those of its requests' reservations: each entry beside its request's
  reservations (expired ones are pruned with them), a running request's as its reservation said, a waiter
  handed slots holds the tokens it needs there, and the records expire with the reservations;
- a request holds 0 or need(generations, slots) reservations - rid, rid#2 .. rid#k - on one node only, is in
  its tenant's in-flight set exactly while it holds them, and holds nothing once finished;
- a waiter that chose to wait for one node is handed no other node's slots, nor holds them back (every check
  below counts it on that node only);
- a waiting request holds nothing, a waiter marked ``g:<node>`` holds its slots on that node, one marked
  ``shed`` nothing; no waiter is passed over for affinity more than MAX_PASSES times; an arrival queues only
  while fewer than queue_size wait (a waiter turning down the slots handed to it waits on, past it);
- every waiter marked is told (``granted <rid> <node> <k>``, ``shed <rid>``), and a release announces each
  slot it gave back that nobody was handed (``freed``);
- where the call ran a hand-over (a release, a waiter leaving or taking or turning down its slots, a waiter
  moving to another node): on that node, the first waiter that takes or holds back its free slots needs
  more than are free, and nobody may pass it for affinity - unless a later step of the same call reordered
  the queue (another hand-over, or the caller's own reservation);
- a request reserving by itself takes no slots held back for a waiter ahead of it (whatever model name it
  asked for), and leaves free slots enough for the waiters ahead of it that could run where it went (and,
  where cells bind, the cells those that fit there need);
and, once every live waiter has re-checked until nothing changes (with no waiter of a dead or stalled router
left), that no node has free slots its first waiter fits in; and, at the end, once every request is
released or gone, that no node holds any reservation or token.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
import redis

from macpool.contract import Priority, slots_needed
from macpool.dev.redis_server import ClusterDeployment
from macpool.store import Candidate, Keys, Lease, Release, Reservation, ReserveRequest
from tests.blocking_store import BlockingStore, sync_redis
from tests.strict_keys import strict_keys  # noqa: F401  (the fixture)

pytestmark = pytest.mark.usefixtures("strict_keys")  # every script touches only its KEYS

KEYS = Keys()
LEASE = 60_000
QUEUE_LEASE = 3_000
AFFINITY_SKIP, MAX_PASSES = 8, 4  # as in macpool/store/lib.lua
SHARES = {"p1": 0.9, "p2": 0.6, "p3": 0.3}  # the share of a prompt each prefix covers
SEEDS = int(os.environ.get("MACPOOL_FUZZ_SEEDS", "8"))
OPS = int(os.environ.get("MACPOOL_FUZZ_OPS", "250"))


# --- what Redis holds ---------------------------------------------------------------------------------------

@dataclass
class NodeView:
    cap: int
    state: str
    models: list[str]
    slots: int
    drained: bool
    members: dict[str, float]  # every reservation member -> its expiry, live or not
    seq_ctx: int = 0
    cells: int = 0  # the cells its slots share (0: none shared, or unknown)
    n_predict: int = -1
    tokens: dict[str, int] = field(default_factory=dict)  # request id -> the tokens it holds (recorded)
    tokens_ttl: int = -2  # the tokens key's PTTL

    def active(self) -> bool:
        return self.cap > 0 and self.state == "ready" and not self.drained

    def tokens_on(self, prompt: int, output: int) -> int:
        """The tokens a request holds here (lib.lua's tokens_on)."""
        if prompt <= 0:
            return 0
        if self.seq_ctx <= 0:
            return prompt + output
        if output <= 0:
            output = self.n_predict if self.n_predict > 0 else self.seq_ctx - prompt
        return min(prompt + output, self.seq_ctx)

    def could_hold(self, k: int, t: int, prompt: int) -> bool:
        return (k <= self.cap and (self.cells == 0 or t <= self.cells)
                and (self.seq_ctx <= 0 or prompt < self.seq_ctx))

    def serves(self, model: str) -> bool:
        return model == "" or model in self.models


@dataclass
class Entry:
    """A live queue entry and its qmeta record."""

    rid: str
    prio: str
    tenant: str
    model: str
    enq: int
    mark: str
    pref: str
    passes: int
    declined: frozenset[str]
    gens: int
    prompt: int
    output: int
    hold: str  # the node a bulky waiter waits on ("": none, so every node it runs on)
    stay: str = ""  # the node it chose to wait for, its cache holding more of its prompt ("": none)

    def bulky(self) -> bool:
        return self.gens > 1 or self.prompt > 0


@dataclass
class View:
    now: int
    nodes: dict[str, NodeView]
    entries: dict[str, Entry]
    tenants: dict[str, dict[str, float]]  # tenant -> its requests in flight -> lease expiry (from now on)

    def in_flight(self) -> dict[str, str]:
        """request id -> its tenant, for the live requests in flight."""
        return {rid: t for t, ids in self.tenants.items() for rid, expiry in ids.items() if expiry > self.now}

    def live(self, node: str) -> dict[str, list[str]]:
        """request id -> its live reservation members on ``node``."""
        out: dict[str, list[str]] = {}
        for member, expiry in self.nodes[node].members.items():
            if expiry > self.now:
                out.setdefault(member.split("#")[0], []).append(member)
        return out

    def present(self, node: str, rid: str) -> int:
        """The slots ``rid`` holds on ``node`` as the scripts' held() counts them (lapsed ones too)."""
        members = self.nodes[node].members
        k = 0
        while (rid if k == 0 else f"{rid}#{k + 1}") in members:
            k += 1
        return k

    def free(self, node: str) -> int:
        view = self.nodes[node]
        return max(view.cap - sum(map(len, self.live(node).values())), 0) if view.active() else 0

    def used(self, node: str) -> int:
        """The tokens the live reservations on ``node`` hold."""
        return sum(self.nodes[node].tokens.get(rid, 0) for rid in self.live(node))

    def size(self, e: Entry, node: str) -> tuple[int, int]:
        view = self.nodes[node]
        return slots_needed(e.gens, view.slots), view.tokens_on(e.prompt, e.output)

    def room(self, node: str, k: int, t: int) -> bool:
        """Whether k slots and t tokens fit in what ``node`` has free."""
        cells = self.nodes[node].cells
        return k <= self.free(node) and (cells == 0 or self.used(node) + t <= cells)

    def load(self, tenant: str) -> int:
        return len(self.tenants.get(tenant, ()))  # (as the scripts count it: a lease ending now too)

    def order(self, e: Entry) -> tuple[bool, int, int, str]:
        """Queue order: interactive first, then the tenant with fewer in flight, then the oldest."""
        return (e.prio == "batch", self.load(e.tenant), e.enq, e.rid)

    def eligible(self, e: Entry, node: str) -> bool:
        view = self.nodes[node]
        return (e.mark == "" and view.serves(e.model) and node not in e.declined
                and e.stay in ("", node) and view.could_hold(*self.size(e, node), e.prompt))

    def fits(self, e: Entry, nodes: list[str]) -> bool:
        return any(self.eligible(e, n) and self.room(n, *self.size(e, n)) for n in nodes)

    def claimants(self, node: str) -> list[Entry]:
        """The waiters, in queue order, that take ``node``'s free slots (they fit) or hold them back (they
        wait on it): those its hand-over looks at."""
        if not self.nodes[node].active():
            return []
        out = [e for e in self.entries.values()
               if self.eligible(e, node) and (self.fits(e, [node]) or e.hold in ("", node))]
        return sorted(out, key=self.order)

    def pick(self, node: str) -> Entry | None:
        """Whom a hand-over on ``node`` gives its free slots now: the first claimant, or - prefix affinity
        among equals - one of the first few that prefers this node, passed over at most MAX_PASSES times."""
        live = self.claimants(node)[:AFFINITY_SKIP]
        if not live:
            return None
        head = live[0]
        for e in live:
            if e.prio != head.prio or self.load(e.tenant) != self.load(head.tenant):
                break
            if e.pref == node and self.fits(e, [node]):
                return e
            if e.passes >= MAX_PASSES:
                break
        return head if self.fits(head, [node]) else None


def read(r: redis.Redis | redis.RedisCluster, nodes: list[str], tenants: list[str], now: int) -> View:
    pipe = r.pipeline(transaction=False)
    for node in nodes:
        pipe.hgetall(KEYS.node(node))
        pipe.zrange(KEYS.reservations(node), 0, -1, withscores=True)
        pipe.hgetall(KEYS.tokens(node))
        pipe.pttl(KEYS.tokens(node))
    pipe.smembers(KEYS.drained)
    pipe.zrange(KEYS.queue, 0, -1, withscores=True)
    pipe.hgetall(KEYS.queue_meta)
    pipe.zrange(KEYS.in_flight, 0, -1, withscores=True)
    pipe.hgetall(KEYS.in_flight_count)
    replies = pipe.execute()
    drained, queue, meta, flying, counts = replies[4 * len(nodes):]
    views = {}
    for i, node in enumerate(nodes):
        h, members, tokens, ttl = replies[4 * i:4 * i + 4]
        views[node] = NodeView(int(h.get("capacity", 0)), h.get("state", ""),
                               [m for m in h.get("models", "").split("\n") if m], int(h.get("slots", 0)),
                               node in drained, dict(members), int(h.get("seq_ctx", 0)),
                               int(h.get("kv_cells", 0)) if h.get("kv_unified") == "1" else 0,
                               int(h.get("n_predict", -1)), {rid: int(t) for rid, t in tokens.items()}, ttl)
    entries = {}
    for rid, expiry in queue:
        if expiry > now and rid in meta:
            d = json.loads(meta[rid])
            entries[rid] = Entry(rid, d["priority"], d["tenant"], d["model"], d["arrival"], d["mark"],
                                 d["preferred"], d["passes"], frozenset(d["declined"]), d["generations"],
                                 d["prompt_tokens"], d["output_tokens"], d["hold"], d.get("stay", ""))
    in_flight: dict[str, dict[str, float]] = {tenant: {} for tenant in tenants}
    members: dict[str, int] = {}
    for member, expiry in flying:
        tenant, rid = member.split("\t")
        members[tenant] = members.get(tenant, 0) + 1
        if expiry >= now:  # (as the scripts count it: a lease ending now too)
            in_flight.setdefault(tenant, {})[rid] = expiry
    # the scripts keep each tenant's count with its members, the expired ones not yet pruned included
    assert {t: int(n) for t, n in counts.items()} == members, (counts, members)
    return View(now, views, entries, in_flight)


# --- the driver ------------------------------------------------------------------------------------------

@dataclass
class Request:
    rid: str
    gens: int
    priority: Priority
    tenant: str
    model: str
    prefixes: tuple[str, ...]
    excluded: frozenset[str]  # nodes its router no longer sends it to (tried, or circuit open)
    prompt: int = 0  # its tokens, as its router counts them (0: not counted)
    output: int = 0
    state: str = "new"  # waiting, running, done; dead: its router died
    node: str = ""
    slots: int = 0
    tokens: int = 0
    nodes: list[str] = field(default_factory=list)  # its candidates at its last attempt
    queued: bool = False  # it waited in the queue
    stalled: bool = False  # its router stalled past its queue lease: its place may be gone


@dataclass
class Steps:
    """What one call did, in order, that the hand-over check needs: ("hand", node) a hand-over or pass-on ran
    on the node, ("reserve", node) the caller reserved there itself; and for a RELEASE, its node and the slots
    it gave back."""

    steps: list[tuple[str, str]] = field(default_factory=list)
    released: tuple[str, int] = ("", 0)

    def hand(self, nodes: list[str]) -> None:
        self.steps += [("hand", n) for n in nodes]


class Fuzz:
    def __init__(self, url: str, seed: int) -> None:
        self.rng = rng = random.Random(seed)
        self.resources = contextlib.ExitStack()
        self.r = self.resources.enter_context(sync_redis(url))
        self.r.flushall()
        self.api = BlockingStore(url, KEYS)
        self.pubsub = self.r.pubsub(ignore_subscribe_messages=True)
        self.pubsub.subscribe(KEYS.events)
        self.syncs = 0
        self.now = 1_000_000_000  # the clock every call is given (virtual: time passes when the driver says)
        self.nodes = [f"n{i}" for i in range(rng.randint(2, 5))]
        self.tenants = [f"t{i}" for i in range(rng.randint(1, 3))]
        # nodes serve their model under two names, and a request may name either, or none (any node)
        self.aliases = rng.random() < 0.3
        self.models = ["m", "alias", ""] if self.aliases else ["m"]
        self.queue_size = rng.randint(1, 10)
        self.batch_max = rng.randint(0, self.queue_size)
        self.key_limit = rng.choice([0, 0, 0, 3, 6])
        self.requests: dict[str, Request] = {}
        self.log: list[str] = []
        self.kv: dict[str, dict[str, int]] = {}  # node -> its KV cache, as its heartbeat says
        for node in self.nodes:
            slots = rng.choice([0, 0, 1, 2, 3, 4])
            self.kv[node] = self.random_kv(slots)
            self.write_node(node, rng.randint(1, 6), slots, "ready")
        self.api.store.known_nodes = frozenset(self.nodes)  # (as the routers' pool reads find them)

    def close(self) -> None:
        self.pubsub.close()
        self.resources.close()
        self.api.close()

    # --- calls, as routers make them ----------------------------------------------------------------

    def random_kv(self, slots: int) -> dict[str, int]:
        """A KV cache: unknown, one pool of cells the slots share, or a context per slot."""
        rng = self.rng
        unknown = {"seq_ctx": 0, "kv_unified": 0, "kv_cells": 0, "n_predict": -1}
        what = rng.random()
        if what < 0.3:
            return unknown
        ctx, n_predict = rng.choice([4096, 8192, 16384]), rng.choice([-1, -1, 512, 2048])
        if what < 0.75:
            return {"seq_ctx": ctx, "kv_unified": 1, "kv_cells": ctx, "n_predict": n_predict}
        return {"seq_ctx": ctx, "kv_unified": 0, "kv_cells": ctx * max(slots, 1), "n_predict": n_predict}

    def write_node(self, node: str, cap: int, slots: int, state: str) -> None:
        models = "m\nalias" if self.aliases else "m"
        fields = {"capacity": cap, "state": state, "models": models, "slots": slots, **self.kv[node]}
        self.r.hset(KEYS.node(node), mapping=fields)

    def view(self) -> View:
        return read(self.r, self.nodes, self.tenants, self.now)

    def candidates(self, req: Request) -> list[str]:
        """The nodes its router would send it to: ready, undrained, serving its model, big enough, not
        excluded (now and then from a stale view: a node just drained or shrunk is still among them)."""
        view = self.view()
        out = []
        for node in self.nodes:
            v = view.nodes[node]
            stale = self.rng.random() < 0.05
            k, t = slots_needed(req.gens, v.slots), v.tokens_on(req.prompt, req.output)
            if (v.serves(req.model) and node not in req.excluded
                    and (stale or (v.active() and v.could_hold(k, t, req.prompt)))):
                out.append(node)
        return out

    def ask(self, req: Request, nodes: list[str], dequeue: bool) -> Reservation:
        # distinct tokens/s per node: ties in utilisation are broken by speed, never by the random number
        candidates = [Candidate(n, float(self.nodes.index(n) + 1)) for n in nodes]
        batch_cost, shares = 0.0, ()
        if req.prompt and self.rng.random() < 0.5:
            # its router measured every node: placement weighs each with its prompt time, backlog and what its
            # cache holds, and the request may choose to wait for a busy node whose cache holds more (stay)
            rng = self.rng
            candidates = [Candidate(c.node_id, c.tokens_per_s, ttft_s=1.0, decode_s=rng.uniform(0.5, 3.0),
                                    prefill_s=rng.uniform(1.0, 30.0), backlog_s=rng.choice([0.0, 0.0, 10.0]))
                          for c in candidates]
            batch_cost, shares = 0.175, tuple(SHARES[p] for p in req.prefixes)
        request = ReserveRequest(
            req.rid, candidates, LEASE,
            queue_size=self.queue_size, enqueue=True, dequeue=dequeue, priority=req.priority,
            tenant=req.tenant, model=req.model, key_limit=self.key_limit, batch_queue_max=self.batch_max,
            prefixes=req.prefixes, queue_lease_ms=QUEUE_LEASE, excluded=sorted(req.excluded),
            generations=req.gens, prompt_tokens=req.prompt, output_tokens=req.output, batch_cost=batch_cost,
            prefix_shares=shares,
        )
        req.nodes = nodes
        before = self.view()
        reply = self.api.run(self.api.store.reserve(request, self.now))
        if reply.status == "reserved":
            req.state, req.node, req.slots, req.tokens = "running", reply.node_id, reply.slots, reply.tokens
            v = before.nodes[reply.node_id]
            me = before.entries.get(req.rid)
            handed = me is not None and me.mark == "g:" + req.node and before.present(req.node, req.rid)
            expected = v.tokens.get(req.rid, 0) if handed else v.tokens_on(req.prompt, req.output)
            assert req.tokens == expected, f"{req.rid} holds {req.tokens} tokens on {req.node}: {expected}?"
        elif reply.status == "queued":
            req.state, req.queued = "waiting", True
        else:
            req.state = "done"
        return reply

    def renew(self, req: Request, now: int) -> bool:
        """Renew its lease until now + LEASE; True when it was gone (and was counted again)."""
        lease = Lease(req.rid, req.node, req.tenant, req.slots, tokens=req.tokens)
        return self.api.run(self.api.store.renew([lease], LEASE, now))[0]

    def arrive(self, req: Request) -> Steps:
        self.requests[req.rid] = req
        nodes = self.candidates(req)
        if not nodes:
            req.state = "done"  # its router answers it itself
            self.log.append(f"{req.rid}: no candidates")
            return Steps()
        reply = self.ask(req, nodes, dequeue=False)
        self.log.append(f"arrive {req} -> {reply}")
        return Steps()

    def recheck(self, req: Request, wander: bool = True) -> Steps:
        """A waiter's re-check (woken by `granted`, `freed` or its safety timer)."""
        if wander and self.rng.random() < 0.15:  # its router tried a node since, or a circuit opened/closed
            req.excluded = req.excluded ^ {self.rng.choice(self.nodes)}
        before = self.view()
        nodes = self.candidates(req)
        if not nodes:
            return self.leave(req, True)  # no node for it any more: its router gives up
        me = before.entries.get(req.rid)
        req.stalled = False
        reply = self.ask(req, nodes, dequeue=True)
        self.log.append(f"recheck {req.rid} {sorted(req.excluded)} on {nodes} (was {me}) -> {reply}")
        steps = Steps()
        passed_on = nodes if req.gens > 1 or req.prompt > 0 else []  # what leaving the queue passes on
        mark = me.mark if me is not None else ""
        handed = mark[2:] if mark.startswith("g:") else ""
        if mark == "shed" or (handed in nodes and before.present(handed, req.rid) > 0):
            steps.hand(passed_on)
        elif me is not None:
            if handed and handed not in nodes and before.present(handed, req.rid) > 0:
                steps.hand([handed])  # turned down: they go on
            if reply.status == "reserved":
                steps.steps.append(("reserve", reply.node_id))
                steps.hand(passed_on)
            elif reply.status == "queued" and me.hold:
                now_on = getattr(self.view().entries.get(req.rid), "hold", me.hold)
                if now_on != me.hold:
                    steps.hand([me.hold])  # it waits on another node now: the one it left passes its slots on
        self.check_no_jump(before, req, direct=me is None or mark == "")
        return steps

    def release(self, req: Request, by_count: bool, failed: bool) -> Steps:
        count = req.slots if by_count else 0
        release = Release(req.rid, req.node, req.tenant, count, failed, QUEUE_LEASE)
        removed = self.api.run(self.api.store.release(release, self.now))
        self.log.append(f"release {req.rid} on {req.node} count={count} failed={failed} -> {removed}")
        assert removed == req.slots, f"released {removed} of the {req.slots} slots {req.rid} held"
        req.state = "done"
        return Steps([("hand", req.node)] if removed and not failed else [], (req.node, removed))

    def leave(self, req: Request, with_nodes: bool) -> Steps:
        before = self.view()
        me = before.entries.get(req.rid)
        nodes = req.nodes if with_nodes else []
        out = self.api.run(self.api.store.leave_queue(req.rid, nodes, QUEUE_LEASE, self.now))
        self.log.append(f"leave {req.rid} nodes={nodes} (was {me}) -> {out}")
        req.state = "done"
        steps = Steps()
        if me is not None and me.mark.startswith("g:") and before.present(me.mark[2:], req.rid) > 0:
            steps.hand([me.mark[2:]])
        steps.hand(nodes)
        if me is not None and me.hold and me.hold not in nodes:
            steps.hand([me.hold])  # (the node it waited on is in its record)
        return steps

    def settle(self, stalled: Request | None = None) -> None:
        """Every live waiter re-checks until nothing changes; then no node may leave free slots its first
        waiter fits in (unless a dead or stalled router's waiter is still in the queue)."""
        for _ in range(50):
            changed = False
            waiting = [q for q in self.requests.values() if q.state == "waiting" and q is not stalled]
            self.rng.shuffle(waiting)
            for req in waiting:
                before = self.view()
                steps = self.recheck(req, wander=False)
                self.check(before, steps)
                after = self.view()
                marked = [self.requests[e.rid] for e in after.entries.values() if e.mark]
                entry = after.entries.get(req.rid)
                changed |= (req.state != "waiting" or entry != before.entries.get(req.rid)
                            or any(q is not stalled and q.state != "dead" for q in marked))
            if not changed:
                break
        else:
            raise AssertionError("the waiters' re-checks never settled")
        view = self.view()
        if stalled or any(self.requests[e.rid].state == "dead" for e in view.entries.values()):
            return
        for node in self.nodes:
            head = next(iter(view.claimants(node)), None)
            assert head is None or not view.fits(head, [node]), (
                f"settled, yet {node} has {view.free(node)} free slots and its first waiter {head} fits")

    # --- the random walk ------------------------------------------------------------------------------

    def new_request(self, like: Request | None = None) -> Request:
        rng = self.rng
        rid = f"r{len(self.requests) + 1:04d}"
        if like is not None:  # a failed-over request asking again, excluding the node it failed on
            return Request(rid, like.gens, like.priority, like.tenant, like.model, like.prefixes,
                           like.excluded | {like.node}, like.prompt, like.output)
        prefixes = tuple(rng.sample(["p1", "p2", "p3"], rng.randint(1, 2))) if rng.random() < 0.4 else ()
        excluded = frozenset(rng.sample(self.nodes, 1)) if rng.random() < 0.1 else frozenset()
        priority: Priority = "batch" if rng.random() < 0.3 else "interactive"
        prompt = 0 if rng.random() < 0.3 else rng.randint(200, 6000)
        output = 0 if rng.random() < 0.5 else rng.randint(100, 3000)
        return Request(rid, rng.choice([1, 1, 1, 2, 2, 3, 4]), priority, rng.choice(self.tenants),
                       rng.choice(self.models), prefixes, excluded, prompt, output)

    def step(self) -> None:
        """One random call (or a few: a failed request's release and its retry, an undone reservation),
        each followed by the checks."""
        self.now += self.rng.choice([0, 1, 1, 2])
        # the routers' pool reads know every node, or now and then not one that just joined: a slot handed
        # over there is then one a call cannot see (lib.lua), and must lapse without breaking a rule
        known = [n for n in self.nodes if self.rng.random() > 0.1]
        self.api.store.known_nodes = frozenset(known if self.rng.random() < 0.2 else self.nodes)
        waiting = [q for q in self.requests.values() if q.state == "waiting"]
        running = [q for q in self.requests.values() if q.state == "running"]
        weights: dict[Callable[[], None], float] = {
            self.an_arrival: 5,
            self.a_recheck: 4 if waiting else 0,
            self.a_release: 2.5 if running else 0,
            self.a_waiter_leaving: 1 if waiting else 0,
            self.a_renewal: 0.3 if running else 0,
            self.a_heartbeat: 0.4,
            self.a_drain: 0.2,
            self.an_undo: 0.2 if running else 0,
            self.a_router_dying: 0.2 if waiting or running else 0,
            self.a_router_stalling: 0.1 if waiting else 0,
            self.time_passing: 0.1,
        }
        (call,) = self.rng.choices(list(weights), list(weights.values()))
        call()

    def an_arrival(self, req: Request | None = None) -> None:
        before = self.view()
        req = req or self.new_request()
        self.check(before, self.arrive(req))
        self.check_no_jump(before, req, direct=True)

    def a_recheck(self) -> None:
        before = self.view()
        waiting = [q for q in self.requests.values() if q.state == "waiting"]
        marked = [q for q in waiting if getattr(before.entries.get(q.rid), "mark", "")]
        req = self.rng.choice(marked if marked and self.rng.random() < 0.7 else waiting)
        self.check(before, self.recheck(req))

    def a_release(self) -> None:
        before = self.view()
        req = self.rng.choice([q for q in self.requests.values() if q.state == "running"])
        failed = self.rng.random() < 0.15
        self.check(before, self.release(req, self.rng.random() < 0.7, failed))
        if failed and self.rng.random() < 0.8:
            self.an_arrival(self.new_request(like=req))

    def a_waiter_leaving(self) -> None:
        """Its queue timeout, or its client gone; the router names its nodes if it runs several generations
        (and now and then not: the invariants must not depend on that hint)."""
        before = self.view()
        req = self.rng.choice([q for q in self.requests.values() if q.state == "waiting"])
        self.check(before, self.leave(req, req.gens == 1 or self.rng.random() < 0.8))

    def a_renewal(self) -> None:
        before = self.view()
        req = self.rng.choice([q for q in self.requests.values() if q.state == "running"])
        recreated = self.renew(req, self.now)
        self.log.append(f"renew {req.rid} on {req.node}")
        assert not recreated, f"the lease of {req.rid}, live, was gone"
        self.check(before, Steps())

    def a_heartbeat(self) -> None:
        before = self.view()
        node = self.rng.choice(self.nodes)
        v, what = before.nodes[node], self.rng.random()
        cap, slots, state = v.cap, v.slots, v.state
        if not state:  # back after a restart
            cap, state = self.rng.randint(1, 6), "ready"
        elif what < 0.05:  # gone: its agent deregistered, or its key expired
            self.r.delete(KEYS.node(node))
            self.log.append(f"{node} is gone")
            self.check(before, Steps())
            return
        elif what < 0.5:
            cap = self.rng.choice([0, 1, 2, 3, 4, 5, 6])
        elif what < 0.7:
            slots = self.rng.choice([0, 1, 2, 3, 4])
        elif what < 0.85:
            self.kv[node] = self.random_kv(slots)
        else:
            state = "draining" if state == "ready" else "ready"
        self.write_node(node, cap, slots, state)
        self.log.append(f"heartbeat {node} cap={cap} slots={slots} state={state} {self.kv[node]}")
        self.check(before, Steps())

    def a_drain(self) -> None:
        before = self.view()
        node = self.rng.choice(self.nodes)
        if self.r.srem(KEYS.drained, node) == 0:
            self.r.sadd(KEYS.drained, node)
        self.log.append(f"drain/undrain {node}")
        self.check(before, Steps())

    def an_undo(self) -> None:
        """The client left while the call that reserved its slots was on its way: its router takes it out of
        the queue and releases whatever it holds on every candidate."""
        req = self.rng.choice([q for q in self.requests.values() if q.state == "running"])
        if req.queued:
            before = self.view()
            steps = self.leave(req, req.gens > 1)
            req.state = "running"  # (its place in the queue was gone already)
            self.check(before, steps)
        # (checked once all are done: a release of nothing takes the request out of its tenant's in-flight
        # set while it still holds its slots on a node further down the list)
        before = self.view()
        for node in req.nodes:
            release = Release(req.rid, node, req.tenant, 0, False, QUEUE_LEASE)
            removed = self.api.run(self.api.store.release(release, self.now))
            self.log.append(f"undo {req.rid} on {node} -> {removed}")
            assert removed == (req.slots if node == req.node else 0), f"{req.rid} undone on {node}: {removed}"
        req.state = "done"
        self.check(before, Steps([("hand", req.node)], (req.node, req.slots)))

    def a_router_dying(self) -> None:
        """Its requests never call again: their leases run out."""
        live = [q for q in self.requests.values() if q.state in ("waiting", "running")]
        self.rng.choice(live).state = "dead"
        self.log.append("a router dies")

    def a_router_stalling(self) -> None:
        """A waiter's router stalls past its queue lease (or its clock runs behind) while the others' waiters
        re-check."""
        req = self.rng.choice([q for q in self.requests.values() if q.state == "waiting"])
        expiry = self.r.zscore(KEYS.queue, req.rid)
        if expiry is None:
            return
        self.settle(stalled=req)
        for q in self.requests.values():
            if q.state == "waiting" and q is not req:
                self.r.zadd(KEYS.queue, {q.rid: expiry + 1 + QUEUE_LEASE}, xx=True)
        self.now = max(self.now, int(expiry) + 1)
        req.stalled = True
        self.log.append(f"{req.rid}'s router stalls")

    def time_passing(self) -> None:
        """Past every lease: a dead router's requests lapse; live ones are renewed (and live waiters,
        re-checking meanwhile, find nothing: the pool has settled)."""
        self.settle()
        later = self.now + LEASE + 1_000
        for req in self.requests.values():
            if req.state == "running":
                self.renew(req, later)
            elif req.state == "waiting":
                self.r.zadd(KEYS.queue, {req.rid: later + QUEUE_LEASE}, xx=True)
            elif req.state == "dead":
                req.state = "done"
        self.now = later
        self.log.append("time passes")
        self.settle()

    # --- checks ---------------------------------------------------------------------------------------

    def check(self, before: View, steps: Steps) -> None:
        after = self.view()
        holders: dict[str, str] = {}
        for node in self.nodes:
            v = after.nodes[node]
            now_live, was_live = after.live(node), before.live(node)
            added = {m for ms in now_live.values() for m in ms} - {m for ms in was_live.values() for m in ms}
            if added:
                assert v.active(), f"{node} gained {sorted(added)}: cap={v.cap} {v.state} drained={v.drained}"
                total = sum(map(len, now_live.values()))
                assert total <= v.cap, f"{node} holds {total} reservations, over its capacity {v.cap}"
                used = after.used(node)
                assert not v.cells or used <= v.cells, f"{node} holds {used} tokens, over its {v.cells} cells"
            # each token record beside its request's reservations (pruned with them), expiring with them
            requests = {m.split("#")[0] for m in v.members}
            assert set(v.tokens) <= requests, f"{node} records tokens of {sorted(set(v.tokens) - requests)}"
            assert not v.tokens or v.tokens_ttl > 0, f"{node}'s tokens {v.tokens} never expire"
            assert all(t > 0 for t in v.tokens.values()), f"{node} records {v.tokens}"
            for rid, members in now_live.items():
                assert rid not in holders, f"{rid} holds slots on {holders[rid]} and on {node}"
                holders[rid] = node
                k = len(members)
                assert sorted(members) == sorted([rid, *(f"{rid}#{i}" for i in range(2, k + 1))]), (
                    f"{rid}'s members on {node}: {sorted(members)}")
                if added & set(members):
                    req = self.requests[rid]
                    assert set(members) <= added, f"{rid} added to the slots it held on {node}"
                    assert k == slots_needed(req.gens, v.slots), (
                        f"{rid} ({req.gens} generations) took {k} slots on {node} of slots={v.slots}")
                    assert v.could_hold(k, v.tokens_on(req.prompt, req.output), req.prompt), (
                        f"{rid} ({req.prompt} + {req.output} tokens) on {node}, which can never hold it")
        in_flight = after.in_flight()
        assert set(in_flight) == set(holders), f"in flight {sorted(in_flight)}, holding {sorted(holders)}"
        for rid, tenant in in_flight.items():
            assert self.requests[rid].tenant == tenant, f"{rid} in flight for {tenant}"
        for rid, req in self.requests.items():
            e = after.entries.get(rid)
            if req.state == "running":
                assert holders.get(rid) == req.node and len(after.live(req.node)[rid]) == req.slots, (
                    f"{rid} runs with {req.slots} slots on {req.node}, Redis: {holders.get(rid)}")
                recorded = after.nodes[req.node].tokens.get(rid, 0)
                assert recorded == req.tokens, f"{rid} runs with {req.tokens} tokens, Redis: {recorded}"
                assert e is None, f"{rid} runs and waits: {e}"
            elif req.state == "waiting" and not req.stalled:
                assert e is not None, f"{rid} waits with no queue entry"
            elif req.state == "done":
                assert rid not in holders and e is None, f"{rid} done, still holds {holders.get(rid)} / {e}"
            if e is not None and e.mark.startswith("g:"):
                node = e.mark[2:]
                assert holders.get(rid) == node, f"{rid} marked {e.mark} holds {holders.get(rid)}"
                if e.mark != getattr(before.entries.get(rid), "mark", ""):  # handed over by this call
                    stay = getattr(before.entries.get(rid), "stay", "")
                    assert stay in ("", node), f"{rid} waits for {stay}, yet was handed {node}'s slots"
                    t = before.nodes[node].tokens_on(e.prompt, e.output)
                    recorded = after.nodes[node].tokens.get(rid, 0)
                    assert recorded == t, f"{rid} was handed {recorded} tokens on {node}, needs {t}"
            elif e is not None:
                assert rid not in holders, f"{rid} waits ({e.mark or 'unmarked'}) and holds {holders[rid]}"
            if e is not None:
                assert e.passes <= MAX_PASSES, f"{rid} passed over for affinity {e.passes} times"
        waiting = [e for e in after.entries.values() if e.mark == ""]
        waited = sum(1 for e in before.entries.values() if e.mark == "")
        back = sum(1 for e in waiting if getattr(before.entries.get(e.rid), "mark", "").startswith("g:"))
        assert len(waiting) <= max(self.queue_size, waited + back), (
            f"{len(waiting)} waiting in a queue of {self.queue_size}")
        self.check_events(before, after, steps)
        self.check_hand_overs(before, after, steps)

    def events(self) -> list[str]:
        """The events published since the last call to this (up to a marker it publishes)."""
        self.syncs += 1
        marker = f"sync {self.syncs}"
        self.r.publish(KEYS.events, marker)
        out: list[str] = []
        for _ in range(10_000):
            message = self.pubsub.get_message(timeout=1)  # (None too for the subscription's confirmation)
            if message is not None and message["data"] == marker:
                return out
            if message is not None:
                out.append(message["data"])
        raise AssertionError("the events channel went silent")

    def check_events(self, before: View, after: View, steps: Steps) -> None:
        events = self.events()
        marked = {(e.rid, e.mark) for e in after.entries.values()
                  if e.mark and e.mark != getattr(before.entries.get(e.rid), "mark", "")}
        granted = [m.split(" ") for m in events if m.startswith("granted ")]
        told = {(rid, "g:" + node) for _, rid, node, _ in granted}
        told |= {(m.split(" ")[1], "shed") for m in events if m.startswith("shed ")}
        assert told == marked, f"events {events} for the waiters marked {sorted(marked)}"
        for _, rid, node, k in granted:
            handed = after.present(node, rid)
            assert int(k) == handed, f"{rid} was handed {handed} slots, told {k}"
        node, removed = steps.released
        if node:
            handed = sum(after.present(node, rid) for rid, mark in marked if mark == "g:" + node)
            freed = events.count(f"freed {node}")
            assert freed == max(removed - handed, 0), f"{freed} freed events on {node}: {events}"

    def check_hand_overs(self, before: View, after: View, steps: Steps) -> None:
        """Where a hand-over ran, it left nobody it could serve (unless a later step changed the queue)."""
        marked_on = {e.mark[2:] for e in after.entries.values()
                     if e.mark.startswith("g:") and e.mark != getattr(before.entries.get(e.rid), "mark", "")}
        last = {node: i for i, (kind, node) in enumerate(steps.steps) if kind == "hand"}
        for node, i in last.items():
            if any(kind == "reserve" or (n != node and n in marked_on) for kind, n in steps.steps[i + 1:]):
                continue
            chosen = after.pick(node)
            assert chosen is None, (
                f"after a hand-over on {node}, {after.free(node)} slots there are left to nobody while "
                f"{chosen} waits for them (queue there: {after.claimants(node)})")

    def check_no_jump(self, before: View, req: Request, direct: bool) -> None:
        """A request reserving by itself (not taking slots handed to it) took no slots held back for a waiter
        ahead of it (on the node that waiter waits on, whatever name it asked for), and left free slots on its
        candidates enough for the waiters ahead of it that could run on its node (those of its model: the
        scripts order each model's queue), and, where its node's cells bind, free cells enough for those of
        them that fit there. A bulky waiter (several generations, or tokens counted) that fits on none of
        them - counting no slots held back for one ahead of it - waits for one node to free, and is not
        counted among those taking slots."""
        if not direct or req.state != "running":
            return
        node, slots = req.node, before.nodes[req.node].slots
        me = before.entries.get(req.rid)
        mine = Entry(req.rid, req.priority, req.tenant, req.model, me.enq if me else before.now, "", "", 0,
                     req.excluded, req.gens, req.prompt, req.output, "")
        everyone = [e for e in before.entries.values()
                    if e.rid != req.rid and e.mark == "" and before.order(e) < before.order(mine)]
        for e in everyone:  # whatever name (or none) each asked for
            if (before.eligible(e, node) and e.bulky() and e.hold in ("", node)
                    and not before.fits(e, self.nodes)):
                raise AssertionError(f"{req.rid} took {req.slots} slots on {node} held back for {e}")
        ahead = [e for e in everyone if e.model == req.model and before.eligible(e, node)]
        held: set[str] = set()
        waiting_on = set()
        for e in sorted((e for e in everyone if e.bulky()), key=before.order):
            runs = [n for n in req.nodes if before.eligible(e, n)]
            if not before.fits(e, [n for n in runs if n not in held]):
                waiting_on.add(e.rid)
                waits_on = e.hold != "" and before.nodes[e.hold].active() and before.eligible(e, e.hold)
                held |= {e.hold} if waits_on else set(runs)  # (its node gone, or not known: at most all)
        wanted = sum(slots_needed(e.gens, slots) for e in ahead if e.rid not in waiting_on)
        left = sum(before.free(n) for n in req.nodes) - req.slots
        assert wanted <= left, f"{req.rid} took {node}'s slots, leaving {left} for {wanted} wanted by {ahead}"
        cells = before.nodes[node].cells
        if cells:
            sizes = [before.size(e, node) for e in ahead if e.rid not in waiting_on]
            tokens = sum(t for k, t in sizes if before.room(node, k, t))
            used = before.used(node)
            assert used + req.tokens + tokens <= cells, (
                f"{req.rid} took {req.tokens} of {node}'s {cells} cells ({used} used), leaving too few for "
                f"the {tokens} of {ahead}")

    def finish(self) -> None:
        """Every request released or gone, and time past every lease: nothing is held anywhere, and a
        script looking at a node prunes what lapsed there."""
        for req in self.requests.values():
            if req.state == "running":
                self.check(self.view(), self.release(req, True, False))
            elif req.state == "waiting":
                self.check(self.view(), self.leave(req, True))
        self.now += LEASE + QUEUE_LEASE + 1_000
        view = self.view()
        for node in self.nodes:
            assert not view.live(node) and view.used(node) == 0, f"{node} still holds {view.live(node)}"
            if view.nodes[node].active():  # a reservation there (then given back) prunes what lapsed
                probe = ReserveRequest(f"probe-{node}", [Candidate(node)], LEASE, model="")
                assert self.api.run(self.api.store.reserve(probe, self.now)).status == "reserved"
                self.api.run(self.api.store.release(Release(probe.request_id, node), self.now))
                left = self.r.hlen(KEYS.tokens(node)), self.r.zcard(KEYS.reservations(node))
                assert left == (0, 0), f"{node} keeps {left} token records and reservations"
            else:
                assert not view.nodes[node].tokens or view.nodes[node].tokens_ttl > 0


def run(url: str, seed: int, ops: int) -> None:
    fuzz = Fuzz(url, seed)
    try:
        for _ in range(ops):
            fuzz.step()
        fuzz.settle()
        fuzz.finish()
    except AssertionError as exc:
        trail = "\n".join(fuzz.log[-40:])
        raise AssertionError(f"seed {seed}: {exc}\nlast calls:\n{trail}") from None
    finally:
        fuzz.close()


@pytest.mark.parametrize("seed", range(SEEDS))
def test_random_calls_keep_the_admission_invariants(redis_url: str, seed: int) -> None:
    run(redis_url, seed, OPS)


@pytest.fixture(scope="module")
def cluster_url() -> Iterator[str]:
    with ClusterDeployment(primaries=3) as cluster:
        yield cluster.url


# redis-py's synchronous cluster client (this test's own view of Redis) can leave a socket to the garbage
# collector on a loaded machine; what this test checks is the scripts' invariants, not that client
SOCKET_LEFT_TO_GC = "ignore:Exception ignored in. <socket.socket:pytest.PytestUnraisableExceptionWarning"


@pytest.mark.filterwarnings(SOCKET_LEFT_TO_GC)
@pytest.mark.parametrize("seed", range(max(SEEDS // 4, 1)))
def test_the_admission_invariants_hold_on_a_three_primary_cluster(cluster_url: str, seed: int) -> None:
    """The same calls on Redis Cluster: every key of the pool shares the prefix's hash tag, so each script's
    keys live in one slot (a key in another slot fails the call with CROSSSLOT)."""
    run(cluster_url, seed, OPS)
