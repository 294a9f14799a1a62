"""The agent attached to the simulator, with a real Redis: heartbeat, cap, disconnect, drain, outage."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from macpool.contract import heartbeat_ttl_ms
from macpool.redis_server import RedisServer, free_port
from tests.conftest import Server
from tests.conftest import chat as shared_chat
from tests.node_agent.helpers import (
    AgentFactory,
    node_ttl_ms,
    read_node,
    sim_stats,
    status,
    wait_until,
    write_gguf,
)

SimFactory = Callable[..., Server]


def chat(max_tokens: int, stream: bool = True) -> dict[str, Any]:
    return shared_chat("model-14b-q4.gguf", max_tokens, stream, content="hello " * 50)


def test_heartbeat_document_and_honest_capacity(sim: SimFactory, agent: AgentFactory, redis_url: str) -> None:
    upstream = sim("--parallel", "24", "--speed", "20", "--metrics")
    gateway = agent("--upstream", upstream.url, "--calibrated-cap", "8")
    doc = wait_until(lambda: (d := read_node(redis_url, "n1")) and d.state == "ready" and d, what="ready")
    # capacity = min(total_slots 24, memory floor((36 - 8 - 2) / 2.625) = 9, calibrated 8)
    assert doc.capacity == 8
    breakdown = doc.capacity_breakdown
    assert (breakdown.configured, breakdown.memory, breakdown.calibrated) == (24, 9, 8)
    assert "calibrated" in doc.reason
    assert doc.url == gateway.url
    assert doc.models == ["model-14b-q4.gguf"]
    assert (doc.total_slots, doc.ctx_per_slot) == (24, 8192)
    assert doc.llama_build.startswith("sim")
    assert (doc.memory.wired_limit_gb, doc.memory.weights_gb, doc.memory.per_request_gb) == (36, 8, 2.625)
    assert doc.memory.state == "healthy" and doc.agent_version
    assert 0 < node_ttl_ms(redis_url, "n1") <= heartbeat_ttl_ms(0.3)
    # one streamed request gives a TTFT sample and a tokens/s figure
    with httpx.stream("POST", gateway.url + "/v1/chat/completions", json=chat(200), timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        body = b"".join(response.iter_raw())
    assert body.rstrip().endswith(b"data: [DONE]")
    doc = wait_until(lambda: (d := read_node(redis_url, "n1")) and d.tokens_per_s > 0 and d, what="tokens/s")
    assert doc.ttft_p50_ms is not None and doc.ttft_p50_ms > 0
    # TTFT counts from the request, not from the response headers (which come with the first token)
    final = next(line for line in reversed(body.split(b"\n")) if b'"timings"' in line)
    prompt_wall_ms = json.loads(final.removeprefix(b"data: "))["timings"]["prompt_ms"] / 20  # --speed 20
    assert doc.ttft_p50_ms >= 0.9 * prompt_wall_ms
    metrics = httpx.get(gateway.url + "/metrics").text
    assert "macpool_agent_capacity_requests 8.0" in metrics
    assert httpx.get(gateway.url + "/v1/models").json()["data"][0]["id"] == "model-14b-q4.gguf"


async def _burst(url: str, n: int, token: str) -> list[httpx.Response]:
    headers = {"X-Macpool-Token": token}
    async with httpx.AsyncClient(timeout=60) as client:

        async def one() -> httpx.Response:
            body = chat(3000, stream=False)
            response = await client.post(url + "/v1/chat/completions", json=body, headers=headers)
            await response.aread()
            return response

        return await asyncio.gather(*(one() for _ in range(n)))


def test_hard_cap_under_three_times_the_cap_and_token(sim: SimFactory, agent: AgentFactory) -> None:
    upstream = sim("--parallel", "16", "--speed", "20", "--metrics")
    gateway = agent("--upstream", upstream.url, "--cap", "4", "--token", "s3cret")
    wait_until(lambda: status(gateway.url)["state"] == "ready", what="ready")
    # without the token (or with a wrong one): 401, nothing reaches llama-server
    for headers in ({}, {"X-Macpool-Token": "wrong"}, {"Authorization": "Bearer s3cret"}):
        denied = httpx.post(gateway.url + "/v1/chat/completions", json=chat(5), headers=headers)
        assert denied.status_code == 401
        assert denied.json()["error"]["code"] == "invalid_agent_token"
    responses = asyncio.run(_burst(gateway.url, 12, "s3cret"))
    ok = [r for r in responses if r.status_code == 200]
    full = [r for r in responses if r.status_code == 503]
    assert len(ok) + len(full) == 12
    assert 4 <= len(ok) < 12
    for response in full:
        assert response.json()["error"]["code"] == "node_full"
        assert response.headers["retry-after"] == "1"
    stats = sim_stats(upstream.url)
    assert stats["max_concurrent"] <= 4
    assert stats["completed"] == len(ok) + 0  # the 401s and 503s never reached the simulator


def test_client_disconnect_frees_the_slot_within_a_second(sim: SimFactory, agent: AgentFactory) -> None:
    upstream = sim("--parallel", "4", "--speed", "20", "--metrics")
    gateway = agent("--upstream", upstream.url)
    wait_until(lambda: status(gateway.url)["state"] == "ready", what="ready")
    with httpx.stream(
        "POST",
        gateway.url + "/v1/chat/completions",
        json=chat(6000),
        headers={"X-Conversation-Id": "abc", "X-Request-ID": "req-1"},
        timeout=30,
    ) as response:
        assert response.status_code == 200
        chunks = response.iter_raw()  # keep the generator: dropping it closes the stream
        next(chunks)
        stats = sim_stats(upstream.url)
        assert stats["processing"] == 1, json.dumps(stats)
    # the client is gone: the agent closes its upstream connection and the simulator cancels the task
    wait_until(lambda: sim_stats(upstream.url)["processing"] == 0, timeout=1.0, what="slot freed")
    wait_until(lambda: status(gateway.url)["in_flight"] == 0, timeout=2.0, what="gateway slot released")
    assert sim_stats(upstream.url)["cancelled"] == 1


def test_memory_pressure_admits_nothing_new_then_recovers(
    sim: SimFactory, agent: AgentFactory, redis_url: str
) -> None:
    upstream = sim("--parallel", "24", "--speed", "20", "--metrics")
    gateway = agent("--upstream", upstream.url)
    wait_until(lambda: (d := read_node(redis_url, "n1")) and d.state == "ready", what="ready")
    # another app takes 27 GB: pinned 35.3 GB of a 36 GB wired limit
    httpx.post(upstream.url + "/sim/pressure", json={"external_gb": 27}).raise_for_status()
    doc = wait_until(lambda: (d := read_node(redis_url, "n1")) and d.state == "paging" and d, what="paging")
    assert doc.capacity == 0 and doc.capacity_breakdown.pressure_limited
    assert "admitting nothing new" in doc.reason
    refused = httpx.post(gateway.url + "/v1/chat/completions", json=chat(5))
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "node_full"
    httpx.post(upstream.url + "/sim/pressure", json={"external_gb": 0}).raise_for_status()
    doc = wait_until(lambda: (d := read_node(redis_url, "n1")) and d.state == "ready" and d, what="recovery")
    assert doc.capacity == 9 and not doc.capacity_breakdown.pressure_limited
    assert httpx.post(gateway.url + "/v1/chat/completions", json=chat(5, stream=False)).status_code == 200


def test_drain_on_sigterm(sim: SimFactory, agent: AgentFactory, redis_url: str) -> None:
    upstream = sim("--parallel", "4", "--speed", "20", "--metrics")
    gateway = agent("--upstream", upstream.url, "--drain-timeout", "20")
    wait_until(lambda: (d := read_node(redis_url, "n1")) and d.state == "ready", what="ready")
    with httpx.stream("POST", gateway.url + "/v1/chat/completions", json=chat(2500), timeout=30) as response:
        chunks = response.iter_raw()
        next(chunks)
        gateway.child.signal(signal.SIGTERM)
        wait_until(lambda: (d := read_node(redis_url, "n1")) and d.state == "draining", what="draining")
        refused = httpx.post(gateway.url + "/v1/chat/completions", json=chat(5))
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "node_draining"
        rest = b"".join(chunks)
    assert rest.rstrip().endswith(b"data: [DONE]")  # the in-flight request finished
    assert gateway.child.process is not None
    assert gateway.child.process.wait(15) == 0
    assert read_node(redis_url, "n1") is None  # left the pool at once, not after the TTL


def test_redis_outage_and_recovery(sim: SimFactory, agent: AgentFactory) -> None:
    port = free_port()
    server = RedisServer(port=port).start()
    try:
        upstream = sim("--parallel", "4", "--speed", "20", "--metrics")
        gateway = agent("--upstream", upstream.url, redis=server.url)
        wait_until(lambda: read_node(server.url, "n1"), what="registered")
        server.kill()
        wait_until(lambda: status(gateway.url)["redis_ok"] is False, what="outage noticed")
        # still serving, under the cap
        assert httpx.post(gateway.url + "/v1/chat/completions", json=chat(5, stream=False)).status_code == 200
        server.close()
        server = RedisServer(port=port).start()  # back, and empty
        doc = wait_until(lambda: read_node(server.url, "n1"), timeout=20, what="re-registered")
        assert doc.state == "ready"
        assert status(gateway.url)["redis_ok"] is True
    finally:
        server.close()


def test_unreachable_upstream_keeps_starting_then_joins(
    sim: SimFactory, agent: AgentFactory, redis_url: str
) -> None:
    port = free_port()
    gateway = agent("--upstream", f"http://127.0.0.1:{port}")
    doc = wait_until(lambda: read_node(redis_url, "n1"), what="registered while starting")
    assert doc.state == "starting"
    refused = httpx.post(gateway.url + "/v1/chat/completions", json=chat(5))
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "node_unavailable"
    assert "127.0.0.1" not in refused.text
    sim("--parallel", "2", "--speed", "20", "--metrics", port=port)
    wait_until(lambda: (d := read_node(redis_url, "n1")) and d.state == "ready", what="ready once up")


def test_gguf_estimate_and_openai_shaped_errors(
    sim: SimFactory, agent: AgentFactory, redis_url: str, tmp_path: Path
) -> None:
    # a 14B-class shape: 48 layers x 8 KV heads x 128 x (2 + 2) bytes = 196,608 bytes per token
    model = write_gguf(tmp_path / "m.gguf", layers=48, heads=40, kv_heads=8, embd=5120)
    upstream = sim("--parallel", "2", "--ctx-size", "8192", "--speed", "20", "--metrics")
    gateway = agent("--upstream", upstream.url, "--model", str(model), "--memory-probe", "linux")
    doc = wait_until(lambda: (d := read_node(redis_url, "n1")) and d.state == "ready" and d, what="ready")
    assert status(gateway.url)["model"]["kv_bytes_per_token"] == 196608
    assert doc.memory.per_request_gb == pytest.approx(196608 * 4096 / 1e9 + 0.25, abs=1e-3)
    assert doc.memory.weights_gb == pytest.approx(model.stat().st_size / 1e9, abs=1e-3)
    assert doc.capacity_breakdown.memory is not None
    for path in ("/v1/nope", "/status/x"):
        response = httpx.get(gateway.url + path)
        assert response.status_code == 404
        assert json.loads(response.text)["error"]["code"] == "not_found"
    assert httpx.get(gateway.url + "/v1/chat/completions").status_code == 405
