"""The router process on the guarded protocol (macpool/http_guard.py): a head at the bounds goes through to
a node (whose agent allows for what the router adds to it), one past them gets 431 or 414, and what the
parser refuses gets a JSON 400; every refusal ends the connection."""

from __future__ import annotations

import json

from macpool.http_guard import MAX_HEAD_BYTES, MAX_HEADER_FIELDS, MAX_URL_BYTES
from tests.raw_http import exchange, filler, head
from tests.router.conftest import Pool


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def test_the_router_bounds_request_heads_and_answers_refusals_in_json(pool: Pool) -> None:
    pool.node("n1", cap=2)
    router = pool.router()
    pool.wait_ready(router, nodes=1)
    port = _port(router.url)
    body = json.dumps({"model": pool.model(router), "max_tokens": 2, "stream": False,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()

    # at the bounds: MAX_HEADER_FIELDS fields (Host, these two, fillers, X-Big) and MAX_HEAD_BYTES in all
    fields = ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    fields += filler(MAX_HEADER_FIELDS - 4)
    short = len(head("/v1/chat/completions", *fields, method="POST"))
    fields.append(f"X-Big: {'b' * (MAX_HEAD_BYTES - short - len('X-Big: ') - 2)}")
    at_bounds = head("/v1/chat/completions", *fields, method="POST")
    assert len(at_bounds) == MAX_HEAD_BYTES
    reply = exchange(port, at_bounds + body)
    assert reply.status == 200, reply
    assert json.loads(reply.body)["choices"][0]["message"]["content"] is not None

    reply = exchange(port, head("/v1/models", *filler(MAX_HEADER_FIELDS)), then_closed=True)
    assert reply.status == 431 and reply.error()["code"] == "headers_too_large"
    reply = exchange(port, head("/v1/models", "X-Big: " + "b" * 8_000_000), then_closed=True)
    assert reply.status == 431 and reply.error()["code"] == "headers_too_large"
    reply = exchange(port, head("/v1/models?" + "q" * MAX_URL_BYTES), then_closed=True)
    assert reply.status == 414 and reply.error()["code"] == "url_too_long"
    reply = exchange(port, head("/v1/models", method="BREW"), then_closed=True)
    error = reply.error()
    assert reply.status == 400 and error["code"] == "invalid_http_request"
    assert error["type"] == "invalid_request_error" and "method" in error["message"]

    # an upgrade to WebSocket is ignored (RFC 9110 7.8): the request is answered over HTTP/1.1 (uvicorn's
    # WebSocket protocol answered it in plain text, and a POST never, holding the connection past every bound)
    upgrade = ["Connection: Upgrade", "Upgrade: websocket", "Sec-WebSocket-Version: 13",
               "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ=="]
    reply = exchange(port, head("/v1/models", *upgrade))
    assert reply.status == 200 and json.loads(reply.body)["object"] == "list"
    reply = exchange(port, head("/v1/chat/completions", *upgrade, f"Content-Length: {len(body)}",
                                method="POST") + body)
    assert reply.status == 200 and json.loads(reply.body)["choices"]
