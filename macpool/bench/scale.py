"""``macpool bench scale``: 50 lightweight nodes and two router replicas on one Redis.

The nodes are one ``upstream`` fast upstream posing as ``--nodes`` nodes of ``--capacity`` slots each
(heartbeats included); every request holds its slot for ``--events`` x ``--interval-ms``. The upstream counts,
per node, every request that arrived while the node already held ``capacity`` requests: that is
over-admission, and it must be zero. Two routers share the Redis; the load is split evenly between them.

- ``admitted`` phase (half the pool's capacity): Redis commands per admitted request, from ``INFO
  commandstats`` deltas minus the background rate (heartbeats, pool refreshes) measured in an idle window;
  round trips = top-level commands (EVALSHA and any non-script command), not the commands Lua runs inside;
- ``overload`` phase (``--overload`` x capacity): over-admission (must be 0), rejections, and the largest
  reservation count seen in Redis per node;
- routing-decision time: the router's own ``Admission.acquire`` (pool view + the reservation script over
  every candidate) timed in-process against the same 50-node pool, and the script's server-side time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from redis import Redis

from macpool.bench.loadclient import closed_loop
from macpool.bench.report import dump
from macpool.bench.stack import Stack
from macpool.bench.stats import shares
from macpool.bench.upstream import UpstreamConfig
from macpool.bench.wire import Post, chat_json
from macpool.dev.stack import wait_nodes
from macpool.store import Keys
from macpool.store.scripts import source

# commands the store's Lua scripts run inside Redis (not round trips), read from the scripts themselves
SCRIPT_INNER = {
    name.lower()
    for script in map(source, ("reserve", "release", "renew", "leave", "heartbeat", "deregister"))
    for name in re.findall(r"redis\.p?call\(\s*['\"](\w+)['\"]", script)
}
# periodic, whatever the traffic: pool refreshes (the heartbeats are EVALSHA, as the admission scripts are:
# their rate is measured idle and subtracted)
BACKGROUND = {"multi", "exec", "hset", "zrange", "smembers", "zcount", "hget", "info", "ping"}
# once per new connection, not per request
CONNECTION_SETUP = {"hello", "client|setinfo", "script|exists", "script|load", "select", "client|setname"}
TARGET_ROUND_TRIPS = 2.0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="macpool bench scale", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=50)
    p.add_argument("--capacity", type=int, default=4, help="slots per node")
    p.add_argument("--events", type=int, default=5, help="SSE events per request")
    p.add_argument("--interval-ms", type=float, default=100.0, help="pause between events (slot hold time)")
    p.add_argument("--duration", type=float, default=8.0, help="seconds per phase")
    p.add_argument("--overload", type=float, default=2.0, help="overload phase: concurrency / capacity")
    p.add_argument("--hold-factor", type=int, default=10, help="overload phase: requests hold this x longer")
    p.add_argument("--decisions", type=int, default=2000, help="acquire+release pairs timed in-process")
    p.add_argument("--json", type=Path)
    return p


def commandstats(redis: Redis) -> dict[str, int]:
    stats = redis.info("commandstats")
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()}


def script_usec(redis: Redis) -> float | None:
    stats = redis.info("commandstats")
    for key in ("cmdstat_evalsha", "cmdstat_eval"):
        if key in stats:
            return float(stats[key]["usec_per_call"])
    return None


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


class ReservationWatch:
    """Polls every node's live reservation count; remembers the largest seen."""

    def __init__(self, redis_url: str, node_ids: list[str]) -> None:
        self.redis_url = redis_url
        self.node_ids = node_ids
        self.max_seen = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        keys = Keys()
        with Redis.from_url(self.redis_url) as redis:
            while not self.stop.is_set():
                now = int(time.time() * 1000)
                pipe = redis.pipeline(transaction=False)
                for node_id in self.node_ids:
                    pipe.zcount(keys.reservations(node_id), now, "+inf")
                counts = pipe.execute()
                self.max_seen = max([self.max_seen, *[int(c) for c in counts]])
                self.stop.wait(0.05)

    def __enter__(self) -> ReservationWatch:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(5)


async def drive(ports: list[int], concurrency: int, duration: float, events: int) -> list[Any]:
    post = Post("/v1/chat/completions", chat_json(stream=True, max_tokens=events))
    share = shares(concurrency, len(ports))
    results = await asyncio.gather(
        *(
            closed_loop(port, lambda _: post, n, duration_s=duration)
            for port, n in zip(ports, share, strict=True)
        )
    )
    return [rec for part in results for rec in part]


