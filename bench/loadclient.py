"""A closed-loop HTTP/1.1 load client on raw asyncio protocols (keep-alive, no JSON parsing), cheap enough
that one core drives a router core to saturation. It records status, time to the first SSE event, latency
and the number of SSE events and body reads of every request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httptools

from bench.cpu import cpu_seconds
from bench.stats import ms, pct
from bench.wire import LOOP, HttpConnection, build_request, chat_json


@dataclass
class Rec:
    status: int  # 0: connection failed
    latency_s: float
    ttft_s: float | None  # first SSE event (streams) / first body byte
    events: int = 0  # "data: " occurrences in the body
    reads: int = 0  # body pieces received (how coalesced the events arrived)
    retry_after: bool = False
    reason: str = ""


class _ClientConn(HttpConnection):
    parser: httptools.HttpResponseParser

    def __init__(self, tally: list[int] | None = None) -> None:
        self.tally = tally if tally is not None else [0, 0]
        self.parser = httptools.HttpResponseParser(self)
        self.done: asyncio.Future[Rec] | None = None
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._reset(0.0)

    def _reset(self, started: float) -> None:
        self.started = started
        self.first: float | None = None
        self.events = 0
        self.reads = 0
        self.carry = b""
        self.header = b""
        self.retry_after = False
        self.reason = ""
        self.keep_alive = False

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.lost.done():
            self.lost.set_result(None)
        if self.done is not None and not self.done.done():
            self.done.set_result(Rec(0, time.perf_counter() - self.started, None))

    def on_header(self, name: bytes, value: bytes) -> None:
        lname = name.lower()
        if lname == b"retry-after":
            self.retry_after = True
        elif lname == b"x-macpool-reason":
            self.reason = value.decode()

    def on_body(self, body: bytes) -> None:
        if self.first is None:
            self.first = time.perf_counter()
        self.reads += 1
        joined = self.carry + body
        found = joined.count(b"data: ")
        self.events += found
        self.tally[0] += found
        self.tally[1] += 1
        self.carry = joined[-5:]

    def on_message_complete(self) -> None:
        now = time.perf_counter()
        # only valid here: once the message is complete the parser resets and reports False
        self.keep_alive = self.parser.should_keep_alive()
        ttft = None if self.first is None else self.first - self.started
        rec = Rec(
            self.parser.get_status_code(),
            now - self.started,
            ttft,
            self.events,
            self.reads,
            self.retry_after,
            self.reason,
        )
        if self.done is not None and not self.done.done():
            self.done.set_result(rec)

    async def request(self, raw: bytes) -> Rec:
        assert self.transport is not None
        self._reset(time.perf_counter())
        self.done = asyncio.get_running_loop().create_future()
        self.transport.write(raw)
        return await self.done


async def raw_load(
    port: int,
    make_request: Callable[[int], bytes],
    concurrency: int,
    duration_s: float | None = None,
    requests: int | None = None,
    host: str = LOOP,
    warmup_s: float = 0.0,
    tally: list[int] | None = None,
    request_timeout: float = 120.0,
    stagger_s: float = 0.0,
) -> list[Rec]:
    """``concurrency`` keep-alive connections in a closed loop; records requests started after warm-up.

    ``tally`` (``[events, body reads]``) is incremented live, for callers that sample rates over a window.
    ``stagger_s`` spreads the connections' first requests evenly over that many seconds: streams of equal
    length started together would otherwise end together and arrive again as one burst, every time.
    """
    loop = asyncio.get_running_loop()
    records: list[Rec] = []
    start = time.perf_counter()
    measure_from = start + warmup_s
    deadline = None if duration_s is None else measure_from + duration_s
    budget = [requests if requests is not None else -1]

    async def connect() -> _ClientConn:
        _, conn = await loop.create_connection(lambda: _ClientConn(tally), host, port)
        return conn

    async def worker(index: int) -> None:
        conn: _ClientConn | None = None
        if stagger_s:
            await asyncio.sleep(stagger_s * index / concurrency)
        try:
            while True:
                now = time.perf_counter()
                if deadline is not None and now >= deadline:
                    return
                if budget[0] == 0:
                    return
                if budget[0] > 0:
                    budget[0] -= 1
                if conn is None or conn.lost.done():
                    try:
                        conn = await connect()
                    except OSError:
                        records.append(Rec(0, 0.0, None))
                        await asyncio.sleep(0.01)
                        continue
                try:
                    rec = await asyncio.wait_for(conn.request(make_request(index)), request_timeout)
                except TimeoutError:
                    rec = Rec(0, request_timeout, None)
                    if conn.transport is not None:
                        conn.transport.close()
                if now >= measure_from:
                    records.append(rec)
                if not conn.keep_alive and conn.transport is not None:
                    conn.transport.close()
                    conn = None
        finally:
            if conn is not None and conn.transport is not None:
                conn.transport.close()

    await asyncio.gather(*(worker(i) for i in range(concurrency)))
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


async def measured_chat_load(
    port: int, pid: int, stream: bool, concurrency: int, warmup: float, duration: float
) -> tuple[list[Rec], float, float]:
    """Closed-loop chat requests at ``port`` for ``duration`` s after ``warmup`` s: the records, and the CPU
    seconds process ``pid`` used and the wall seconds that passed over the measured window."""
    raw = build_request("/v1/chat/completions", chat_json(stream=stream))
    load = asyncio.create_task(
        raw_load(port, lambda _: raw, concurrency, duration_s=duration, warmup_s=warmup)
    )
    await asyncio.sleep(warmup)
    cpu0, t0 = cpu_seconds(pid), time.perf_counter()
    records = await load
    return records, cpu_seconds(pid) - cpu0, time.perf_counter() - t0
