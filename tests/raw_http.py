"""Raw HTTP/1.1 over a socket, for tests of what a server does with bytes no HTTP client would send."""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from typing import Any


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def error(self) -> dict[str, Any]:
        """The OpenAI-shaped error of a JSON reply."""
        assert self.headers["content-type"] == "application/json", self
        error: dict[str, Any] = json.loads(self.body)["error"]
        return error


def connect(port: int, timeout: float = 10.0) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=timeout)


def read_reply(sock: socket.socket) -> Reply:
    """One response with a Content-Length body (what every server under test sends)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a response head: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines, headers = parse_head(head)
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "connection closed inside a response body"
        body += chunk
    assert len(body) == length, "bytes after the response"
    return Reply(int(lines[0].split()[1]), headers, body)


def at_eof(sock: socket.socket) -> bool:
    """Whether the server has ended the connection (nothing more to read, end of stream)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def exchange(port: int, data: bytes, *, then_closed: bool = False) -> Reply:
    """Send ``data`` on a new connection and read the reply; with ``then_closed``, check that the server
    ended the connection after it."""
    with connect(port) as sock:
        sock.sendall(data)
        reply = read_reply(sock)
        if then_closed:
            assert at_eof(sock), "the connection is still open"
        return reply


def head(target: str = "/", *fields: str, method: str = "GET") -> bytes:
    """A request head: the request line, ``Host`` and ``fields``."""
    lines = [f"{method} {target} HTTP/1.1", "Host: test", *fields, "", ""]
    return "\r\n".join(lines).encode()


def filler(count: int, size: int = 1) -> list[str]:
    """``count`` header fields, each with a value of ``size`` bytes."""
    return [f"X-Filler-{i}: {'v' * size}" for i in range(count)]


def parse_head(head: bytes) -> tuple[list[str], dict[str, str]]:
    """A response head's lines and its headers (lower-case names; the last of a repeated one)."""
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return lines, headers
