"""The scale hint: demand over typical node capacity, with time-based hysteresis; the webhook."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from macpool.dev.redis_server import free_port
from macpool.scaling import ScalePolicy
from router.scale import ScaleAdvisor, ScaleConfig, ScaleHint, ScaleWatch, ScaleWebhook
from router.settings import ConfigError
from tests.operator.helpers import Pool, wait_until


def view(busy: int, queued: int = 0, rejections: float = 0.0, requests: float = 1.0) -> dict[str, Any]:
    """An /api/pool document of two ready 8-slot nodes."""
    docs = [{"node_id": f"n{i}", "capacity": 8, "state": "ready", "drained": False} for i in range(2)]
    pool = {
        "capacity": 16, "busy": busy, "queued": queued, "nodes_total": 2, "nodes_ready": 2,
        "requests_per_s": requests, "rejections_per_s": rejections, "saturation": (busy + queued) / 16,
    }
    return {"ts_ms": 0, "pool": pool, "nodes": docs}


def test_scale_up_needs_the_demand_to_last_and_down_needs_longer() -> None:
    advisor = ScaleAdvisor(ScaleConfig(ScalePolicy(up_delay=10, down_delay=60)))
    assert advisor.observe(view(busy=8), now=0).desired_nodes == 2
    # 16 busy + 8 queued + 4/s turned away x (16 busy / 4 admitted/s = 4 s each) = 40 slots over 8 x 0.8
    hot = view(busy=16, queued=8, rejections=4.0, requests=8.0)
    assert advisor.observe(hot, now=1).desired_nodes == 2  # a burst is not a trend
    hint = advisor.observe(hot, now=12)
    assert hint.desired_nodes == 7
    assert "scale up" in hint.reason
    assert advisor.observe(view(busy=4), now=13).desired_nodes == 7  # quiet for a moment: hold
    assert advisor.observe(view(busy=4), now=40).desired_nodes == 7
    assert advisor.observe(view(busy=4), now=74).desired_nodes == 1
    # clients retrying every 10 ms: 100 refusals/s x 4 s would be 400 slots; counted as the pool's 16 at most
    impatient = ScaleAdvisor(ScaleConfig(ScalePolicy(up_delay=0, down_delay=0)))
    assert impatient.observe(view(busy=16, rejections=100.0, requests=104.0), now=0).desired_nodes == 5
    # in the band between 50% and 80% of the current nodes nothing moves, however long it lasts
    band = ScaleAdvisor(ScaleConfig(ScalePolicy(up_delay=0, down_delay=0)))
    band.observe(view(busy=10), now=0)
    assert [band.observe(view(busy=10), now=t).desired_nodes for t in range(1, 5)] == [2, 2, 2, 2]


def test_watch_posts_the_hint_once_per_change_after_the_debounce() -> None:
    received: list[dict[str, Any]] = []

    async def hook(request: Request) -> Response:
        received.append(json.loads(await request.body()))
        return Response(status_code=204 if len(received) > 1 else 500)  # first attempt fails: retried

    async def scenario() -> None:
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(Starlette(routes=[Route("/hook", hook, methods=["POST"])]),
                                               port=port, log_level="warning"))
        serving = asyncio.create_task(server.serve())
        for _ in range(500):
            if server.started:
                break
            await asyncio.sleep(0.01)
        current = {"v": view(busy=4)}
        config = ScaleConfig(ScalePolicy(up_delay=0, down_delay=0), webhook_url=f"http://127.0.0.1:{port}/hook",
                             webhook_debounce_s=0.2, sample_interval_s=0.05)
        watch = ScaleWatch(lambda: current["v"], config)
        try:
            async with watch.running():
                await asyncio.sleep(0.5)
                current["v"] = view(busy=30, queued=10)
                for _ in range(200):
                    if watch.webhook is not None and watch.webhook.delivered[-1:] and \
                            watch.webhook.delivered[-1]["desired_nodes"] == 7:
                        break
                    await asyncio.sleep(0.05)
        finally:
            server.should_exit = True
            await serving

    asyncio.run(scenario())
    desired = [doc["desired_nodes"] for doc in received]
    assert desired[-1] == 7
    assert set(received[-1]) >= {"current_nodes", "desired_nodes", "saturation", "reason"}
    # the first hint (1 node for 4 busy) failed once with 500 and was retried; then one POST for 7;
    # nothing repeats while the figure holds
    assert desired == [1, 1, 7]


@pytest.fixture
def receiver() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """A real HTTP server on loopback that records the JSON bodies POSTed to it."""
    received: list[dict[str, Any]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers.get("content-length", 0))
            received.append(json.loads(self.rfile.read(length)))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/scale", received
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


@pytest.fixture
def refuser() -> Iterator[tuple[str, list[int]]]:
    """A real HTTP server on loopback that answers every POST 503, and counts them."""
    posts: list[int] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length", 0)))
            posts.append(503)
            self.send_response(503)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/scale", posts
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


@pytest.mark.parametrize("webhook", ["refusing", "unreachable"])
def test_a_failing_webhook_is_tried_the_configured_times_then_given_up(
    webhook: str, refuser: tuple[str, list[int]], caplog: pytest.LogCaptureFixture
) -> None:
    url, posts = refuser if webhook == "refusing" else (f"http://127.0.0.1:{free_port()}/scale", [])
    config = ScaleConfig(webhook_url=url, webhook_debounce_s=0, webhook_attempts=3, webhook_backoff_s=0.01)

    async def scenario() -> None:
        hook = ScaleWebhook(config)
        hook.offer(ScaleHint(current_nodes=1, desired_nodes=3, saturation=1.0, reason="test"), now=0)
        for _ in range(1000):
            if "gave up" in caplog.text:
                break
            await asyncio.sleep(0.01)
        await hook.aclose()
        assert hook.delivered == []

    with caplog.at_level("WARNING", logger="macpool.router.scale"):
        asyncio.run(scenario())
    failed = [r.getMessage() for r in caplog.records if "attempt" in r.getMessage()]
    assert [m.split(" failed")[0] for m in failed] == [f"scale webhook attempt {n}/3" for n in (1, 2, 3)]
    assert ("HTTP 503" if webhook == "refusing" else "ConnectError") in failed[-1]
    assert "scale webhook gave up on desired_nodes=3" in caplog.text
    assert len(posts) == (3 if webhook == "refusing" else 0)


@pytest.mark.in_process
def test_router_serves_the_hint_and_posts_it_to_its_webhook(
    pool: Callable[..., Pool], receiver: tuple[str, list[dict[str, Any]]]
) -> None:
    url, received = receiver
    # (at least two Macs asked for, whatever the demand: the --scale-* flags reach the hint)
    running = pool(nodes=1, router_args=("--scale-webhook", url, "--scale-min-nodes", "2"))

    def counted() -> dict[str, Any] | None:
        hint: dict[str, Any] = httpx.get(f"{running.router.url}/api/pool/scale", timeout=10).json()
        return hint if hint["current_nodes"] == 1 else None

    # the hint is the router's last sample of the pool (one every half second), which may predate the node
    hint = wait_until(counted, 10, "a scale hint counting the ready node")
    assert hint["desired_nodes"] == 2
    assert set(hint) >= {"current_nodes", "desired_nodes", "saturation", "reason"}
    wait_until(lambda: bool(received), 60, "the first scale document at the webhook")
    assert received[0]["desired_nodes"] == hint["desired_nodes"]


def test_the_scale_knobs_come_from_the_routers_settings_and_must_make_sense(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from router.cli import build_settings

    monkeypatch.setenv("MACPOOL_SCALE_MAX_NODES", "6")
    settings = build_settings(["--scale-target-utilisation", "0.9", "--scale-down-delay", "30"])
    policy = ScaleConfig.from_settings(settings).policy
    assert (policy.target_utilisation, policy.down_delay, policy.max_nodes) == (0.9, 30.0, 6)
    assert policy.min_nodes == 1  # the hint's own default
    with pytest.raises(ConfigError, match="scale_low_utilisation"):
        build_settings(["--scale-target-utilisation", "0.4"])  # under the low share's 0.5
    with pytest.raises(ConfigError, match="scale_min_nodes"):
        build_settings(["--scale-min-nodes", "8", "--scale-max-nodes", "4"])
