"""``--log-format json``: every line the router and the agent write is one JSON object, uvicorn's too."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from typing import Any

import httpx

from tests.conftest import chat, wait_until
from tests.operator.helpers import AGENT_TOKEN

SpawnFactory = Callable[..., Any]


def records(server: Any) -> list[dict[str, Any]]:
    lines = server.child.log_path.read_text().splitlines()
    parsed = [json.loads(line) for line in lines if line.strip()]  # a line that is not JSON fails here
    for record in parsed:
        assert set(record) >= {"ts", "level", "logger", "message"}, record
        assert "color_message" not in record and record["ts"].endswith("+00:00"), record
    return parsed


def test_router_and_agent_write_json_lines(redis_url: str, spawn: SpawnFactory) -> None:
    sim = spawn("sim", "--preset", "m5max-128g-14b-q4", "--alias", "op-model", "--speed", "50", name="sim")
    agent = spawn(
        "agent", "run", "--upstream", sim.url, "--redis-url", redis_url, "--node-id", "mac-1",
        "--token", AGENT_TOKEN, "--log-format", "json", "--log-level", "info", name="agent",
    )
    router = spawn(
        "router", "--redis-url", redis_url, "--agent-token", AGENT_TOKEN, "--log-format", "json",
        "--access-log", name="router",
    )
    wait_until(lambda: httpx.get(router.url + "/ready", timeout=5).status_code == 200)
    answer = httpx.post(router.url + "/v1/chat/completions", json=chat("op-model", 4, False), timeout=30)
    assert answer.status_code == 200, answer.text
    with socket.create_connection(("127.0.0.1", router.port), timeout=10) as sock:  # no parser takes it
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: r\r\nBad\x01Name: x\r\n\r\n")
        assert sock.recv(100).startswith(b"HTTP/1.1 400")
    # a node gone without a word (its heartbeat still fresh): the router's line names the node and the request
    agent.child.kill()
    agent_logged = records(agent)
    gone = httpx.post(router.url + "/v1/chat/completions", json=chat("op-model", 4, False), timeout=30,
                      headers={"X-Request-ID": "log-test-1"})
    assert gone.status_code in (502, 503), gone.text
    router.child.stop()

    logged = records(router)
    by_logger = {record["logger"] for record in logged}
    assert {"macpool.router", "uvicorn.error", "uvicorn.access"} <= by_logger, by_logger
    assert any("POST /v1/chat/completions" in r["message"] for r in logged if r["logger"] == "uvicorn.access")
    refused = [r for r in logged if r["message"] == "Invalid HTTP request received."]
    assert len(refused) == 1 and refused[0]["level"] == "WARNING" and refused[0]["logger"] == "uvicorn.error"
    assert any(r["message"].startswith("router ") and "serving" in r["message"] for r in logged)
    failed = [r for r in logged if "connect failed" in r["message"]]
    assert failed and failed[0]["node"] == "mac-1" and failed[0]["request_id"] == "log-test-1", failed
    assert {record["logger"] for record in agent_logged} >= {"macpool.agent"}
