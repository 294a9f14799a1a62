"""macpool/serving.py: the uvicorn Config the router and the agent serve with, on a real server."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from starlette.types import Receive, Scope, Send

from macpool.dev.redis_server import free_port
from macpool.serving import server_config
from tests.raw_http import at_eof, connect, exchange, head, read_reply

KEEP_ALIVE_S = 1


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    """Reads the whole body, then answers how many bytes it had and how many header fields."""
    if scope["type"] != "http":
        return
    size, more = 0, True
    while more:
        message = await receive()
        size += len(message.get("body", b""))
        more = message.get("more_body", False)
    body = json.dumps({"body": size, "fields": len(scope["headers"])}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    port = free_port()
    config = server_config(app, keep_alive=KEEP_ALIVE_S, graceful_shutdown=1, host="127.0.0.1", port=port,
                           lifespan="off", log_level="error")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="served")
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started
    yield port
    server.should_exit = True
    thread.join(10)


def test_no_server_header_and_keep_alive(port: int) -> None:
    with connect(port) as sock:
        for _ in range(3):
            sock.sendall(head("/"))
            reply = read_reply(sock)
            assert reply.status == 200 and "server" not in reply.headers
        # an idle connection is closed after the keep-alive timeout
        started = time.monotonic()
        assert at_eof(sock)
        assert KEEP_ALIVE_S - 0.3 < time.monotonic() - started < KEEP_ALIVE_S + 3


def test_a_websocket_offer_is_served_over_http_1_1(port: int) -> None:
    # no WebSocket protocol: the request is answered as if the offer had not been made (RFC 9110 7.8)
    websocket = ("Connection: Upgrade", "Upgrade: websocket", "Sec-WebSocket-Version: 13",
                 "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==")
    with connect(port) as sock:
        sock.sendall(head("/", *websocket))
        assert read_reply(sock).status == 200
        sock.sendall(head("/"))
        assert json.loads(read_reply(sock).body) == {"body": 0, "fields": 1}


def test_a_request_the_parser_refuses_gets_a_400_and_the_connection_ends(port: int) -> None:
    # uvicorn's own answer, in plain text; the fronting proxy refuses most of these first, in JSON
    reply = exchange(port, b"GET / HTTP/1.1\r\nHost: test\r\nX-Bad: a\x01b\r\n\r\n", then_closed=True)
    assert reply.status == 400
    reply = exchange(port, head("/", "Content-Length: 5", "Transfer-Encoding: chunked", method="POST")
                     + b"0\r\n\r\n", then_closed=True)
    assert reply.status == 400
