"""The agent attached to the simulator, with a real Redis: heartbeat, cap, disconnect, drain, outage."""

from __future__ import annotations

import asyncio
import json
import random
import re
import signal
import socket
import string
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

from macpool.contract import heartbeat_ttl_ms
from macpool.dev.redis_server import RedisServer, free_port
from macpool.sim import tokens
from macpool.upstream import Upstream
from node_agent.gateway import create_app
from node_agent.runtime import AnswerClock, Runtime
from node_agent.settings import AgentSettings
from tests import stand_in
from tests.conftest import Server, metric
from tests.conftest import chat as shared_chat
from tests.inprocess import LocalStack
from tests.node_agent import failing_upstream, impatient_upstream
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
CHAT = "/v1/chat/completions"


def chat(max_tokens: int, stream: bool = True) -> dict[str, Any]:
    return shared_chat("model-14b-q4.gguf", max_tokens, stream, content="hello " * 50)


@pytest.mark.in_process
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


@pytest.mark.in_process
def test_hard_cap_under_three_times_the_cap_and_token(sim: SimFactory, agent: AgentFactory) -> None:
    upstream = sim("--parallel", "16", "--speed", "20", "--metrics")
    gateway = agent("--upstream", upstream.url, "--cap", "4", "--token", "s3cret-gateway-token")
    wait_until(lambda: status(gateway.url)["state"] == "ready", what="ready")
    # without the token (or with a wrong one): 401, nothing reaches llama-server
    for headers in ({}, {"X-Macpool-Token": "wrong"}, {"Authorization": "Bearer s3cret"}):
        denied = httpx.post(gateway.url + "/v1/chat/completions", json=chat(5), headers=headers)
        assert denied.status_code == 401
        assert denied.json()["error"]["code"] == "invalid_agent_token"
    responses = asyncio.run(_burst(gateway.url, 12, "s3cret-gateway-token"))
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


@pytest.mark.in_process
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


@pytest.mark.in_process
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



def _slow_agent_draining_1s(sim: SimFactory, agent: AgentFactory, redis_url: str) -> Server:
    upstream = sim("--parallel", "2", "--speed", "1")
    gateway = agent("--upstream", upstream.url, "--drain-timeout", "1")
    wait_until(lambda: (d := read_node(redis_url, "n1")) and d.state == "ready", what="ready")
    return gateway


def _log_once_stopped(gateway: Server) -> str:
    """The agent's log once it exited: the drain timed out, and no traceback nor ERROR line came of it."""
    assert gateway.child.process is not None
    gateway.child.process.wait(15)
    log = gateway.child.log_path.read_text() if gateway.child.log_path else ""
    assert "drain timeout" in log and "Exception in ASGI application" not in log, log
    # uvicorn's line for the request it cancels is a warning: a drain that times out pages nobody
    assert "WARNING uvicorn.error Cancel 1 running task(s), timeout graceful shutdown exceeded" in log, log
    assert " ERROR " not in log, log
    return log


def test_a_stream_outlasting_the_drain_timeout_ends_with_an_error_event(
    sim: SimFactory, agent: AgentFactory, redis_url: str
) -> None:
    gateway = _slow_agent_draining_1s(sim, agent, redis_url)
    with httpx.stream("POST", gateway.url + "/v1/chat/completions", json=chat(3000), timeout=30) as response:
        chunks = response.iter_raw()
        first = next(chunks)
        gateway.child.signal(signal.SIGTERM)
        rest = b"".join(chunks)  # ends, and completely: no half-read chunked body
    last = [line for line in (first + rest).decode().splitlines() if line.startswith("data: ")][-1]
    assert json.loads(last[len("data: "):])["error"]["code"] == "upstream_midstream", last
    _log_once_stopped(gateway)


