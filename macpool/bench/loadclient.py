"""A closed-loop load client on aiohttp's ``ClientSession`` (keep-alive connections, no JSON parsing: SSE
events are counted, not read). It records status, time to the first body byte, latency and the number of SSE
events and body reads of every request. Its own CPU is reported beside the router's (``client_cpu_util``): a
router on a quiet machine refuses a request in less CPU than this client takes to send it
(docs/benchmarks.md, "The load client and the fast upstream").
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from macpool.bench.cpu import cpu_seconds
from macpool.bench.sse import EventCounter
from macpool.bench.stats import ms, pct
from macpool.bench.wire import LOOP, Post, chat_json


@dataclass
class Rec:
    status: int  # 0: connection failed
    latency_s: float
    ttft_s: float | None  # first body byte (of a stream: its first event)
    events: int = 0  # SSE events in the body
    reads: int = 0  # body pieces received: HTTP chunks of a chunked body (how coalesced the events arrived)
    retry_after: bool = False
    reason: str = ""


async def _send(session: aiohttp.ClientSession, post: Post, tally: list[int]) -> Rec:
    started = time.perf_counter()
    first: float | None = None
    events = reads = 0
    counter = EventCounter()
    async with session.post(post.path, data=post.body) as response:
        async for data, _ in response.content.iter_chunks():
            if not data:
                continue
            if first is None:
                first = time.perf_counter()
            found = counter.feed(data)
            events += found
            reads += 1
            tally[0] += found
            tally[1] += 1
    headers = response.headers
    return Rec(
        response.status,
        time.perf_counter() - started,
        None if first is None else first - started,
        events,
        reads,
        "Retry-After" in headers,
        headers.get("X-Macpool-Reason", ""),
    )


async def closed_loop(
    port: int,
    make_request: Callable[[int], Post],
    concurrency: int,
    duration_s: float | None = None,
    requests: int | None = None,
    host: str = LOOP,
    warmup_s: float = 0.0,
    tally: list[int] | None = None,
    request_timeout: float = 120.0,
    stagger_s: float = 0.0,
) -> list[Rec]:
    """``concurrency`` clients in a closed loop, each on a keep-alive connection while the server keeps it;
    records requests started after warm-up.

    ``tally`` (``[events, body reads]``) is incremented live, for callers that sample rates over a window.
    ``stagger_s`` spreads the clients' first requests evenly over that many seconds: streams of equal length
    started together would otherwise end together and arrive again as one burst, every time.
    """
    counts = tally if tally is not None else [0, 0]
    records: list[Rec] = []
    start = time.perf_counter()
    measure_from = start + warmup_s
    deadline = None if duration_s is None else measure_from + duration_s
    budget = [requests if requests is not None else -1]

    async def client(session: aiohttp.ClientSession, index: int) -> None:
        if stagger_s:
            await asyncio.sleep(stagger_s * index / concurrency)
        while True:
            now = time.perf_counter()
            if (deadline is not None and now >= deadline) or budget[0] == 0:
                return
            if budget[0] > 0:
                budget[0] -= 1
            try:
                async with asyncio.timeout(request_timeout):
                    rec = await _send(session, make_request(index), counts)
            except TimeoutError:
                rec = Rec(0, request_timeout, None)
            except aiohttp.ClientConnectorError:
                records.append(Rec(0, 0.0, None))
                await asyncio.sleep(0.01)
                continue
            except aiohttp.ClientError:
                rec = Rec(0, time.perf_counter() - now, None)
            if now >= measure_from:
                records.append(rec)

    # no limit on the pool: each client holds at most one connection, and gets it back for its next request
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        f"http://{host}:{port}",
        connector=connector,
        headers={"Content-Type": "application/json"},
        # Host, Content-Type and Content-Length only: the router forwards a request's headers, so every extra
        # one is work the bench would count as the router's
        skip_auto_headers=("Accept", "Accept-Encoding", "User-Agent"),
        timeout=aiohttp.ClientTimeout(total=None),  # request_timeout bounds each request
        auto_decompress=False,
    ) as session:
        await asyncio.gather(*(client(session, i) for i in range(concurrency)))
    return records


def summarize(records: list[Rec]) -> dict[str, Any]:
    ok = [r for r in records if r.status == 200]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    lat = [r.latency_s for r in ok]
    return {
        "requests": len(records),
        "ok": len(ok),
        "errors": len(records) - len(ok),
        "ttft_p50_ms": ms(pct(ttft, 50)),
        "ttft_p99_ms": ms(pct(ttft, 99)),
        "latency_p50_ms": ms(pct(lat, 50)),
        "latency_p99_ms": ms(pct(lat, 99)),
    }


@dataclass
class Window:
    """What a measured window of load saw: the records, and the seconds that passed over it."""

    records: list[Rec]
    server_cpu_s: float  # CPU seconds of the process measured (the router)
    client_cpu_s: float  # of this process, the load client: whether it, not the server, was the limit
    wall_s: float


async def measured_chat_load(
    port: int, pid: int, stream: bool, concurrency: int, warmup: float, duration: float
) -> Window:
    """Closed-loop chat requests at ``port``, served by process ``pid``, for ``duration`` s after warm-up."""
    post = Post("/v1/chat/completions", chat_json(stream=stream))
    load = asyncio.create_task(
        closed_loop(port, lambda _: post, concurrency, duration_s=duration, warmup_s=warmup)
    )
    await asyncio.sleep(warmup)
    cpu0, own0, t0 = cpu_seconds(pid), time.process_time(), time.perf_counter()
    records = await load
    return Window(records, cpu_seconds(pid) - cpu0, time.process_time() - own0, time.perf_counter() - t0)
