"""``macpool bench overhead``: what the router (and the agent) add to TTFT and latency.

One simulator at high speed on a roomy machine (so the proxies are what is measured), and three paths to it,
measured at each concurrency level with the same closed-loop streaming client, taking turns over
``--rounds`` (the order reversed every other round; percentiles over all rounds' requests):

- ``direct``: client -> simulator;
- ``routed``: client -> router -> agent -> simulator (the real deployment path);
- ``router_only``: client -> a second router -> simulator (the simulator registered as a node by the bench),
  to split the added time between the router and the agent.

Per level: TTFT (first SSE event) and latency p50/p99 for each path, and ``ttft_added_p50_ms`` /
``ttft_added_p99_ms`` (routed minus direct), plus the same for ``router_only``; each round's routed-minus-
direct p50 in ``rounds_ttft_added_p50_ms``; and the router's and agent's CPU ms per request over the
measured windows.

``--upstream paced`` puts the bench's fast SSE upstream (``upstream.py``) where the simulator was: its
first event leaves at once and each stream then sends ``--max-tokens`` events ``--interval-ms`` apart, the
pace of a real Mac's stream. The closed loop then holds that many streams open without saturating the proxies:
what the router and agent add to a new request while they relay the others. The issue's target is judged on
the simulator run only (``target_met`` is null for a paced run).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import threading
from pathlib import Path
from typing import Any

from redis.asyncio import Redis as AsyncRedis

from macpool.bench.cpu import cpu_seconds
from macpool.bench.loadclient import Rec, closed_loop, summarize
from macpool.bench.report import dump
from macpool.bench.stack import Stack, write_machine
from macpool.bench.stats import take_turns
from macpool.bench.upstream import UpstreamConfig
from macpool.bench.wire import MODEL, Post, chat_json
from macpool.contract import NodeDoc, heartbeat_ttl_ms, now_ms
from macpool.dev.stack import Proc, wait_nodes
from macpool.store import Keys, Store

LEVELS = [1, 16, 64, 256]
TARGET_P50_MS = 1.0
TARGET_P99_MS = 5.0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="macpool bench overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--levels", default=",".join(map(str, LEVELS)), help="comma-separated concurrency levels")
    p.add_argument("--duration", type=float, default=4.0,
                   help="measured seconds per path and level (over all rounds)")
    p.add_argument("--warmup", type=float, default=1.0, help="seconds before each measurement")
    p.add_argument("--rounds", type=int, default=3,
                   help="the paths take turns this many times per level (the order reversed every other "
                        "round), so a drift of the machine during the run falls on all of them alike")
    p.add_argument(
        "--upstream",
        choices=("sim", "paced"),
        default="sim",
        help="sim: the simulator at --speed; paced: an upstream streaming one event per --interval-ms",
    )
    p.add_argument("--speed", type=float, default=1000.0, help="simulator speed")
    p.add_argument("--interval-ms", type=float, default=20.0, help="paced upstream: ms between events")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--no-router-only", action="store_true", help="skip the router -> simulator path")
    p.add_argument("--json", type=Path)
    return p


class Heartbeats:
    """Writes one node's heartbeat every second from a thread (for a node with no agent)."""

    def __init__(self, redis_url: str, keys: Keys, doc: NodeDoc) -> None:
        self.redis_url = redis_url
        self.keys = keys
        self.doc = doc
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="bench-heartbeats", daemon=True)

    async def _beat(self, store: Store) -> None:
        await store.heartbeat(self.doc.model_copy(update={"updated_at_ms": now_ms()}), heartbeat_ttl_ms(1.0))

    async def _beats(self) -> None:
        redis = AsyncRedis.from_url(self.redis_url)
        store = Store(redis, self.keys)
        try:
            while not self.stop.is_set():
                with contextlib.suppress(Exception):
                    await self._beat(store)
                await asyncio.to_thread(self.stop.wait, 1.0)
        finally:
            await redis.aclose()

    def _run(self) -> None:
        asyncio.run(self._beats())

    def __enter__(self) -> Heartbeats:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(5)


def measure(
    port: int, path: str, concurrency: int, seconds: float, args: argparse.Namespace, pids: dict[str, int]
) -> tuple[list[Rec], dict[str, float]]:
    """One closed-loop run of ``seconds`` after the warm-up: its records, and the CPU seconds each of ``pids``
    spent over the measured window."""
    serial = itertools.count()

    def make(client: int) -> Post:
        salt = f"c{client}-r{next(serial)}"
        return Post(path, chat_json(True, args.max_tokens, args.prompt_tokens, salt))

    # paced streams all last about as long: start them spread over one stream's length (and measure after)
    stagger = args.max_tokens * args.interval_ms / 1000.0 if args.upstream == "paced" else 0.0
    warmup = args.warmup + stagger

    async def go() -> tuple[list[Rec], dict[str, float]]:
        load = asyncio.create_task(
            closed_loop(port, make, concurrency, duration_s=seconds, warmup_s=warmup, stagger_s=stagger)
        )
        await asyncio.sleep(warmup)
        cpu0 = {name: cpu_seconds(pid) for name, pid in pids.items()}
        records = await load
        return records, {name: cpu_seconds(pid) - cpu0[name] for name, pid in pids.items()}

    try:
        import uvloop

        return uvloop.run(go())
    except ImportError:
        return asyncio.run(go())


