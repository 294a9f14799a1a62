"""``macpool bench chaos``: five faults, one after another, on a pool under streaming load.

A primary Redis, a replica and three sentinels on loopback; ``--nodes`` simulators, each behind an agent (cap
``--cap``); two routers (``chaos-a``, ``chaos-b``), all on the ``redis+sentinel://`` URL. ``--clients``
closed-loop streaming clients (fewer than the pool's slots, so every refusal is a fault's) send to router A;
one more client streams through router B while B is the victim. The faults, each once, in this order:

1. an agent ``kill -9`` mid-stream, then restarted on its port;
2. a simulator (llama-server) frozen with SIGSTOP for ``--freeze`` seconds, then SIGCONT;
3. the Redis primary ``kill -9`` (Sentinel promotes the replica);
4. Redis restarted empty (the primary ``kill -9`` and started again at once, with no data);
5. router B ``kill -9`` with streams open.

For each: what the clients saw, by outcome (``ok``; ``503`` with Retry-After; ``sse_error``, a clean error
event; ``router_died``, router B's own client when B is killed; anything else is a failure); the time to
recover, from the start of the fault (the agent's 1 s down and the simulator's freeze included) until the
pool is whole again (router A reaches Redis and sees every node ready, its circuit closed; every node's
heartbeat is in Redis; for the router kill, no slot router B held is still counted); the most requests a
simulator ran at once beyond its agent's cap (must be 0); and, the load stopped, the reservations and queue
entries left in Redis after 10 s (must be 0). Exit status 1 when a check fails. Bounded: about two minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import redis
from redis.sentinel import Sentinel

from macpool.bench.sse import Events
from macpool.contract import now_ms
from macpool.dev.redis_server import RedisServer, SentinelDeployment
from macpool.dev.stack import Proc, Stack
from macpool.store import Keys

AGENT_TOKEN = "chaos-agent-token"
PRESET = "m5max-128g-14b-q4"
CLEAN = {"ok", "503", "sse_error", "router_died"}
RECOVERY_LIMIT_S = 60.0
SETTLE_S = 10.0


@dataclass
class Options:
    nodes: int = 3
    cap: int = 2
    clients: int = 4
    speed: float = 20.0
    max_tokens: int = 400  # long enough that every fault finds streams open
    freeze_s: float = 3.0
    log_dir: Path | None = None


@dataclass
class FaultResult:
    fault: str
    outcomes: dict[str, int]
    recovery_s: float
    over_admission: int
    left: int

    @property
    def passed(self) -> bool:
        return set(self.outcomes) <= CLEAN and self.over_admission == 0 and self.left == 0


@dataclass
class Outcome:
    started: float
    kind: str


def stream_once(client: httpx.Client, model: str, max_tokens: int) -> str:
    """One streamed chat: ``ok``, ``503`` (with Retry-After), ``sse_error`` or what went wrong."""
    body = {"model": model, "stream": True, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "tell me about unified memory"}]}
    try:
        with client.stream("POST", "/v1/chat/completions", json=body) as reply:
            if reply.status_code == 503:
                return "503" if reply.headers.get("retry-after") else "503 without Retry-After"
            if reply.status_code != 200:
                return f"http {reply.status_code}"
            events = Events(reply)
            errors = sum("error" in event for event in events)
    except httpx.HTTPError as exc:
        return f"transport {type(exc).__name__}"
    except ValueError:
        return "bad_json"
    if errors:
        return "sse_error"
    return "ok" if events.done else "truncated"


class Load:
    """Closed-loop streaming clients on one router until stopped; ``outcomes`` in start order."""

    def __init__(self, url: str, model: str, clients: int, max_tokens: int, victim: bool = False) -> None:
        self.outcomes: list[Outcome] = []
        self.victim = victim  # its router is about to be killed: its clients stop at their first failure
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(url, model, max_tokens), daemon=True)
                         for _ in range(clients)]

    def _run(self, url: str, model: str, max_tokens: int) -> None:
        with httpx.Client(base_url=url, timeout=60) as client:
            while not self._stop.is_set():
                started = time.monotonic()
                kind = stream_once(client, model, max_tokens)
                if self.victim and kind not in ("ok", "503"):
                    self.outcomes.append(Outcome(started, "router_died"))
                    return
                self.outcomes.append(Outcome(started, kind))

    def start(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)


class Chaos:
    """The pool, its Redis deployment and the faults."""

    def __init__(self, options: Options, logs: Path) -> None:
        self.options = options
        self.keys = Keys()
        self.redis = SentinelDeployment(replicas=1, sentinels=3, down_after_ms=1000)
        self.stack = Stack(logs=logs, keep_logs=True)
        self.sims: list[Proc] = []
        self.agents: list[Proc] = []
        self.routers: list[Proc] = []
        self.model = ""

    @property
    def node_ids(self) -> list[str]:
        return [f"chaos-{i}" for i in range(self.options.nodes)]

    def start(self) -> None:
        opts = self.options
        self.redis.start()
        for node_id in self.node_ids:
            sim = self.stack.sim(f"sim-{node_id}", "--preset", PRESET, "--parallel", str(opts.cap * 2),
                                 "--speed", str(opts.speed))
            self.sims.append(sim)
            self.agents.append(self.start_agent(node_id, sim))
        for name in ("a", "b"):
            self.routers.append(self.stack.router(
                f"router-{name}", self.redis.url, "--router-id", f"chaos-{name}",
                "--agent-token", AGENT_TOKEN, "--queue-size", "8", "--queue-timeout", "3",
                "--stale-after", "2", "--refresh-interval", "0.5", "--circuit-cooldown", "1",
            ))
        for router in self.routers:
            self.stack.wait_nodes(router.url, opts.nodes, timeout=60)
        self.model = httpx.get(self.routers[0].url + "/v1/models", timeout=10).json()["data"][0]["id"]

    def start_agent(self, node_id: str, sim: Proc, port: int | None = None) -> Proc:
        return self.stack.agent(f"agent-{node_id}", sim.url, self.redis.url, node_id, "--cap",
                                str(self.options.cap), "--token", AGENT_TOKEN, "--heartbeat-interval", "0.5",
                                port=port)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.stack.stop()
        self.redis.close()

    # --- what the pool looks like -------------------------------------------------------------------

    def store(self) -> redis.Redis:
        sentinel = Sentinel([("127.0.0.1", s.port) for s in self.redis.sentinels], socket_timeout=2)
        client: redis.Redis = sentinel.master_for(self.redis.service, socket_timeout=2)
        return client

    def held(self, prefix: str = "") -> int:
        """Live reservations (those of requests ``prefix`` names, when given) and queue entries in Redis."""
        now = now_ms()
        with self.store() as store:
            count = 0
            for node_id in self.node_ids:
                members = store.zrangebyscore(self.keys.reservations(node_id), now, "+inf")
                count += sum(1 for m in members if m.decode().startswith(prefix))
            if not prefix:
                count += int(store.zcount(self.keys.queue, now, "+inf"))
            return count

    def whole(self) -> bool:
        """Router A reaches Redis and sees every node ready with its circuit closed, and every node's
        heartbeat is in Redis (after Redis lost its data, the agents have registered again)."""
        try:
            doc = httpx.get(self.routers[0].url + "/api/pool", timeout=2).json()
            with self.store() as store:
                registered = all(store.exists(self.keys.node(n)) for n in self.node_ids)
        except (httpx.HTTPError, ValueError, redis.RedisError):
            return False
        ready = [n for n in doc["nodes"] if n["state"] == "ready" and n["circuit"] == "closed"]
        return bool(doc["redis_ok"]) and registered and len(ready) == self.options.nodes

    def over_cap(self) -> int:
        """The most requests any simulator ran at once beyond its agent's cap, since the last reset."""
        worst = 0
        for sim in self.sims:
            stats = httpx.get(sim.url + "/sim/stats", timeout=10).json()
            worst = max(worst, int(stats["max_concurrent"]) - self.options.cap)
        return worst

    def reset_sims(self) -> None:
        for sim in self.sims:
            httpx.post(sim.url + "/sim/reset", timeout=10)

    # --- the faults ---------------------------------------------------------------------------------

    def agent_killed(self) -> Callable[[], bool]:
        agent = self.agents[0]
        agent.child.kill()
        time.sleep(1.0)  # out of the pool: its streams end, the routers see it gone
        self.agents[0] = self.start_agent(self.node_ids[0], self.sims[0], port=agent.port)
        return self.whole

    def simulator_frozen(self) -> Callable[[], bool]:
        sim = self.sims[1 % len(self.sims)]
        sim.child.signal(signal.SIGSTOP)
        time.sleep(self.options.freeze_s)
        sim.child.signal(signal.SIGCONT)
        return self.whole

    def primary_killed(self) -> Callable[[], bool]:
        old = self.redis.primary_port()
        self.redis.server_on(old).kill()

        def promoted() -> bool:
            with contextlib.suppress(Exception):
                return self.redis.primary_port() != old and self.whole()
            return False

        return promoted

    def redis_restarted_empty(self) -> Callable[[], bool]:
        port = self.redis.primary_port()
        server = self.redis.server_on(port)
        server.kill()
        server.close()
        fresh = RedisServer(port=port).start()  # no data, before the sentinels call it down
        servers = self.redis.replicas if server in self.redis.replicas else None
        if servers is not None:
            servers[servers.index(server)] = fresh
        else:
            self.redis.primary = fresh
        return self.whole

    def router_killed(self) -> Callable[[], bool]:
        self.routers[1].child.kill()
        return lambda: self.held("chaos-b:") == 0 and self.whole()

    # --- one fault under load -----------------------------------------------------------------------

    def run(self, name: str, fault: Callable[[], Callable[[], bool]], victim_b: bool = False) -> FaultResult:
        opts = self.options
        self.reset_sims()
        load = Load(self.routers[0].url, self.model, opts.clients, opts.max_tokens).start()
        on_b = Load(self.routers[1].url, self.model, 1, opts.max_tokens * 10, victim=True).start() \
            if victim_b else None
        time.sleep(2.0)  # under load, streams open
        began = time.monotonic()
        recovered = fault()
        deadline = began + RECOVERY_LIMIT_S
        while not recovered() and time.monotonic() < deadline:
            time.sleep(0.1)
        recovery = time.monotonic() - began
        time.sleep(2.0)  # serving on the recovered pool
        load.stop()
        outcomes = load.outcomes
        if on_b is not None:
            on_b.stop()
            outcomes = outcomes + on_b.outcomes
        deadline = time.monotonic() + SETTLE_S
        while (left := self.held()) and time.monotonic() < deadline:
            time.sleep(0.2)
        counts = Counter(o.kind for o in outcomes if o.started >= began - 2.0)
        return FaultResult(name, dict(counts), round(recovery, 1), self.over_cap(), left)


