"""The dashboard's SSE stream: pushes the pool view, and ends its loop when the viewer goes away."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Callable
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette

from macpool.dev.redis_server import free_port
from router.dashboard import Dashboard, routes
from router.settings import Settings

SpawnFactory = Callable[..., Any]

VIEW: dict[str, Any] = {
    "ts_ms": 1, "router_id": "r1", "redis_ok": True,
    "pool": {"capacity": 8, "busy": 3, "queued": 0, "nodes_total": 1, "nodes_ready": 1,
             "requests_per_s": 1.0, "rejections_per_s": 0.0, "saturation": 0.375},
    "nodes": [{"node_id": "mac-1", "capacity": 8, "state": "ready", "in_flight": 3}],
}


def test_stream_pushes_frames_and_stops_when_the_client_disconnects() -> None:
    table = routes(lambda: VIEW, settings=Settings())
    dashboard = next(r.endpoint.__self__ for r in table if getattr(r, "path", "") == "/api/pool/stream")  # type: ignore[attr-defined]
    assert isinstance(dashboard, Dashboard)

    async def scenario() -> list[dict[str, Any]]:
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(Starlette(routes=table), port=port, log_level="warning"))
        serving = asyncio.create_task(server.serve())
        events: list[dict[str, Any]] = []
        try:
            for _ in range(500):
                if server.started:
                    break
                await asyncio.sleep(0.01)
            async with httpx.AsyncClient(timeout=10) as client:
                for _ in range(3):  # three viewers, one after another
                    async with client.stream("GET", f"http://127.0.0.1:{port}/api/pool/stream") as response:
                        assert response.headers["content-type"].startswith("text/event-stream")
                        kind = ""
                        async for line in response.aiter_lines():
                            if line.startswith("event: "):
                                kind = line[7:]
                            elif line.startswith("data: ") and kind == "pool":
                                events.append(json.loads(line[6:]))
                                if len(events) % 2 == 0:
                                    break
                scale = (await client.get(f"http://127.0.0.1:{port}/api/pool/scale")).json()
                assert scale["current_nodes"] == 1
            for _ in range(200):
                if dashboard.viewers == 0:
                    break
                await asyncio.sleep(0.05)
            assert dashboard.viewers == 0, "a stream kept running after its client left"
            return events
        finally:
            server.should_exit = True
            await serving

    events = asyncio.run(scenario())
    assert len(events) == 6
    assert events[0]["view"]["nodes"][0]["node_id"] == "mac-1"
    assert set(events[0]["scale"]) >= {"current_nodes", "desired_nodes", "saturation", "reason"}


def test_an_open_dashboard_does_not_hold_up_the_routers_shutdown(redis_url: str, spawn: SpawnFactory) -> None:
    """SIGTERM ends the dashboard's streams at once: an idle router with a page open stops in well under its
    --shutdown-timeout, and without uvicorn's "Exception in ASGI application" traceback."""
    router = spawn("router", "--redis-url", redis_url, "--shutdown-timeout", "10", name="router")
    stream_url = f"{router.url}/api/pool/stream"
    with httpx.Client(timeout=10) as client, client.stream("GET", stream_url) as response:
        lines = response.iter_lines()
        assert any(line == "event: pool" for line in lines)
        sent = time.monotonic()
        router.child.signal(signal.SIGTERM)
        cut = False
        try:
            for _ in lines:  # the stream ends (it went on until the router cut it off at 10 s)
                pass
        except httpx.RemoteProtocolError:
            cut = True
        ended = time.monotonic() - sent
    assert not cut, f"the stream was cut off after {ended:.1f}s instead of ending"
    assert router.child.process is not None
    router.child.process.wait(10)
    stopped = time.monotonic() - sent
    assert ended < 3 and stopped < 5, f"stream ended after {ended:.1f}s, router stopped after {stopped:.1f}s"
    log = router.child.log_path.read_text() if router.child.log_path else ""
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log[-2000:]


def test_a_head_request_gets_the_streams_head_and_no_stream() -> None:
    # the stream never ends: sent for a HEAD, its frames were generated and dropped for as long as the
    # connection lasted, and a next request on that connection waited behind it for ever
    table = routes(lambda: VIEW, settings=Settings())
    dashboard = next(r.endpoint.__self__ for r in table if getattr(r, "path", "") == "/api/pool/stream")  # type: ignore[attr-defined]

    async def scenario() -> None:
        port = free_port()
        config = uvicorn.Config(Starlette(routes=table), port=port, log_level="warning",
                                timeout_graceful_shutdown=1)
        server = uvicorn.Server(config)
        serving = asyncio.create_task(server.serve())
        try:
            for _ in range(500):
                if server.started:
                    break
                await asyncio.sleep(0.01)
            limits = httpx.Limits(max_connections=1)  # one connection: the second request follows the HEAD
            async with httpx.AsyncClient(timeout=5, limits=limits) as client:
                head = await client.head(f"http://127.0.0.1:{port}/api/pool/stream")
                assert head.status_code == 200
                assert head.headers["content-type"].startswith("text/event-stream")
                scale = await client.get(f"http://127.0.0.1:{port}/api/pool/scale")
                assert scale.json()["current_nodes"] == 1
                assert dashboard.viewers == 0
        finally:
            server.should_exit = True
            await serving

    asyncio.run(scenario())
