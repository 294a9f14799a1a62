"""The router, met on the wire: a body's size (413) and the time to send it (408) are bounded by
the router itself, both OpenAI-shaped; an upgrade offer is answered over HTTP/1.1; a trailing slash names the
same path. (Bounds on a request's head are the fronting proxy's: tests/operator/test_operator_haproxy.py.)"""

from __future__ import annotations

import json
import time

import pytest

from tests.raw_http import at_eof, connect, exchange, head, read_reply
from tests.router.conftest import Pool

CHAT = json.dumps({"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}).encode()


pytestmark = pytest.mark.in_process  # none of these tests is about a process


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def test_a_body_too_large_or_too_slow_is_refused_before_admission(pool: Pool) -> None:
    router = pool.router("--max-body-bytes", "1000", "--request-read-timeout", "1")
    port = _port(router.url)
    # declared too large: answered before a byte of it is read
    reply = exchange(port, head("/v1/chat/completions", "Content-Length: 5000", method="POST"))
    assert reply.status == 413 and reply.error()["code"] == "request_too_large"
    # chunked, found too large while reading
    chunked = head("/v1/chat/completions", "Transfer-Encoding: chunked", method="POST")
    chunked += b"".join(b"200\r\n" + b"x" * 512 + b"\r\n" for _ in range(3)) + b"0\r\n\r\n"
    reply = exchange(port, chunked)
    assert reply.status == 413 and reply.error()["code"] == "request_too_large"
    # trickled: a 408 once the read bound has passed, and the connection ends (the rest is unread)
    with connect(port) as sock:
        sock.sendall(head("/v1/chat/completions", f"Content-Length: {len(CHAT)}", method="POST") + CHAT[:5])
        started = time.monotonic()
        reply = read_reply(sock)
        assert 0.8 < time.monotonic() - started < 5
        assert reply.status == 408 and reply.headers["connection"] == "close"
        error = reply.error()
        assert error["code"] == "request_timeout" and error["type"] == "timeout_error"
        assert at_eof(sock)
    # and the router is fine: a whole body in time gets the pool's answer (no node: 503)
    reply = exchange(port, head("/v1/chat/completions", f"Content-Length: {len(CHAT)}", method="POST") + CHAT)
    assert reply.status == 503 and reply.error()["code"] == "no_nodes"


WEBSOCKET = ("Connection: Upgrade", "Upgrade: websocket", "Sec-WebSocket-Version: 13",
             "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==")
H2C = ("Connection: Upgrade, HTTP2-Settings", "Upgrade: h2c", "HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA")


def test_upgrade_offers_are_answered_over_http_1_1(pool: Pool) -> None:
    router = pool.router()
    port = _port(router.url)
    # without a body: served as if the offer had not been made (RFC 9110 7.8), on the same connection
    with connect(port) as sock:
        for offer in (WEBSOCKET, H2C):
            sock.sendall(head("/v1/models", *offer))
            reply = read_reply(sock)
            assert reply.status == 200 and json.loads(reply.body)["object"] == "list"
    # with a body, which the server's parser would take for the new protocol's bytes: refused in JSON (the
    # fronting proxy drops the offer, so it never gets here), and the connection ends
    for offer in (WEBSOCKET, H2C):
        request = head("/v1/chat/completions", *offer, f"Content-Length: {len(CHAT)}", method="POST")
        reply = exchange(port, request + CHAT, then_closed=True)
        assert reply.status == 400 and reply.headers["connection"] == "close"
        assert reply.error()["code"] == "upgrade_not_supported"


def test_a_trailing_slash_names_the_same_path(pool: Pool) -> None:
    router = pool.router()
    port = _port(router.url)
    request = head("/v1/chat/completions/", f"Content-Length: {len(CHAT)}", method="POST") + CHAT
    reply = exchange(port, request)
    assert reply.status == 503 and reply.error()["code"] == "no_nodes"  # served, not redirected
    reply = exchange(port, head("/v1/models/?x=1"))
    assert (reply.status, reply.headers["location"]) == (307, "/v1/models?x=1")  # by path, on this host
    reply = exchange(port, head("/v1/nothing/"))
    assert reply.status == 307  # a page first gets its canonical path, then that path's own answer
    reply = exchange(port, head("/v1/nothing"))
    assert reply.status == 404 and reply.error()["code"] == "not_found"
