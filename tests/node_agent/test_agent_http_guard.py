"""The agent process on the guarded protocol (macpool/http_guard.py): bounds on a request's head (a little
above the router's, for the fields a router adds), JSON refusals, and a bound on reading a request."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from macpool.http_guard import AGENT_HEAD_LIMITS, MAX_HEADER_FIELDS
from tests.conftest import Server
from tests.node_agent.helpers import AgentFactory
from tests.raw_http import at_eof, connect, exchange, filler, head

TOKEN = "agent-guard-token"


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def test_the_agent_bounds_request_heads_and_answers_refusals_in_json(
    sim: Callable[..., Server], agent: AgentFactory
) -> None:
    gateway = agent("--upstream", sim().url, "--token", TOKEN)
    port = _port(gateway.url)
    reply = exchange(port, head("/health", *filler(MAX_HEADER_FIELDS + 8)))  # a router's fields on top
    assert reply.status == 200
    reply = exchange(port, head("/health", *filler(AGENT_HEAD_LIMITS.fields)), then_closed=True)
    assert reply.status == 431 and reply.error()["code"] == "headers_too_large"
    reply = exchange(port, head("/health", "X-Big: " + "b" * 8_000_000), then_closed=True)
    assert reply.status == 431 and reply.error()["code"] == "headers_too_large"
    negative = head("/v1/chat/completions", "Content-Length: -1", method="POST")
    reply = exchange(port, negative, then_closed=True)
    assert reply.status == 400 and reply.error()["code"] == "invalid_http_request"
    # an upgrade is ignored (RFC 9110 7.8): served over HTTP/1.1, not by uvicorn's WebSocket protocol
    upgrade = head("/health", "Connection: Upgrade", "Upgrade: websocket", "Sec-WebSocket-Version: 13",
                   "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==")
    reply = exchange(port, upgrade)
    assert reply.status == 200 and json.loads(reply.body) == {"status": "ok"}


def test_the_agent_cuts_off_a_request_that_is_not_sent_in_time(
    sim: Callable[..., Server], agent: AgentFactory
) -> None:
    gateway = agent("--upstream", sim().url, "--token", TOKEN, "--request-read-timeout", "1")
    port = _port(gateway.url)
    body = json.dumps({"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}).encode()
    stalled_body = head("/v1/chat/completions", f"X-Macpool-Token: {TOKEN}", f"Content-Length: {len(body)}",
                        method="POST") + body[:5]
    stalled_head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\n"
    for partial in (stalled_body, stalled_head, b""):
        with connect(port) as sock:
            started = time.monotonic()
            sock.sendall(partial)
            assert at_eof(sock)  # within the socket's timeout (10 s)
            assert time.monotonic() - started < 5
    reply = exchange(port, head("/health"))  # the agent itself is fine
    assert reply.status == 200
