"""``macpool bench relay``: how many SSE chunks and short requests one router process (one core) relays.

One router, pinned with ``taskset`` to one core, in front of one fast upstream node (``upstream``'s
``FastUpstream``: the router is what is measured, not a simulated Mac). The load client and the upstream run
on another core. Two phases:

- streaming: ``--streams`` endless SSE streams, one event per upstream write every ``--interval-ms``;
  chunks relayed per second of wall time and per second of router CPU, and how coalesced they arrived;
- requests: ``--concurrency`` closed-loop clients sending short non-streaming completions; requests/s and
  router CPU seconds per 1,000 requests.

Keys: ``chunks_per_s`` (SSE events relayed per router-core second), ``requests_per_s``, ``cpu_s_per_1000``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any

import httpx

from macpool import upstream as upstream_http
from macpool.bench.cpu import core_plan, cpu_seconds, pin_self
from macpool.bench.loadclient import closed_loop, measured_chat_load
from macpool.bench.report import dump
from macpool.bench.sse import EventCounter
from macpool.bench.stack import Stack
from macpool.bench.stats import ms, pct
from macpool.bench.upstream import UpstreamConfig
from macpool.bench.wire import Post, chat_json
from macpool.dev.stack import wait_nodes

TARGET_CHUNKS_PER_S = 20_000


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="macpool bench relay", description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=64, help="concurrent endless SSE streams")
    p.add_argument("--interval-ms", type=float, default=4.0, help="pause between two events of one stream")
    p.add_argument("--concurrency", type=int, default=32, help="clients in the non-streaming phase")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds before each measurement window")
    p.add_argument("--duration", type=float, default=8.0, help="seconds of each measurement window")
    p.add_argument("--router-arg", action="append", default=[], help="extra router flag (repeatable)")
    p.add_argument(
        "--compare-transports",
        action="store_true",
        help="also measure httpx transports (default, httpx-aiohttp) as an upstream client",
    )
    p.add_argument("--json", type=Path, help="write the result here")
    return p


async def measure_streams(
    port: int, pid: int, streams: int, warmup: float, duration: float
) -> dict[str, Any]:
    tally = [0, 0]
    post = Post("/v1/chat/completions", chat_json(stream=True))
    load = asyncio.create_task(closed_loop(port, lambda _: post, streams, tally=tally))
    try:
        await asyncio.sleep(warmup)
        events0, reads0, t0 = tally[0], tally[1], time.perf_counter()
        cpu0, own0 = cpu_seconds(pid), time.process_time()
        await asyncio.sleep(duration)
        events, reads = tally[0] - events0, tally[1] - reads0
        cpu, own, wall = cpu_seconds(pid) - cpu0, time.process_time() - own0, time.perf_counter() - t0
    finally:
        load.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await load
    return {
        "streams": streams,
        "chunks": events,
        "chunks_per_s_wall": round(events / wall, 1),
        "chunks_per_cpu_s": round(events / cpu, 1) if cpu > 0 else None,
        "router_cpu_util": round(cpu / wall, 3),
        "chunks_per_client_read": round(events / reads, 2) if reads else None,
        "client_chunks_per_cpu_s": round(events / own, 1) if own > 0 else None,
        "client_cpu_util": round(own / wall, 3),
    }


async def measure_requests(
    port: int, pid: int, concurrency: int, warmup: float, duration: float
) -> dict[str, Any]:
    window = await measured_chat_load(port, pid, False, concurrency, warmup, duration)
    ok = [r for r in window.records if r.status == 200]
    latencies = [r.latency_s for r in ok]
    cpu, wall = window.server_cpu_s, window.wall_s
    return {
        "concurrency": concurrency,
        "requests": len(window.records),
        "ok": len(ok),
        "errors": len(window.records) - len(ok),
        "requests_per_s": round(len(ok) / wall, 1),
        "router_cpu_util": round(cpu / wall, 3),
        "cpu_s_per_1000": round(cpu / len(ok) * 1000, 3) if ok else None,
        "latency_p50_ms": ms(pct(latencies, 50)),
        "latency_p99_ms": ms(pct(latencies, 99)),
        "client_cpu_ms_per_request": round(window.client_cpu_s / len(ok) * 1000, 3) if ok else None,
        "client_cpu_util": round(window.client_cpu_s / wall, 3),
    }


async def transport_cost(
    url: str, transport: str, streams: int, requests: int, duration: float
) -> dict[str, Any]:
    """CPU this process spends per relayed chunk and per short request through one upstream client: an httpx
    transport, or macpool's own relay call (``Upstream.send``, macpool/upstream.py)."""
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=512)
    if transport == "aiohttp":
        from httpx_aiohttp import AiohttpTransport

        client = httpx.AsyncClient(transport=AiohttpTransport(limits=limits), timeout=60.0)
    else:
        client = httpx.AsyncClient(limits=limits, timeout=60.0)
    direct = upstream_http.Upstream(30.0, max_connections=4096)
    timeouts = upstream_http.timeouts(connect=60.0, read=None)
    stream_body, short_body = chat_json(stream=True), chat_json(stream=False)
    path = url + "/n0/v1/chat/completions"
    parsed = upstream_http.url(path)
    chunks = [0]
    stop = asyncio.Event()

    async def one_stream() -> None:
        counter = EventCounter()  # a transport may hand over several events at once
        if transport == "upstream.send":
            answer = await direct.send("POST", parsed, [], stream_body, timeouts)
            try:
                async for part in upstream_http.chunks(answer):
                    chunks[0] += counter.feed(part)
                    if stop.is_set():
                        return
            finally:
                upstream_http.close(answer)
            return
        async with client.stream("POST", path, content=stream_body) as response:
            async for part in response.aiter_raw():
                chunks[0] += counter.feed(part)
                if stop.is_set():
                    return

    async def short(n: int) -> None:
        for _ in range(n):
            if transport == "upstream.send":
                await upstream_http.read(await direct.send("POST", parsed, [], short_body, timeouts))
                continue
            response = await client.post(path, content=short_body)
            await response.aread()

    async with client, contextlib.aclosing(direct):
        tasks = [asyncio.create_task(one_stream()) for _ in range(streams)]
        await asyncio.sleep(1.0)
        c0, cpu0, t0 = chunks[0], time.process_time(), time.perf_counter()
        await asyncio.sleep(duration)
        n_chunks, stream_cpu, wall = chunks[0] - c0, time.process_time() - cpu0, time.perf_counter() - t0
        stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await short(10)
        cpu0 = time.process_time()
        await asyncio.gather(*(short(requests // 16) for _ in range(16)))
        request_cpu = time.process_time() - cpu0
    return {
        "chunks_per_cpu_s": round(n_chunks / stream_cpu, 1) if stream_cpu else None,
        "chunks_per_s_wall": round(n_chunks / wall, 1),
        "cpu_ms_per_request": round(request_cpu / (requests // 16 * 16) * 1000, 3),
    }


def compare_transports(args: argparse.Namespace) -> dict[str, Any]:
    """httpx's default transport (httpcore + h11), httpx-aiohttp's, and the relays' direct call on aiohttp
    (``Upstream.send``), each as the upstream client of one process."""
    _, other_cpu = core_plan()
    config = UpstreamConfig(events=10**9, interval_s=args.interval_ms / 1000.0, nodes=1)
    out: dict[str, Any] = {}
    with Stack() as stack:
        upstream = stack.upstream("upstream", config, cpu=other_cpu)
        for transport in ("httpcore", "aiohttp", "upstream.send"):
            try:
                import uvloop

                out[transport] = uvloop.run(
                    transport_cost(upstream.url, transport, args.streams, 2000, args.duration)
                )
            except ImportError as exc:
                out[transport] = {"error": f"not installed: {exc.name}"}
    return out


def upstream_drain(url: str, timeout: float = 15.0) -> dict[str, Any]:
    """After the clients went away: how long until the router closed every upstream stream."""
    started = time.perf_counter()
    left = -1
    while time.perf_counter() - started < timeout:
        left = int(httpx.get(url + "/stats", timeout=5).json()["nodes"].get("n", {}).get("in_flight", 0))
        if left == 0:
            break
        time.sleep(0.1)
    return {
        "upstream_streams_left_after_disconnect": left,
        "upstream_close_s": round(time.perf_counter() - started, 2),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    router_cpu, other_cpu = core_plan()
    pin_self(other_cpu)
    config = UpstreamConfig(events=10**9, interval_s=args.interval_ms / 1000.0, nodes=1)
    with Stack() as stack:  # one fresh stack per phase: nothing left over from the other phase
        redis_url = stack.start_redis()
        upstream = stack.upstream("upstream", config, redis_url=redis_url, cpu=other_cpu)
        router = stack.router("router", redis_url, "--queue-size", "0", *args.router_arg, cpu=router_cpu)
        wait_nodes(router.url, 1)
        streaming = asyncio.run(
            measure_streams(router.port, router.pid, args.streams, args.warmup, args.duration)
        )
        streaming.update(upstream_drain(upstream.url))
    with Stack() as stack:
        redis_url = stack.start_redis()
        stack.upstream("upstream", config, redis_url=redis_url, cpu=other_cpu)
        router = stack.router("router", redis_url, "--queue-size", "0", *args.router_arg, cpu=router_cpu)
        wait_nodes(router.url, 1)
        requests = asyncio.run(
            measure_requests(router.port, router.pid, args.concurrency, args.warmup, args.duration)
        )
    chunks_per_s = streaming["chunks_per_cpu_s"]
    extra = {"transports": compare_transports(args)} if args.compare_transports else {}
    return {
        **extra,
        "bench": "relay",
        "router_core": router_cpu,
        "chunks_per_s": chunks_per_s,
        "requests_per_s": requests["requests_per_s"],
        "cpu_s_per_1000": requests["cpu_s_per_1000"],
        "streaming": streaming,
        "non_streaming": requests,
        "target_chunks_per_s": TARGET_CHUNKS_PER_S,
        "chunks_target_met": bool(chunks_per_s and chunks_per_s >= TARGET_CHUNKS_PER_S),
        "notes": "chunks_per_s = SSE events relayed per second of router CPU (one core fully used); "
        "chunks_per_s_wall is the rate achieved at router_cpu_util",
    }


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    dump(run(args), args.json)
    return 0
