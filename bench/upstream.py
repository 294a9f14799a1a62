"""The bench's fast upstream: a tiny HTTP/1.1 server (asyncio protocol + httptools) that answers
OpenAI-shaped chat completions as fast as possible: SSE events written one per write, optionally paced, or a
short JSON body.

It can pose as ``N`` pool nodes (``/n{i}/v1/...``) and write their heartbeats, tracks in-flight requests per
node and counts every time a node held more than its capacity (over-admission). The simulator models a
Mac's physics; this upstream exists so that the *router* is what a relay benchmark measures.
Run it as ``python -m bench.upstream --port P ...``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import signal
import sys
from dataclasses import dataclass
from typing import Any

import httptools

from bench.wire import LOOP, MODEL, HttpConnection, chunk_frame, completion_body, sse_event
from macpool.contract import NodeDoc, heartbeat_ttl_ms, now_ms
from macpool.store import Store

_MAX_TOKENS = re.compile(rb'"max_tokens":\s*(\d+)')


@dataclass
class UpstreamConfig:
    events: int = 100  # content events per stream
    interval_s: float = 0.0  # pause after each event (0: yield to the loop every event)
    first_delay_s: float = 0.0  # before the response head
    capacity: int = 0  # per node; 0 = unlimited (no over-admission accounting)
    nodes: int = 1
    tokens: int = 16  # non-streaming completion size
    events_from_body: bool = False  # a request's ``max_tokens`` sets its number of events


@dataclass
class NodeStats:
    in_flight: int = 0
    max_in_flight: int = 0
    over_capacity: int = 0  # requests that arrived while the node already held ``capacity``
    served: int = 0


class FastUpstream:
    def __init__(self, config: UpstreamConfig) -> None:
        self.config = config
        self.stats: dict[str, NodeStats] = {}
        self.event = chunk_frame(sse_event())
        done = chunk_frame(b"data: [DONE]\n\n")
        self.tail = chunk_frame(sse_event(finish="length")) + done + b"0\r\n\r\n"
        self.json_body = completion_body(config.tokens)

    def node(self, name: str) -> NodeStats:
        stats = self.stats.get(name)
        if stats is None:
            stats = self.stats[name] = NodeStats()
        return stats

    def stats_json(self) -> dict[str, Any]:
        nodes = {k: vars(v) for k, v in sorted(self.stats.items())}
        return {
            "nodes": nodes,
            "capacity": self.config.capacity,
            "max_in_flight": max((v.max_in_flight for v in self.stats.values()), default=0),
            "over_capacity": sum(v.over_capacity for v in self.stats.values()),
            "served": sum(v.served for v in self.stats.values()),
        }


class _ServerConn(HttpConnection):
    parser: httptools.HttpRequestParser

    def __init__(self, server: FastUpstream) -> None:
        self.server = server
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.body: list[bytes] = []
        self.closed = False
        self.writable = asyncio.Event()
        self.writable.set()
        self.counted: NodeStats | None = None  # the node this connection's request is counted against

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.writable.set()
        self.finish()  # the request ends when its connection does, not at the stream's next write

    def finish(self) -> None:
        if self.counted is not None:
            self.counted.in_flight -= 1
            self.counted = None

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        method = self.parser.get_method()
        path = self.url.split(b"?", 1)[0]
        body = b"".join(self.body)
        self.url, self.body = b"", []
        asyncio.get_running_loop().create_task(self.handle(method, path, body))

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.closed:
            self.transport.write(data)

    def respond(self, status: str, body: bytes, content_type: bytes = b"application/json") -> None:
        self.write(
            b"HTTP/1.1 "
            + status.encode()
            + b"\r\ncontent-type: "
            + content_type
            + b"\r\ncontent-length: "
            + str(len(body)).encode()
            + b"\r\n\r\n"
            + body
        )

    async def handle(self, method: bytes, path: bytes, body: bytes) -> None:
        if method == b"GET" and path in (b"/health", b"/v1/health"):
            self.respond("200 OK", b'{"status":"ok"}')
            return
        if method == b"GET" and path.endswith(b"/models"):
            data = {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "bench"}]}
            self.respond("200 OK", json.dumps(data).encode())
            return
        if method == b"GET" and path == b"/stats":
            self.respond("200 OK", json.dumps(self.server.stats_json()).encode())
            return
        if method == b"POST" and path == b"/reset":
            self.server.stats.clear()
            self.respond("200 OK", b"{}")
            return
        if method != b"POST" or not path.endswith(b"completions"):
            self.respond("404 Not Found", b'{"error":{"message":"not found","code":404}}')
            return
        parts = path.split(b"/")
        name = parts[1].decode() if len(parts) > 2 and parts[1].startswith(b"n") else "n"
        config = self.server.config
        stats = self.server.node(name)
        if config.capacity and stats.in_flight >= config.capacity:
            stats.over_capacity += 1
        stats.in_flight += 1
        stats.max_in_flight = max(stats.max_in_flight, stats.in_flight)
        self.counted = stats
        try:
            if config.first_delay_s:
                await asyncio.sleep(config.first_delay_s)
            if b'"stream":true' in body or b'"stream": true' in body:
                events = config.events
                if config.events_from_body:
                    found = _MAX_TOKENS.search(body)
                    events = int(found.group(1)) if found else events
                await self.stream(config, events)
            else:
                self.respond("200 OK", self.server.json_body)
            stats.served += 1
        finally:
            self.finish()

    async def stream(self, config: UpstreamConfig, events: int) -> None:
        self.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        event = self.server.event
        interval = config.interval_s
        for _ in range(events):
            if self.closed:
                return
            self.write(event)
            if not self.writable.is_set():
                await self.writable.wait()
            await asyncio.sleep(interval)
        self.write(self.server.tail)


async def _heartbeats(
    redis_url: str, upstream: FastUpstream, port: int, prefix: str, stop: asyncio.Event
) -> None:
    from redis.asyncio import Redis

    config = upstream.config
    redis = Redis.from_url(redis_url)
    store = Store(redis)
    started = now_ms()
    names = [f"{prefix}{i}" for i in range(config.nodes)]
    try:
        while not stop.is_set():
            for i, name in enumerate(names):
                doc = NodeDoc(
                    node_id=name,
                    url=f"http://{LOOP}:{port}/n{i}",
                    models=[MODEL],
                    capacity=config.capacity or 1_000_000,
                    total_slots=config.capacity or 1_000_000,
                    state="ready",
                    reason="bench upstream",
                    agent_version="bench",
                    started_at_ms=started,
                    updated_at_ms=now_ms(),
                )
                await store.heartbeat(doc, heartbeat_ttl_ms(1.0))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
    finally:
        with contextlib.suppress(Exception):
            for name in names:
                await store.deregister(name)
        await redis.aclose()


async def serve_upstream(port: int, config: UpstreamConfig, redis_url: str | None, prefix: str) -> None:
    loop = asyncio.get_running_loop()
    upstream = FastUpstream(config)
    server = await loop.create_server(lambda: _ServerConn(upstream), LOOP, port, backlog=4096)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    beats = asyncio.create_task(_heartbeats(redis_url, upstream, port, prefix, stop)) if redis_url else None
    try:
        await stop.wait()
    finally:
        server.close()
        if beats is not None:
            stop.set()
            await beats


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.upstream")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--events", type=int, default=100)
    p.add_argument("--interval-ms", type=float, default=0.0)
    p.add_argument("--first-delay-ms", type=float, default=0.0)
    p.add_argument("--capacity", type=int, default=0)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--redis-url", help="write heartbeats for the nodes (/n0 .. /n{N-1}) into this pool")
    p.add_argument("--node-prefix", default="fast-")
    p.add_argument("--events-from-body", action="store_true", help="a request's max_tokens = its events")
    a = p.parse_args(argv)
    config = UpstreamConfig(
        a.events,
        a.interval_ms / 1000.0,
        a.first_delay_ms / 1000.0,
        a.capacity,
        a.nodes,
        a.tokens,
        a.events_from_body,
    )
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve_upstream(a.port, config, a.redis_url, a.node_prefix))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
