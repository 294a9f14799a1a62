"""What a waiter running several generations costs the pool, for two or more checkouts side by side (a
profiling aid, not part of the product).

A discrete-event run of the admission scripts on one embedded Redis-protocol server, in virtual time (the
scripts take the clock as an argument): NODES nodes of CAP slots; Poisson arrivals at LOAD times the pool's
capacity in slots per mean service time, a share PAIRS of them running two generations at once;
exponential service times (mean 10 s, whatever the generations); a queue of 64, a 30 s queue timeout; each
waiter re-checks every 0.5 s and wakes on ``granted`` and ``freed`` messages as a router does. Every
checkout runs the same seeded arrivals. Prints, per checkout, the pool's utilisation (busy slots over
capacity), the requests served, timed out and refused, and the median queue wait of singles and pairs.

    .venv/bin/python docs/profiles/held_back.py /tmp/old-checkout,. 3 4 1.1 0.25 3600

(NODES CAP LOAD PAIRS SECONDS)
"""

from __future__ import annotations

import heapq
import random
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from script_cost import contract_of

from macpool.redis_server import RedisServer

MEAN_S = 10.0
QUEUE_SIZE = 64
QUEUE_TIMEOUT_MS = 30_000
RECHECK_MS = 500
LEASE_MS = 10_000_000  # nothing expires in this run


@dataclass
class Request:
    rid: str
    gens: int
    arrival: int
    service_ms: int
    node: str = ""
    slots: int = 0
    waiting: bool = False


@dataclass
class Run:
    c: ModuleType
    r: redis.Redis
    prefix: str
    nodes: list[str]
    cap: int
    now: int = 0
    events: list[tuple[int, int, str, str]] = field(default_factory=list)
    requests: dict[str, Request] = field(default_factory=dict)
    waiters: list[str] = field(default_factory=list)  # in arrival order, as a router wakes them
    busy_integral: float = 0.0
    busy: int = 0
    last: int = 0
    served: int = 0
    timed_out: int = 0
    refused: int = 0
    waits: dict[int, list[float]] = field(default_factory=lambda: {1: [], 2: []})
    seq: int = 0

    def __post_init__(self) -> None:
        self.keys = self.c.Keys(self.prefix)
        self.reserve = self.r.register_script(self.c.RESERVE_OR_ENQUEUE)
        self.release_script = self.r.register_script(self.c.RELEASE)
        self.leave = self.r.register_script(self.c.LEAVE_QUEUE)
        self.pubsub = self.r.pubsub(ignore_subscribe_messages=True)
        self.pubsub.subscribe(self.keys.events)
        for node in self.nodes:
            self.r.hset(self.keys.node(node), mapping={"capacity": self.cap, "state": "ready", "models": "m",
                                                       "slots": self.cap})

    def at(self, when: int, kind: str, rid: str) -> None:
        self.seq += 1
        heapq.heappush(self.events, (when, self.seq, kind, rid))

    def advance(self, when: int) -> None:
        self.busy_integral += self.busy * (when - self.last)
        self.last = self.now = when

    def ask(self, req: Request, dequeue: bool) -> list[Any]:
        args = self.c.reserve_argv(self.keys, req.rid, LEASE_MS, [(n, 0.0) for n in self.nodes],
                                   queue_size=QUEUE_SIZE, enqueue=True, dequeue=dequeue, model="m",
                                   generations=req.gens, now=self.now)
        result: list[Any] = self.reserve(args=args)
        return result

    def attempt(self, req: Request, dequeue: bool) -> None:
        result = self.ask(req, dequeue)
        status = result[0]
        if status == "reserved":
            req.node, req.slots = result[1], int(result[4])
            self.busy += req.slots
            if req.waiting:
                req.waiting = False
                self.waiters.remove(req.rid)
                self.waits[req.gens].append((self.now - req.arrival) / 1000)
            self.at(self.now + req.service_ms, "done", req.rid)
        elif status == "queued" and not req.waiting:
            req.waiting = True
            self.waiters.append(req.rid)
            self.at(self.now + RECHECK_MS, "recheck", req.rid)
            self.at(req.arrival + QUEUE_TIMEOUT_MS, "timeout", req.rid)
        elif status == "queued":
            pass
        else:
            self.refused += 1
        self.messages()

    def messages(self) -> None:
        while (message := self.pubsub.get_message()) is not None:
            kind, _, rest = message["data"].partition(" ")
            if kind == "granted":
                req = self.requests.get(rest.split(" ")[0])
                if req is not None and req.waiting:
                    self.attempt(req, dequeue=True)
            elif kind == "freed":
                for rid in list(self.waiters):  # the first waiter, as a router wakes one per freed slot
                    self.attempt(self.requests[rid], dequeue=True)
                    break

    def handle(self, kind: str, rid: str) -> None:
        req = self.requests[rid]
        if kind == "arrive":
            self.attempt(req, dequeue=False)
        elif kind == "done":
            self.busy -= req.slots
            self.served += 1
            args = [self.keys.prefix, self.now, 3000, rid, req.node, "anonymous", "0", req.slots]
            self.release_script(args=args)
            self.messages()
        elif kind == "recheck" and req.waiting:
            self.attempt(req, dequeue=True)
            if req.waiting:
                self.at(self.now + RECHECK_MS, "recheck", rid)
        elif kind == "timeout" and req.waiting:
            req.waiting = False
            self.waiters.remove(rid)
            self.timed_out += 1
            nodes = self.nodes if req.gens > 1 else []
            self.leave(args=[self.keys.prefix, self.now, 3000, rid, *nodes])
            self.messages()


def run(c: ModuleType, r: redis.Redis, prefix: str, nodes: int, cap: int, load: float, pairs: float,
        seconds: int) -> Run:
    rng = random.Random(7)
    sim = Run(c, r, prefix, [f"n{i}" for i in range(nodes)], cap)
    slots_per_request = 1 + pairs
    rate = load * nodes * cap / MEAN_S / slots_per_request  # arrivals per second
    t, i = 0.0, 0
    while t < seconds:
        t += rng.expovariate(rate)
        gens = 2 if rng.random() < pairs else 1
        req = Request(f"r{i}", gens, int(t * 1000), int(rng.expovariate(1 / MEAN_S) * 1000) + 1)
        sim.requests[req.rid] = req
        sim.at(req.arrival, "arrive", req.rid)
        i += 1
    end = seconds * 1000
    while sim.events and sim.events[0][0] <= end:
        when, _, kind, rid = heapq.heappop(sim.events)
        sim.advance(when)
        sim.handle(kind, rid)
    sim.advance(end)
    return sim


def main() -> None:
    trees = sys.argv[1].split(",")
    nodes, cap, load, pairs, seconds = (int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]),
                                        float(sys.argv[5]), int(sys.argv[6]))
    with RedisServer() as server:
        r = redis.Redis.from_url(server.url, decode_responses=True)
        for k, tree in enumerate(trees):
            sim = run(contract_of(tree), r, f"t{k}:", nodes, cap, load, pairs, seconds)
            util = sim.busy_integral / (nodes * cap * seconds * 1000)
            med = {g: round(statistics.median(w), 2) if w else None for g, w in sim.waits.items()}
            print(f"{tree}: utilisation {util:.3f}; served {sim.served}, timed out {sim.timed_out}, refused "
                  f"{sim.refused}; median queue wait s: singles {med[1]}, pairs {med[2]}")


if __name__ == "__main__":
    main()