def decision_time(redis_url: str, count: int) -> dict[str, Any]:
    """Time the router's own admission code against the live pool, in a process of its own
    (``python -m router.timing``): the bench tooling imports no router code."""
    argv = [sys.executable, "-m", "router.timing", redis_url, str(count)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"router.timing failed: {done.stderr.strip()[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    capacity_total = args.nodes * args.capacity
    with Stack() as stack:
        redis_url = stack.start_redis()
        config = UpstreamConfig(
            events=args.events,
            interval_s=args.interval_ms / 1000.0,
            capacity=args.capacity,
            nodes=args.nodes,
            events_from_body=True,
        )
        upstream = stack.upstream("nodes", config, redis_url=redis_url, prefix="scale-")
        # a long lease keeps the periodic renewal pipeline (one round trip per router per lease/3, whatever
        # the traffic) out of the measured window
        routers = [
            stack.router(f"router-{i}", redis_url, "--queue-size", "32", "--lease-seconds", "600")
            for i in range(2)
        ]
        for router in routers:
            wait_nodes(router.url, args.nodes)
        ports = [r.port for r in routers]
        node_ids = [f"scale-{i}" for i in range(args.nodes)]
        redis = Redis.from_url(redis_url)
        try:
            # warm up (connection pools grow to the concurrency), measure the background command rate
            # (heartbeats, refreshes), then the admitted path at half capacity
            asyncio.run(drive(ports, max(2, capacity_total // 2), min(args.duration, 2.0), args.events))
            idle_s = min(args.duration, 4.0)
            before = commandstats(redis)
            time.sleep(idle_s)
            idle = delta(commandstats(redis), before)
            before = commandstats(redis)
            t0 = time.perf_counter()
            records = asyncio.run(drive(ports, max(2, capacity_total // 2), args.duration, args.events))
            load_s = time.perf_counter() - t0
            loaded = delta(commandstats(redis), before)
            admitted = sum(1 for r in records if r.status == 200)
            net = {k: loaded.get(k, 0) - idle.get(k, 0) * load_s / idle_s for k in set(loaded) | set(idle)}
            net.pop("info", None)
            per_admitted = {
                k: round(v / admitted, 3) for k, v in sorted(net.items()) if admitted and abs(v) >= 1
            }
            setup = sum(v for k, v in net.items() if k in CONNECTION_SETUP)
            # per-request round trips: top-level commands, minus the periodic background ones (heartbeats,
            # pool refreshes: subtracted above, but their rate drifts under load) - Lua's inner commands and
            # connection handshakes are not round trips
            skip = SCRIPT_INNER | CONNECTION_SETUP | BACKGROUND
            round_trips = sum(v for k, v in net.items() if k not in skip)
            round_trips_per_admitted = round(round_trips / admitted, 3) if admitted else None
            # overload: can anything push a node past its capacity?
            httpx.post(upstream.url + "/reset", timeout=5)
            with ReservationWatch(redis_url, node_ids) as watch:
                over = asyncio.run(
                    drive(
                        ports,
                        int(capacity_total * args.overload),
                        args.duration,
                        args.events * args.hold_factor,
                    )
                )
            stats = httpx.get(upstream.url + "/stats", timeout=5).json()
            if stats["over_capacity"]:
                stack.keep_logs = True
                print(f"over-admission seen: processes' logs kept in {stack.logs}", file=sys.stderr)
            decisions = decision_time(redis_url, args.decisions)
            decisions["script_server_usec_per_call"] = script_usec(redis)
        finally:
            redis.close()
    over_ok = sum(1 for r in over if r.status == 200)
    over_503 = sum(1 for r in over if r.status == 503)
    return {
        "bench": "scale",
        "nodes": args.nodes,
        "routers": 2,
        "capacity_per_node": args.capacity,
        "routing_decision": decisions,
        "admitted_phase": {
            "concurrency": max(2, capacity_total // 2),
            "admitted": admitted,
            "rejected": len(records) - admitted,
            "redis_round_trips_per_admitted": round_trips_per_admitted,
            "redis_commands_per_admitted": per_admitted,
            "connection_setup_commands": round(setup),
        },
        "redis_round_trips_per_admitted": round_trips_per_admitted,
        "overload_phase": {
            "concurrency": int(capacity_total * args.overload),
            "admitted": over_ok,
            "rejected_503": over_503,
            "other": len(over) - over_ok - over_503,
            "max_in_flight_per_node": stats["max_in_flight"],
            "over_capacity_arrivals": stats["over_capacity"],
            "max_reservations_seen_per_node": watch.max_seen,
        },
        "over_admission": stats["over_capacity"],
        "no_over_admission": stats["over_capacity"] == 0 and stats["max_in_flight"] <= args.capacity,
        "target_round_trips": TARGET_ROUND_TRIPS,
        "round_trips_target_met": bool(
            round_trips_per_admitted is not None and round_trips_per_admitted <= TARGET_ROUND_TRIPS
        ),
    }


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    dump(run(args), args.json)
    return 0
