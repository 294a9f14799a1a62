"""The guarded HTTP protocol (macpool/http_guard.py) on a real server, fed raw bytes: bounds on a request's
head, JSON answers to what the parser refuses, and answers a client still sending can read."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from starlette.types import Receive, Scope, Send

from macpool.http_guard import MAX_HEAD_BYTES, MAX_HEADER_FIELDS, MAX_URL_BYTES, read_bounded_protocol
from macpool.redis_server import free_port
from tests.raw_http import at_eof, connect, exchange, filler, head, read_reply


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    """Reads the whole body, then answers how many bytes it had and how many header fields."""
    if scope["type"] != "http":
        return
    size, more = 0, True
    while more:
        message = await receive()
        size += len(message.get("body", b""))
        more = message.get("more_body", False)
    if scope["path"] == "/slow":
        await asyncio.sleep(0.3)
    body = json.dumps({"body": size, "fields": len(scope["headers"])}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    """A server on the guarded protocol, in a thread of this process."""
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, http=read_bounded_protocol(30.0),
                            lifespan="off", log_level="error")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="guarded-server")
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started
    yield port
    server.should_exit = True
    thread.join(10)


def test_a_head_over_the_bound_is_answered_431_before_it_ends(port: int) -> None:
    with connect(port) as sock:
        # a header that has not ended yet: the answer does not wait for the rest
        sock.sendall(b"GET / HTTP/1.1\r\nHost: test\r\nX-Big: " + b"a" * MAX_HEAD_BYTES)
        reply = read_reply(sock)
        assert reply.status == 431 and reply.headers["connection"] == "close"
        error = reply.error()
        assert error["code"] == "headers_too_large" and error["type"] == "invalid_request_error"
        assert str(MAX_HEAD_BYTES) in error["message"]
        assert at_eof(sock)


def test_header_fields_are_counted(port: int) -> None:
    most = head("/", *filler(MAX_HEADER_FIELDS - 1))  # with Host: exactly the bound
    reply = exchange(port, most)
    assert reply.status == 200 and json.loads(reply.body)["fields"] == MAX_HEADER_FIELDS
    reply = exchange(port, head("/", *filler(MAX_HEADER_FIELDS)), then_closed=True)
    assert reply.status == 431 and reply.error()["code"] == "headers_too_large"
    reply = exchange(port, head("/", *filler(2000)), then_closed=True)
    assert reply.status == 431


def test_the_bound_is_per_request_and_the_body_does_not_count(port: int) -> None:
    body = b"x" * 300_000
    big = head("/", *filler(1, MAX_HEAD_BYTES - 200), f"Content-Length: {len(body)}", method="POST")
    assert MAX_HEAD_BYTES - 200 < len(big) <= MAX_HEAD_BYTES
    with connect(port) as sock:
        sock.sendall(big + body)  # head and body in the same writes
        reply = read_reply(sock)
        assert reply.status == 200 and json.loads(reply.body)["body"] == len(body)
        sock.sendall(big + body)  # the next request on the connection starts a count of its own
        assert read_reply(sock).status == 200
        sock.sendall(head("/", *filler(1, MAX_HEAD_BYTES)))
        reply = read_reply(sock)
        assert reply.status == 431 and at_eof(sock)


def test_a_long_request_target_is_answered_414(port: int) -> None:
    reply = exchange(port, head("/" + "a" * (MAX_URL_BYTES - 1)))
    assert reply.status == 200
    reply = exchange(port, head("/" + "a" * MAX_URL_BYTES), then_closed=True)
    assert reply.status == 414
    error = reply.error()
    assert error["code"] == "url_too_long" and error["type"] == "invalid_request_error"
    reply = exchange(port, head("/" + "a" * 100_000), then_closed=True)
    assert reply.status == 414


def test_a_trailer_counts_like_a_head(port: int) -> None:
    chunked = head("/", "Transfer-Encoding: chunked", method="POST") + b"5\r\nhello\r\n0\r\n"
    reply = exchange(port, chunked + b"X-Trailer: small\r\n\r\n")
    assert reply.status == 200 and json.loads(reply.body)["body"] == 5
    reply = exchange(port, chunked + b"X-Trailer: " + b"t" * 1_000_000 + b"\r\n\r\n", then_closed=True)
    assert reply.status == 431 and reply.error()["code"] == "headers_too_large"


@pytest.mark.parametrize(
    ("request_bytes", "reason"),
    [
        (b"BREW / HTTP/1.1\r\nHost: test\r\n\r\n", "Invalid method"),
        (b"GET / HTTP/1.1\r\nHost: test\r\nX-Bad: a\x01b\r\n\r\n", "Invalid header value char"),
        (head("/", "Content-Length: 5", "Transfer-Encoding: chunked", method="POST") + b"0\r\n\r\n",
         "Transfer-Encoding"),
        (head("/", "Content-Length: -1", method="POST"), "Content-Length"),
        (head("/", "Content-Length: 1", "Content-Length: 2", method="POST") + b"ab", "Duplicate"),
        # in the body, while the application reads it
        (head("/", "Transfer-Encoding: chunked", method="POST") + b"5\r\nhello\r\nZZ\r\n", "chunk size"),
    ],
    ids=["unknown-method", "control-character", "length-and-chunked", "negative-length", "two-lengths",
         "bad-chunk"],
)
def test_parser_refusals_are_answered_400_in_json(port: int, request_bytes: bytes, reason: str) -> None:
    reply = exchange(port, request_bytes, then_closed=True)
    assert reply.status == 400 and reply.headers["connection"] == "close"
    error = reply.error()
    assert error["code"] == "invalid_http_request" and error["type"] == "invalid_request_error"
    assert reason in error["message"]


H2C = ("Connection: Upgrade, HTTP2-Settings", "Upgrade: h2c", "HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA")


def test_an_upgrade_offer_is_served_over_http_1_1_with_its_body(port: int) -> None:
    # as if it had not been made (RFC 9110 7.8): llhttp stops at the end of an upgrade's head, and uvicorn
    # answered the request as if it had no body, then read the body as the next request
    body = b"x" * 1000
    sized = head("/", *H2C, f"Content-Length: {len(body)}", method="POST")
    chunked = head("/", *H2C, "Transfer-Encoding: chunked", method="POST")
    chunked += b"3e8\r\n" + body + b"\r\n0\r\n\r\n"
    with connect(port) as sock:
        sock.sendall(sized + body + chunked + head("/"))  # pipelined
        answers = b""
        while answers.count(b'{"body"') < 3:
            chunk = sock.recv(65536)
            assert chunk, f"the connection closed after {answers!r}"
            answers += chunk
        assert re.findall(rb'"body": (\d+)', answers) == [b"1000", b"1000", b"0"]
        sock.sendall(sized)
        time.sleep(0.1)
        sock.sendall(body)  # the body in a write of its own (Ktor's clients)
        reply = read_reply(sock)
        # the offer is gone: Host, Connection (HTTP2-Settings), HTTP2-Settings, Content-Length
        assert json.loads(reply.body) == {"body": 1000, "fields": 4}
    websocket = ("Connection: Upgrade", "Upgrade: websocket", "Sec-WebSocket-Version: 13",
                 "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==", "Content-Length: 5")
    reply = exchange(port, head("/", *websocket, method="POST") + b"hello")
    assert reply.status == 200 and json.loads(reply.body)["body"] == 5


def test_a_client_still_sending_reads_the_answer(port: int) -> None:
    # closing a connection with unread bytes resets it, and the reset would destroy the answer: the
    # server reads and drops what the client still sends instead
    with connect(port) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: test\r\nX-Huge: " + b"h" * 32_000_000)
        reply = read_reply(sock)
        assert reply.status == 431 and at_eof(sock)
    reply = exchange(port, head("/"))  # and the server is fine
    assert reply.status == 200


def test_a_refusal_behind_a_response_being_made_waits_for_it(port: int) -> None:
    # pipelined: an answer written at once would be read as the first request's response
    with connect(port) as sock:
        sock.sendall(head("/slow") + b"BREW / HTTP/1.1\r\n\r\n")
        reply = read_reply(sock)
        assert reply.status == 200 and json.loads(reply.body)["fields"] == 1
        assert at_eof(sock)


def test_each_refusal_is_logged_once_with_its_reason(port: int) -> None:
    logger = logging.getLogger("uvicorn.error")  # where uvicorn logs a request its parser refused
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    try:
        assert exchange(port, head("/" + "a" * MAX_URL_BYTES), then_closed=True).status == 414
        assert exchange(port, head("/", *filler(MAX_HEADER_FIELDS)), then_closed=True).status == 431
        big = b"GET / HTTP/1.1\r\nX-Big: " + b"a" * MAX_HEAD_BYTES
        assert exchange(port, big, then_closed=True).status == 431
        assert exchange(port, b"BREW / HTTP/1.1\r\nHost: test\r\n\r\n", then_closed=True).status == 400
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    # not uvicorn's "Invalid HTTP request received." (which a 431 or 414 is not) on top
    assert [record.getMessage() for record in records] == [
        f"Request refused: 414 Request target over {MAX_URL_BYTES} bytes",
        f"Request refused: 431 More than {MAX_HEADER_FIELDS} request header fields",
        f"Request refused: 431 Request header fields over {MAX_HEAD_BYTES} bytes",
        "Request refused: 400 Invalid HTTP request: Invalid method encountered",
    ]