def pooled(runs: list[tuple[list[Rec], dict[str, float]]]) -> dict[str, Any]:
    """One path's rounds together: percentiles over all their requests, CPU ms per request over all."""
    result = summarize([rec for records, _ in runs for rec in records])
    if result["ok"]:
        for name in runs[0][1]:
            spent = sum(cpu[name] for _, cpu in runs)
            result[f"{name}_cpu_ms_per_request"] = round(spent / result["ok"] * 1000.0, 3)
    return result


def measure_level(
    paths: dict[str, tuple[int, str, dict[str, int]]], level: int, args: argparse.Namespace
) -> dict[str, Any]:
    """Every path at ``level`` streams, taking turns over ``args.rounds`` rounds (``take_turns``)."""
    seconds = args.duration / max(args.rounds, 1)

    def one(name: str) -> tuple[list[Rec], dict[str, float]]:
        port, path, pids = paths[name]
        return measure(port, path, level, seconds, args, pids)

    turns = take_turns(list(paths), args.rounds, one)
    row: dict[str, Any] = {name: pooled([got[name] for got in turns]) for name in paths}
    row["rounds_ttft_added_p50_ms"] = [
        _diff(summarize(got["routed"][0])["ttft_p50_ms"], summarize(got["direct"][0])["ttft_p50_ms"])
        for got in turns
    ]
    return row


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a - b, 3)


def run(args: argparse.Namespace) -> dict[str, Any]:
    levels = [int(x) for x in args.levels.split(",") if x]
    parallel = max(levels) + 8
    with Stack() as stack:
        redis_url = stack.start_redis()
        sim = node_upstream(stack, args, parallel)
        agent = stack.agent("agent", sim.url, redis_url, "bench-agent-node", cap=parallel)
        router = stack.router("router", redis_url, "--queue-size", "0")
        wait_nodes(router.url, 1)
        paths: dict[str, tuple[int, str, dict[str, int]]] = {
            "direct": (sim.port, "/v1/chat/completions", {}),
            "routed": (router.port, "/v1/chat/completions", {"router": router.pid, "agent": agent.pid}),
        }
        beats: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        if not args.no_router_only:
            keys = Keys("bench-direct:")
            doc = NodeDoc(
                node_id="bench-sim-direct",
                url=sim.url,
                models=[MODEL],
                capacity=parallel,
                total_slots=parallel,
                state="ready",
                agent_version="bench",
            )
            beats = Heartbeats(redis_url, keys, doc)
        with beats:
            if not args.no_router_only:
                direct_router = stack.router(
                    "router-only", redis_url, "--queue-size", "0", "--key-prefix", "bench-direct:"
                )
                wait_nodes(direct_router.url, 1)
                paths["router_only"] = (
                    direct_router.port,
                    "/v1/chat/completions",
                    {"router": direct_router.pid},
                )
            out: dict[str, Any] = {}
            for level in levels:
                row = measure_level(paths, level, args)
                d, r = row["direct"], row["routed"]
                row["ttft_added_p50_ms"] = _diff(r["ttft_p50_ms"], d["ttft_p50_ms"])
                row["ttft_added_p99_ms"] = _diff(r["ttft_p99_ms"], d["ttft_p99_ms"])
                row["latency_added_p50_ms"] = _diff(r["latency_p50_ms"], d["latency_p50_ms"])
                row["latency_added_p99_ms"] = _diff(r["latency_p99_ms"], d["latency_p99_ms"])
                if "router_only" in row:
                    o = row["router_only"]
                    row["router_only_ttft_added_p50_ms"] = _diff(o["ttft_p50_ms"], d["ttft_p50_ms"])
                    row["router_only_ttft_added_p99_ms"] = _diff(o["ttft_p99_ms"], d["ttft_p99_ms"])
                out[str(level)] = row
                print(
                    json.dumps({"level": level, **{k: v for k, v in row.items() if "added" in k}}), flush=True
                )
    at64 = out.get("64", {})
    p50, p99 = at64.get("ttft_added_p50_ms"), at64.get("ttft_added_p99_ms")
    within = p50 is not None and p99 is not None and p50 <= TARGET_P50_MS and p99 <= TARGET_P99_MS
    paced = args.upstream == "paced"
    return {
        "bench": "overhead",
        "levels": out,
        "upstream": args.upstream,
        "max_tokens": args.max_tokens,
        "prompt_tokens": args.prompt_tokens,
        **({"interval_ms": args.interval_ms} if paced else {"sim_speed": args.speed}),
        "target": {"at": 64, "ttft_added_p50_ms": TARGET_P50_MS, "ttft_added_p99_ms": TARGET_P99_MS},
        "within_target_figures": within,
        "target_met": None if paced else within,
    }


def node_upstream(stack: Stack, args: argparse.Namespace, parallel: int) -> Proc:
    """The one node's upstream: the simulator at --speed, or the fast upstream paced at --interval-ms."""
    if args.upstream == "paced":
        config = UpstreamConfig(
            events=args.max_tokens, interval_s=args.interval_ms / 1000.0, events_from_body=True
        )
        return stack.upstream("paced-upstream", config)
    return stack.sim("sim", write_machine(stack.logs), parallel, args.speed)


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    dump(run(args), args.json)
    return 0
