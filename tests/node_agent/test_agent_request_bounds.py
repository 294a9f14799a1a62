"""The agent met on the wire: a body not sent within --request-read-timeout gets an OpenAI-shaped
408 (holding no slot meanwhile), and an upgrade offer is answered over HTTP/1.1."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import pytest

from tests.conftest import Server, wait_until
from tests.node_agent.helpers import AgentFactory, status
from tests.raw_http import at_eof, connect, exchange, head, read_reply

TOKEN = "agent-bounds-token"

pytestmark = pytest.mark.in_process  # neither test is about a process


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def test_the_agent_answers_a_body_not_sent_in_time_with_a_408(
    sim: Callable[..., Server], agent: AgentFactory
) -> None:
    gateway = agent("--upstream", sim().url, "--token", TOKEN, "--request-read-timeout", "1")
    port = _port(gateway.url)
    # admitting: a starting agent refuses at once, before it reads a body
    wait_until(lambda: status(gateway.url)["state"] == "ready")
    body = json.dumps({"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}).encode()
    stalled = head("/v1/chat/completions", f"X-Macpool-Token: {TOKEN}", f"Content-Length: {len(body)}",
                   method="POST") + body[:5]
    with connect(port) as sock:
        sock.sendall(stalled)
        started = time.monotonic()
        assert status(gateway.url)["in_flight"] == 0  # no slot while the body trickles in
        reply = read_reply(sock)
        assert 0.8 < time.monotonic() - started < 5
        assert reply.status == 408 and reply.headers["connection"] == "close"
        assert reply.error()["code"] == "request_timeout"
        assert at_eof(sock)
    assert status(gateway.url)["in_flight"] == 0
    reply = exchange(port, head("/health"))  # the agent itself is fine
    assert reply.status == 200


def test_the_agent_answers_an_upgrade_offer_over_http_1_1(
    sim: Callable[..., Server], agent: AgentFactory
) -> None:
    gateway = agent("--upstream", sim().url, "--token", TOKEN)
    upgrade = head("/health", "Connection: Upgrade", "Upgrade: websocket", "Sec-WebSocket-Version: 13",
                   "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==")
    with connect(_port(gateway.url)) as sock:
        sock.sendall(upgrade)
        reply = read_reply(sock)
        assert reply.status == 200 and json.loads(reply.body) == {"status": "ok"}
        sock.sendall(head("/health"))
        assert read_reply(sock).status == 200