def test_a_non_streamed_request_outlasting_the_drain_timeout_is_a_503_to_retry(
    sim: SimFactory, agent: AgentFactory, redis_url: str
) -> None:
    gateway = _slow_agent_draining_1s(sim, agent, redis_url)
    with httpx.Client(timeout=30) as client:
        url = gateway.url + "/v1/chat/completions"
        pending = client.build_request("POST", url, json=chat(3000, stream=False))
        timer = threading.Timer(0.5, gateway.child.signal, (signal.SIGTERM,))
        timer.start()
        answer = client.send(pending)
        timer.join()
    # nothing reached the client: a JSON 503 the router retries elsewhere, not a plain-text 500
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["code"] == "node_draining"
    assert answer.headers["x-macpool-reason"] == "node_draining" and answer.headers["retry-after"]
    _log_once_stopped(gateway)


def test_redis_outage_and_recovery(sim: SimFactory, agent: AgentFactory) -> None:
    port = free_port()
    server = RedisServer(port=port).start()
    try:
        upstream = sim("--parallel", "4", "--speed", "20", "--metrics")
        gateway = agent("--upstream", upstream.url, redis=server.url)
        wait_until(lambda: read_node(server.url, "n1"), what="registered")
        server.kill()
        wait_until(lambda: status(gateway.url)["redis_ok"] is False, what="outage noticed")
        log = gateway.child.log_path.read_text() if gateway.child.log_path else ""
        # refused, or timed out when the machine is too busy to refuse in time
        unreachable = rf"redis at 127\.0\.0\.1:{port} unreachable \((ConnectionError|TimeoutError): "
        assert re.search(unreachable, log), log
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


@pytest.mark.in_process
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
    wrong_method = httpx.get(gateway.url + "/v1/chat/completions")
    assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "POST"


def _words(count: int, seed: int) -> str:
    """A random text: no two prompts share a prefix, so the simulator prefills every one in full."""
    rng = random.Random(seed)
    return " ".join("".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 8))) for _ in range(count))


def _raw_request(url: str, body: bytes, sent: int | None = None) -> socket.socket:
    """A client socket that has sent a POST (its body's first ``sent`` bytes only, when given)."""
    port = int(url.rsplit(":", 1)[1])
    client = socket.create_connection(("127.0.0.1", port), timeout=10)
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: agent\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    client.sendall(head + body[:sent])
    return client


def _prefilling(url: str, count: int) -> None:
    """Wait for ``count`` tasks, then 1.5 s more: still prefilling (no token yet, so no response head)."""
    wait_until(lambda: sim_stats(url)["processing"] == count, timeout=10, what="prefill")
    time.sleep(1.5)
    stats = sim_stats(url)
    assert (stats["processing"], stats["tokens_predicted_total"]) == (count, 0), stats


def _capped_node(sim: SimFactory, agent: AgentFactory, cap: int, speed: str = "0.2") -> tuple[Server, Server]:
    """A simulator (slow by default: requests last seconds) behind a ready agent capped at ``cap``."""
    upstream = sim("--parallel", "4", "--speed", speed, "--metrics")
    gateway = agent("--upstream", upstream.url, "--cap", str(cap))
    wait_until(lambda: status(gateway.url)["state"] == "ready", what="ready")
    return upstream, gateway


def _freed_at_once(upstream: Server, gateway: Server, cancelled: int) -> None:
    """The clients just left: the agent's slots are free and llama-server's tasks cancelled within 0.5 s."""
    wait_until(lambda: status(gateway.url)["in_flight"] == 0, timeout=0.5, what="agent slots freed")
    wait_until(lambda: sim_stats(upstream.url)["processing"] == 0, timeout=0.5, what="upstream cancelled")
    assert sim_stats(upstream.url)["cancelled"] == cancelled


def _client_gone_count(gateway: Server) -> float:
    return metric(gateway.url, f'macpool_agent_requests_total{{endpoint="{CHAT}",status="499"}}')


