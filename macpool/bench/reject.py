"""``macpool bench reject``: how many 503s one router process (one core) returns when the pool is full.

One router pinned to one core with ``--queue-size 0``, one fast upstream node of capacity 1 whose single slot
is held by a reservation written straight into Redis (a request that never ends), and ``--concurrency``
closed-loop clients on another core. Every answer should be 503 ``pool_full`` with ``Retry-After``.

Keys: ``rejections_per_s`` (per second of wall time with the router core busy), ``rejections_per_cpu_s``,
``reject_p50_ms``, ``reject_p99_ms``.

``--floor`` also measures, pinned to the same core under the same load, a bare ASGI app on uvicorn (uvloop,
httptools) that answers every POST with the router's 503: what uvicorn alone costs per rejection, the ceiling
for any router served by it.

``--client wrk`` sends the load with wrk (C, Debian package ``wrk``, installed by the command when missing)
instead of the bench's own Python client (aiohttp), which spends more CPU per request than the router spends
per refusal: with it the router stays below a full core (``measured.client_cpu_util`` says how busy the
client was) and the latencies are partly the client's own queue.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from redis.asyncio import Redis
from starlette.types import Receive, Scope, Send

from macpool.bench.cpu import core_plan, cpu_seconds, pin_self, pinned
from macpool.bench.installers import ensure_deb
from macpool.bench.loadclient import measured_chat_load
from macpool.bench.report import dump
from macpool.bench.stack import Stack
from macpool.bench.stats import ms, pct
from macpool.bench.upstream import UpstreamConfig
from macpool.bench.wire import chat_json
from macpool.dev.redis_server import free_port
from macpool.dev.stack import wait_nodes
from macpool.errors import error_body
from macpool.store import Candidate, ReserveRequest, Store

TARGET_REJECTIONS_PER_S = 5000
TARGET_P99_MS = 5.0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="macpool bench reject", description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--duration", type=float, default=8.0)
    p.add_argument("--router-arg", action="append", default=[], help="extra router flag (repeatable)")
    p.add_argument("--floor", action="store_true", help="also measure a bare uvicorn app answering the 503")
    p.add_argument("--client", choices=("raw", "wrk"), default="raw",
                   help="load client: the bench's Python one, or wrk (installed with apt-get if missing)")
    p.add_argument("--json", type=Path)
    return p


def fill(redis_url: str, node_id: str, lease_ms: int = 600_000) -> None:
    """Reserve the node's only slot through the router's own store (as a never-ending request would)."""

    async def reserve() -> None:
        redis = Redis.from_url(redis_url)
        try:
            holder = ReserveRequest("bench:holder", [Candidate(node_id)], lease_ms)
            result = await Store(redis).reserve(holder)
        finally:
            await redis.aclose()
        if result.status != "reserved":
            raise RuntimeError(f"could not fill {node_id}: {result}")

    asyncio.run(reserve())


async def measure(port: int, pid: int, concurrency: int, warmup: float, duration: float) -> dict[str, Any]:
    window = await measured_chat_load(port, pid, True, concurrency, warmup, duration)
    records, cpu, wall = window.records, window.server_cpu_s, window.wall_s
    rejected = [r for r in records if r.status == 503]
    latencies = [r.latency_s for r in rejected]
    reasons: dict[str, int] = {}
    for r in rejected:
        reasons[r.reason] = reasons.get(r.reason, 0) + 1
    return {
        "concurrency": concurrency,
        "requests": len(records),
        "rejected_503": len(rejected),
        "other_status": len(records) - len(rejected),
        "rejections_per_s": round(len(rejected) / wall, 1),
        "rejections_per_cpu_s": round(len(rejected) / cpu, 1) if cpu > 0 else None,
        "router_cpu_util": round(cpu / wall, 3),
        "reject_p50_ms": ms(pct(latencies, 50)),
        "reject_p99_ms": ms(pct(latencies, 99)),
        "retry_after_fraction": round(sum(r.retry_after for r in rejected) / len(rejected), 4)
        if rejected
        else 0,
        "reasons": reasons,
        "client_cpu_ms_per_request": round(window.client_cpu_s / len(records) * 1000, 3) if records else None,
        "client_cpu_util": round(window.client_cpu_s / wall, 3),
    }


# counts each answer's status in wrk's per-thread Lua state and prints one JSON line at the end
_WRK_SCRIPT = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = %s
local threads = {}
function setup(thread) table.insert(threads, thread) end
function init(args) n503 = 0; retry = 0; other = 0 end
function response(status, headers, body)
  if status == 503 then
    n503 = n503 + 1
    if headers["retry-after"] or headers["Retry-After"] then retry = retry + 1 end
  else
    other = other + 1
  end
end
function done(summary, latency, requests)
  local a, b, c = 0, 0, 0
  for _, t in ipairs(threads) do a = a + t:get("n503"); b = b + t:get("retry"); c = c + t:get("other") end
  local e = summary.errors
  io.write(string.format('{"requests": %%d, "duration_us": %%d, "n503": %%d, "retry_after": %%d, '
    .. '"other": %%d, "p50_us": %%d, "p99_us": %%d, "p999_us": %%d, "max_us": %%d, "socket_errors": %%d}\\n',
    summary.requests, summary.duration, a, b, c, latency:percentile(50), latency:percentile(99),
    latency:percentile(99.9), latency.max, e.connect + e.read + e.write + e.timeout))
end
"""