def table(results: list[FaultResult]) -> str:
    lines = ["| fault | clients saw | recovered in | over cap | slots/queue left |", "|---|---|---|---|---|"]
    for r in results:
        seen = ", ".join(f"{k} {v}" for k, v in sorted(r.outcomes.items()))
        lines.append(f"| {r.fault} | {seen} | {r.recovery_s:.1f} s | {r.over_admission} | {r.left} |")
    return "\n".join(lines)


def run(options: Options) -> list[FaultResult]:
    logs = options.log_dir or Path(tempfile.mkdtemp(prefix="macpool-chaos-"))
    chaos = Chaos(options, logs)
    try:
        chaos.start()
        plan: list[tuple[str, Callable[[], Callable[[], bool]], bool]] = [
            ("agent kill -9 mid-stream, restarted", chaos.agent_killed, False),
            (f"simulator SIGSTOP {options.freeze_s:g} s, SIGCONT", chaos.simulator_frozen, False),
            ("Redis primary kill -9 (Sentinel)", chaos.primary_killed, False),
            ("Redis restarted empty", chaos.redis_restarted_empty, False),
            ("router kill -9 with streams open", chaos.router_killed, True),
        ]
        results = []
        for name, fault, victim_b in plan:
            result = chaos.run(name, fault, victim_b)
            print(f"{name}: {result.outcomes}, recovered in {result.recovery_s:.1f} s, over cap "
                  f"{result.over_admission}, left {result.left}", flush=True)
            results.append(result)
        return results
    finally:
        chaos.close()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="macpool bench chaos", description=__doc__.split("\n\n")[0])
    defaults = Options()
    p.add_argument("--nodes", type=int, default=defaults.nodes)
    p.add_argument("--cap", type=int, default=defaults.cap, help="each agent's cap")
    p.add_argument("--clients", type=int, default=defaults.clients, help="streaming clients on router A")
    p.add_argument("--speed", type=float, default=defaults.speed, help="simulator speed-up")
    p.add_argument("--max-tokens", type=int, default=defaults.max_tokens)
    p.add_argument("--freeze", type=float, default=defaults.freeze_s, help="seconds a simulator is stopped")
    p.add_argument("--log-dir", type=Path, help="keep the processes' logs here")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    options = Options(args.nodes, args.cap, args.clients, args.speed, args.max_tokens, args.freeze,
                      args.log_dir)
    if options.clients >= options.nodes * options.cap:
        p.error("--clients must stay below the pool's slots (--nodes x --cap): a refusal is then a fault's")
    results = run(options)
    print()
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2) + "\n")
    failed = [r.fault for r in results if not r.passed]
    if failed:
        print(f"FAILED: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