@pytest.mark.in_process
def test_client_gone_before_the_first_byte_frees_the_slot_at_once(
    sim: SimFactory, agent: AgentFactory
) -> None:
    # two long prefills (~10 s each at --speed 0.2) fill a --cap 2 agent; their clients leave after 1.5 s
    upstream, gateway = _capped_node(sim, agent, cap=2)
    # one asks for a stream, one not (the agent asks llama-server for a stream on its behalf)
    bodies = [{**chat(50, stream), "messages": [{"role": "user", "content": _words(4000, seed)}]}
              for seed, stream in ((1, True), (2, False))]
    clients = [_raw_request(gateway.url, json.dumps(body).encode()) for body in bodies]
    _prefilling(upstream.url, 2)
    assert status(gateway.url)["in_flight"] == 2
    for client in clients:
        client.close()
    _freed_at_once(upstream, gateway, cancelled=2)
    assert _client_gone_count(gateway) == 2
    # the node takes the next request instead of calling itself full
    assert httpx.post(gateway.url + "/v1/chat/completions", json=chat(5, stream=False)).status_code == 200


@pytest.mark.in_process
def test_client_gone_while_a_reply_is_assembled_frees_the_slot_at_once(
    sim: SimFactory, agent: AgentFactory
) -> None:
    upstream, gateway = _capped_node(sim, agent, cap=1)
    client = _raw_request(gateway.url, json.dumps(chat(3000, stream=False)).encode())
    wait_until(lambda: sim_stats(upstream.url)["tokens_predicted_total"] > 0, timeout=10, what="tokens")
    assert status(gateway.url)["in_flight"] == 1
    client.close()
    _freed_at_once(upstream, gateway, cancelled=1)
    assert _client_gone_count(gateway) == 1


@pytest.mark.in_process
def test_client_gone_from_a_passed_through_request_frees_the_slot_at_once(
    sim: SimFactory, agent: AgentFactory
) -> None:
    # logprobs: passed through as asked (not streamed), so llama-server sends nothing until it is done
    upstream, gateway = _capped_node(sim, agent, cap=1)
    body = {**chat(1000, stream=False), "logprobs": True}
    client = _raw_request(gateway.url, json.dumps(body).encode())
    wait_until(lambda: sim_stats(upstream.url)["processing"] == 1, timeout=10, what="generating")
    time.sleep(1.5)
    assert status(gateway.url)["in_flight"] == 1
    client.close()
    _freed_at_once(upstream, gateway, cancelled=1)