def wrk_measure(port: int, pid: int, args: argparse.Namespace, cpu: int | None) -> dict[str, Any]:
    """The same closed-loop load as ``measure``, sent by wrk (one thread, ``--concurrency`` connections)."""
    wrk = ensure_deb("wrk", "wrk", install=True)
    body = chat_json(stream=True).decode()
    with tempfile.NamedTemporaryFile("w", suffix=".lua") as script:
        script.write(_WRK_SCRIPT % json.dumps(body))
        script.flush()

        def run(seconds: float) -> tuple[dict[str, Any], float]:
            argv = [wrk, "-t1", f"-c{args.concurrency}", f"-d{max(1, round(seconds))}s", "-s", script.name,
                    f"http://127.0.0.1:{port}/v1/chat/completions"]
            cpu0 = cpu_seconds(pid)
            out = subprocess.run(pinned(argv, cpu), capture_output=True, text=True, check=True).stdout
            return json.loads(out.strip().splitlines()[-1]), cpu_seconds(pid) - cpu0

        run(args.warmup)
        stats, router_cpu = run(args.duration)
    wall = stats["duration_us"] / 1e6
    return {
        "client": "wrk",
        "concurrency": args.concurrency,
        "requests": stats["requests"],
        "rejected_503": stats["n503"],
        "other_status": stats["other"],
        "socket_errors": stats["socket_errors"],
        "rejections_per_s": round(stats["n503"] / wall, 1),
        "rejections_per_cpu_s": round(stats["n503"] / router_cpu, 1) if router_cpu > 0 else None,
        "router_cpu_util": round(router_cpu / wall, 3),
        # wrk's latencies are of every answer; all of them are 503s when other_status is 0
        "reject_p50_ms": stats["p50_us"] / 1000,
        "reject_p99_ms": stats["p99_us"] / 1000,
        "reject_p999_ms": stats["p999_us"] / 1000,
        "reject_max_ms": stats["max_us"] / 1000,
        "retry_after_fraction": round(stats["retry_after"] / stats["n503"], 4) if stats["n503"] else 0,
    }


_FLOOR_503 = error_body(503, "every node is full", "pool_full")


async def floor_app(scope: Scope, receive: Receive, send: Send) -> None:
    """Every POST answered with the router's 503 after reading the body; GET /health with 200."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    post = scope["method"] == "POST"
    body = _FLOOR_503 if post else b'{"status":"ok"}'
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    if post:
        headers += [(b"retry-after", b"1"), (b"x-macpool-reason", b"pool_full")]
    await send({"type": "http.response.start", "status": 503 if post else 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def serve_floor(port: int) -> None:
    import uvicorn

    uvicorn.run(floor_app, host="127.0.0.1", port=port, loop="uvloop", http="httptools",
                log_level="warning", access_log=False, server_header=False)


def floor(args: argparse.Namespace, cpu: int | None) -> dict[str, Any]:
    with Stack() as stack:
        port = free_port()
        argv = [sys.executable, "-c", f"from macpool.bench.reject import serve_floor; serve_floor({port})"]
        app = stack.spawn("floor", pinned(argv, cpu), port)
        return asyncio.run(measure(app.port, app.pid, args.concurrency, args.warmup, args.duration))


def run(args: argparse.Namespace) -> dict[str, Any]:
    router_cpu, other_cpu = core_plan()
    pin_self(other_cpu)
    with Stack() as stack:
        redis_url = stack.start_redis()
        config = UpstreamConfig(events=10, capacity=1, nodes=1)
        stack.upstream("upstream", config, redis_url=redis_url, prefix="full-", cpu=other_cpu)
        router = stack.router("router", redis_url, "--queue-size", "0", *args.router_arg, cpu=router_cpu)
        wait_nodes(router.url, 1)
        fill(redis_url, "full-0")
        if args.client == "wrk":
            result = wrk_measure(router.port, router.pid, args, other_cpu)
        else:
            load = measure(router.port, router.pid, args.concurrency, args.warmup, args.duration)
            result = asyncio.run(load)
    rate = result["rejections_per_cpu_s"]
    p99 = result["reject_p99_ms"]
    extra = {"floor_uvicorn": floor(args, router_cpu)} if args.floor else {}
    return {
        **extra,
        "bench": "reject",
        "router_core": router_cpu,
        "rejections_per_s": rate,
        "reject_p99_ms": p99,
        "measured": result,
        "target_rejections_per_s": TARGET_REJECTIONS_PER_S,
        "target_p99_ms": TARGET_P99_MS,
        "target_met": bool(
            rate and rate >= TARGET_REJECTIONS_PER_S and p99 is not None and p99 <= TARGET_P99_MS
        ),
        "notes": "rejections_per_s = 503s per second of router CPU (one core fully used); "
        "measured.rejections_per_s is the wall rate at measured.router_cpu_util",
    }


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    dump(run(args), args.json)
    return 0
