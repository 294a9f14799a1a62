"""The bench's fast upstream: an ``aiohttp.web`` server that answers OpenAI-shaped chat completions as fast
as it can: SSE events written one per write, optionally paced, or a short JSON body.

It can pose as ``N`` pool nodes (``/n{i}/v1/...``) and write their heartbeats, tracks in-flight requests per
node and counts every time a node held more than its capacity (over-admission). The simulator models a
Mac's physics; this upstream exists so that the *router* is what a relay benchmark measures.
Run it as ``python -m macpool.bench.upstream --port P ...``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import signal
import sys
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from macpool.bench.wire import LOOP, MODEL, completion_body, sse_event
from macpool.contract import NodeDoc, heartbeat_ttl_ms, now_ms
from macpool.store import Store

_MAX_TOKENS = re.compile(rb'"max_tokens":\s*(\d+)')
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


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
        self.event = sse_event()
        self.tail = sse_event(finish="length") + b"data: [DONE]\n\n"
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

    def app(self) -> web.Application:
        """The routes: ``/n{i}/...completions`` answers as node ``n{i}``, other ``completions`` as ``n``."""
        app = web.Application()
        app.add_routes(
            [
                web.get("/health", self.health),
                web.get("/v1/health", self.health),
                web.get("/stats", self.stats_view),
                web.post("/reset", self.reset),
                web.get("/models", self.models),
                web.get("/{prefix:.*}/models", self.models),
                web.post("/{node:n[^/]*}/{api:.*}completions", self.complete),
                web.post("/{api:.*}completions", self.complete),
                web.route("*", "/{path:.*}", self.not_found),
            ]
        )
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "bench"}]}
        )

    async def stats_view(self, request: web.Request) -> web.Response:
        return web.json_response(self.stats_json())

    async def reset(self, request: web.Request) -> web.Response:
        self.stats.clear()
        return web.json_response({})

    async def not_found(self, request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "not found", "code": 404}}, status=404)

    async def complete(self, request: web.Request) -> web.StreamResponse:
        """A chat completion: streamed when the body asks for it. The request counts against its node until
        its answer ends or its client leaves (aiohttp cancels the handler then)."""
        body = await request.read()
        config = self.config
        stats = self.node(request.match_info.get("node", "n"))
        if config.capacity and stats.in_flight >= config.capacity:
            stats.over_capacity += 1
        stats.in_flight += 1
        stats.max_in_flight = max(stats.max_in_flight, stats.in_flight)
        try:
            if config.first_delay_s:
                await asyncio.sleep(config.first_delay_s)
            answer: web.StreamResponse
            if b'"stream":true' in body or b'"stream": true' in body:
                events = config.events
                if config.events_from_body:
                    found = _MAX_TOKENS.search(body)
                    events = int(found.group(1)) if found else events
                answer = await self.stream(request, events)
            else:
                answer = web.Response(body=self.json_body, content_type="application/json")
            stats.served += 1
            return answer
        finally:
            stats.in_flight -= 1

    async def stream(self, request: web.Request, events: int) -> web.StreamResponse:
        response = web.StreamResponse(headers=_SSE_HEADERS)
        response.enable_chunked_encoding()
        await response.prepare(request)
        interval = self.config.interval_s
        for _ in range(events):
            await response.write(self.event)  # one event per write, as llama-server sends them
            await asyncio.sleep(interval)
        await response.write_eof(self.tail)
        return response


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
    # handler_cancellation: a request whose client left ends at once, and stops counting against its node;
    # shutdown_timeout: streams are endless and nothing needs them finished once the bench stops this process
    runner = web.AppRunner(upstream.app(), access_log=None, handler_cancellation=True, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, LOOP, port, backlog=4096).start()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    beats = asyncio.create_task(_heartbeats(redis_url, upstream, port, prefix, stop)) if redis_url else None
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        if beats is not None:
            stop.set()
            await beats


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m macpool.bench.upstream")
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