@pytest.mark.in_process
def test_a_stalled_request_body_takes_no_slot(sim: SimFactory, agent: AgentFactory) -> None:
    _, gateway = _capped_node(sim, agent, cap=1, speed="20")
    body = json.dumps(chat(5, stream=False)).encode()
    stalled = _raw_request(gateway.url, body, sent=len(body) // 2)  # headers in, half the body, then nothing
    try:
        time.sleep(0.3)
        assert status(gateway.url)["in_flight"] == 0
        assert httpx.post(gateway.url + "/v1/chat/completions", json=chat(5, stream=False)).status_code == 200
        # the rest of the body arrives at last: the request is served like any other
        stalled.sendall(body[len(body) // 2 :])
        assert stalled.recv(65536).startswith(b"HTTP/1.1 200 ")
    finally:
        stalled.close()
    wait_until(lambda: status(gateway.url)["in_flight"] == 0, timeout=2, what="slot released")


@pytest.mark.in_process
def test_a_malformed_n_is_passed_through(sim: SimFactory, agent: AgentFactory) -> None:
    upstream = sim("--parallel", "2", "--speed", "20", "--metrics")
    gateway = agent("--upstream", upstream.url)
    wait_until(lambda: status(gateway.url)["state"] == "ready", what="ready")
    for n in ('"abc"', "[1]", "1e400"):  # a string, a list, a float that overflows int()
        body = json.dumps(chat(5, stream=False))[:-1] + f', "n": {n}}}'
        response = httpx.post(gateway.url + "/v1/chat/completions", content=body,
                              headers={"Content-Type": "application/json"})
        # llama-server (and the simulator) answers such an n with its own 400, passed on as it is
        assert response.status_code == 400, (n, response.text)
        assert response.json()["error"]["message"].startswith("Field 'n': ")
    assert status(gateway.url)["in_flight"] == 0


def test_an_unexpected_error_is_answered_as_openai_json_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    # nothing real fails this way on purpose: an upstream client that raises stands in for a bug
    class Broken(Upstream):
        async def send(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("a bug in the gateway")

    transport = Broken(keepalive_expiry=1.0)
    runtime = Runtime(AgentSettings(upstream="http://upstream"), upstream_url="http://upstream",
                      http=httpx.AsyncClient(transport=transport), upstream_transport=transport)
    runtime.capacity_decided("ready", capacity=1, total_slots=1)
    with TestClient(create_app(runtime), raise_server_exceptions=False) as client:
        response = client.post(CHAT, json=chat(5, stream=False))
    assert response.status_code == 500
    assert response.json()["error"] == {
        "message": "internal agent error", "type": "server_error", "code": "internal_error"
    }
    assert runtime.in_flight == 0
    logged = [record.exc_info[1] for record in caplog.records if record.exc_info]
    assert any("a bug in the gateway" in str(exc) for exc in logged)


def test_a_dead_llama_server_is_refused_as_unavailable_and_published_at_once(
    sim: SimFactory, agent: AgentFactory, redis_url: str
) -> None:
    port = free_port()
    upstream = sim("--parallel", "2", "--speed", "20", port=port)
    # heartbeats 5 s apart: what follows must not wait for the next one
    gateway = agent("--upstream", upstream.url, "--cap", "2", "--heartbeat-interval", "5")
    wait_until(lambda: (d := read_node(redis_url, "n1")) and d.state == "ready", what="ready")
    upstream.child.kill()
    refused = httpx.post(gateway.url + "/v1/chat/completions", json=chat(5), timeout=10)
    # 503, not 502: the router tries another node for it
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "node_unavailable", refused.text
    assert refused.headers["retry-after"] and "127.0.0.1" not in refused.text
    wait_until(lambda: (d := read_node(redis_url, "n1")) and d.state == "unhealthy", timeout=2,
               what="unhealthy published before the next heartbeat")
    assert status(gateway.url)["admitting"] is False
    sim("--parallel", "2", "--speed", "20", port=port)
    wait_until(lambda: (d := read_node(redis_url, "n1")) and d.state == "ready", timeout=15, what="back")
    assert httpx.post(gateway.url + "/v1/chat/completions", json=chat(5), timeout=10).status_code == 200


@pytest.mark.in_process
def test_each_generation_of_a_request_holds_a_slot(sim: SimFactory, agent: AgentFactory) -> None:
    # several prompts or n > 1: llama-server runs each generation in a slot of its own, with its memory
    upstream = sim("--parallel", "8", "--speed", "20", "--metrics")
    gateway = agent("--upstream", upstream.url, "--cap", "3")
    wait_until(lambda: status(gateway.url)["state"] == "ready" and status(gateway.url)["capacity"] == 3,
               what="ready")
    with httpx.stream("POST", gateway.url + CHAT, json=chat(6000), timeout=30) as held:
        chunks = held.iter_raw()  # keep the generator: dropping it closes the stream
        next(chunks)
        completions = {"model": "model-14b-q4.gguf", "prompt": ["a", "b", "c"], "max_tokens": 5}
        for path, body in ((CHAT, {**chat(5, stream=False), "n": 3}), ("/v1/completions", completions),
                           (CHAT, {**chat(5), "n_cmpl": 3})):
            refused = httpx.post(gateway.url + path, json=body, timeout=10)
            assert refused.status_code == 503, (path, body)
            assert refused.json()["error"]["code"] == "node_full"
        too_many = httpx.post(gateway.url + CHAT, json={**chat(5), "n": 4}, timeout=10)
        assert too_many.status_code == 503
        assert too_many.json()["error"]["message"].endswith("this node runs at most 3")
        assert sim_stats(upstream.url)["processing"] == 1  # none of them reached llama-server
        # two generations fit beside the held stream: counted as two while they run
        with httpx.stream("POST", gateway.url + CHAT, json={**chat(2000), "n": 2}, timeout=30) as pair:
            assert pair.status_code == 200
            pair_chunks = pair.iter_raw()
            next(pair_chunks)
            assert status(gateway.url)["in_flight"] == 3
            assert httpx.post(gateway.url + CHAT, json=chat(5), timeout=10).status_code == 503
        wait_until(lambda: status(gateway.url)["in_flight"] == 1, timeout=2, what="both slots given back")
    wait_until(lambda: status(gateway.url)["in_flight"] == 0, timeout=2, what="all slots given back")


@pytest.mark.in_process
def test_a_non_streamed_request_counts_in_the_ttft_histogram_as_in_the_heartbeats_p50(
    sim: SimFactory, agent: AgentFactory
) -> None:
    # the agent asks llama-server for a stream and folds it: it sees the first token, as for a stream, and
    # the histogram on /metrics must describe the same requests as the TTFT p50 on the dashboard
    upstream = sim("--parallel", "4", "--speed", "20", "--metrics")
    gateway = agent("--upstream", upstream.url)
    wait_until(lambda: status(gateway.url)["state"] == "ready", what="ready")
    for _ in range(2):
        answer = httpx.post(gateway.url + CHAT, json=chat(5, stream=False), timeout=30)
        assert answer.status_code == 200 and answer.json()["object"] == "chat.completion"
    assert metric(gateway.url, "macpool_agent_ttft_seconds_count") == 2
    assert metric(gateway.url, f'macpool_agent_requests_total{{endpoint="{CHAT}",status="200"}}') == 2
    wait_until(lambda: status(gateway.url)["node"]["ttft_p50_ms"] is not None, what="TTFT p50 heartbeat")


@pytest.mark.in_process
def test_a_folded_request_that_fails_is_counted_with_the_status_it_got(
    local_stack: LocalStack, agent: AgentFactory
) -> None:
    upstream = local_stack.serve("failing-upstream", stand_in.app("failing", failing_upstream.ROUTES))
    gateway = agent("--upstream", upstream.url)
    wait_until(lambda: status(gateway.url)["state"] == "ready", what="ready")
    failed = httpx.post(gateway.url + CHAT, json=shared_chat(stream=False, content="error"), timeout=30)
    assert failed.status_code == 500 and failed.json()["error"]["message"] == "boom"
    cut = httpx.post(gateway.url + CHAT, json=shared_chat(stream=False), timeout=30)
    assert cut.status_code == 502 and cut.json()["error"]["code"] == "upstream_midstream"
    requests = f'macpool_agent_requests_total{{endpoint="{CHAT}",status="%s"}}'
    assert metric(gateway.url, requests % "500") == 1
    assert metric(gateway.url, requests % "502") == 1
    assert metric(gateway.url, 'macpool_agent_upstream_errors_total{kind="mid_response"}') == 1


@pytest.mark.in_process
def test_a_connection_llama_server_closed_while_idle_costs_no_request(
    local_stack: LocalStack, agent: AgentFactory, redis_url: str
) -> None:
    """llama-server closes an idle connection after a few seconds: the agent's next request must not be
    written on it (it would get no answer, and the node would call itself unavailable)."""
    impatient = stand_in.app("impatient", impatient_upstream.ROUTES)
    upstream = local_stack.serve("impatient", impatient, keep_alive=1)  # closes an idle connection after 1 s
    gateway = agent("--upstream", upstream.url, "--cap", "2", "--heartbeat-interval", "5")
    wait_until(lambda: (d := read_node(redis_url, "n1")) and d.state == "ready", what="ready")
    body = {"model": "impatient", "messages": [{"role": "user", "content": "hi"}]}
    with httpx.Client(base_url=gateway.url, timeout=10) as client:
        for _ in range(3):
            answer = client.post(CHAT, json=body)
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["message"]["content"] == "a"
            time.sleep(1.5)  # the stand-in closes the agent's idle connection meanwhile
    assert status(gateway.url)["admitting"] is True


def timed_decode_speed(body: bytes) -> float:
    """A streamed answer's decode speed as llama-server's timings tell it, in wall time (``--speed 2``)."""
    final = next(line for line in reversed(body.split(b"\n")) if b'"timings"' in line)
    return float(json.loads(final.removeprefix(b"data: "))["timings"]["predicted_per_second"]) * 2


def test_heartbeat_tells_the_decode_speed_of_one_slot(
    sim: SimFactory, agent: AgentFactory, redis_url: str
) -> None:
    upstream = sim("--parallel", "4", "--speed", "2")
    gateway = agent("--upstream", upstream.url)
    wait_until(lambda: status(gateway.url)["state"] == "ready", what="ready")
    with httpx.stream("POST", gateway.url + CHAT, json=chat(100), timeout=30) as response:
        body = b"".join(response.iter_raw())
    decode = timed_decode_speed(body)
    doc = wait_until(lambda: (d := read_node(redis_url, "n1")) and d.slot_tokens_per_s and d, what="speed")
    # the answer's own decode speed as llama-server's timings tell it, seen from the gateway
    assert doc.slot_tokens_per_s is not None and 0.8 < doc.slot_tokens_per_s / decode < 1.25
    assert doc.slot_concurrency == 1


def test_a_stall_for_another_requests_prompt_is_not_decode_speed(
    sim: SimFactory, agent: AgentFactory, redis_url: str
) -> None:
    upstream = sim("--parallel", "2", "--speed", "2")
    gateway = agent("--upstream", upstream.url)
    wait_until(lambda: status(gateway.url)["state"] == "ready", what="ready")
    long_prompt = shared_chat("model-14b-q4.gguf", 1, content=tokens.filler(6000))
    seen: list[float] = []  # when each event of the first answer came
    with httpx.Client(base_url=gateway.url, timeout=60) as client:
        with client.stream("POST", CHAT, json=chat(200)) as answer:
            other = None
            for line in answer.iter_lines():
                if line.startswith("data: "):
                    seen.append(time.perf_counter())
                if len(seen) == 20 and other is None:
                    # a 6,000-token prompt: llama-server's steps process it beside the answer, ~1 s of them
                    other = threading.Thread(target=client.post, args=(CHAT,), kwargs={"json": long_prompt})
                    other.start()
        assert other is not None
        other.join(30)
        doc = wait_until(lambda: (d := read_node(redis_url, "n1")) and d.slot_tokens_per_s and d,
                         what="speed")
        mean = (len(seen) - 1) / (seen[-1] - seen[0])  # the answer's tokens per second, stall included
        # then an answer alone: its decode speed, as llama-server's timings tell it
        body = client.post(CHAT, json=chat(200)).content
    alone = timed_decode_speed(body)
    assert doc.slot_tokens_per_s is not None
    assert mean < 0.75 * alone  # the stall was there, and long
    assert 0.8 < doc.slot_tokens_per_s / alone < 1.25  # and the slot's decode speed leaves it out


def test_slot_speed_is_smoothed_over_answers_long_enough_to_say() -> None:
    runtime = Runtime(AgentSettings(upstream="http://upstream"), upstream_url="http://upstream")
    runtime.note_decode([0.02] * 5, 1)  # too few tokens to tell a decode speed
    assert runtime.slot_tokens_per_s is None
    runtime.note_decode([0.02] * 100, 1)  # 100 tokens after the first, 20 ms apart, alone
    assert (runtime.slot_tokens_per_s, runtime.slot_concurrency) == (50.0, 1)
    # 10 ms apart but for two steps that processed other requests' prompts: those are not decode speed
    runtime.note_decode([0.01] * 98 + [1.5, 1.5], 6)
    assert (runtime.slot_tokens_per_s, runtime.slot_concurrency) == (60.0, 2.0)
    runtime.note_decode([0.0] * 100, 6)  # (every event came in one read: no time to divide by)
    assert (runtime.slot_tokens_per_s, runtime.slot_concurrency) == (60.0, 2.0)


def test_the_answer_clock_shares_a_chunks_gap_among_its_events() -> None:
    clock = AnswerClock()
    assert clock.tick(1.0, 0, 3) is False  # no event yet (a comment, or an event cut in two)
    assert clock.tick(2.0, 1, 3) is True  # the first token
    assert clock.tick(2.5, 0, 4) is False  # the rest of an event cut in two: no token
    assert clock.tick(3.0, 2, 4) is False  # two tokens read at once
    assert (clock.last_at, clock.running, clock.events, clock.gaps) == (3.0, 3, 3, [0.5, 0.5])
