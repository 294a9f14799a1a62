"""macpool/upstream.py (the router's and the agent's upstream transport) against a real HTTP/1.1 server on a
free port, scripted byte for byte: what the relay paths rely on it for."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

import httpx
import pytest

from macpool.upstream import new_transport
from node_agent.agent import KEEP_ALIVE_S, UPSTREAM_IDLE_S
from router.forward import IDLE_S

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
NO_READ_TIMEOUT = {"connect": 5.0, "read": None, "write": 5.0, "pool": 5.0}


async def _request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    return head + await reader.readexactly(length)


class Server:
    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.tasks: set[asyncio.Task[None]] = set()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        try:
            await self.handler(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
            self.tasks.discard(task)


class Servers:
    """Scripted servers on free ports, all stopped (connections included) when the test's loop ends."""

    def __init__(self) -> None:
        self.started: list[tuple[Server, asyncio.Server]] = []

    async def __call__(self, handler: Handler) -> tuple[Server, str]:
        server = Server(handler)
        listening = await asyncio.start_server(server.serve, "127.0.0.1", 0)
        self.started.append((server, listening))
        port = listening.sockets[0].getsockname()[1]
        return server, f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        for server, listening in self.started:
            listening.close()
            for task in list(server.tasks):
                task.cancel()
            await asyncio.gather(*server.tasks, return_exceptions=True)
            await listening.wait_closed()


@pytest.fixture
def serve() -> Servers:
    return Servers()


def run(main: Coroutine[Any, Any, None], servers: Servers) -> None:
    async def scoped() -> None:
        try:
            await main
        finally:
            await servers.stop()

    asyncio.run(scoped())


async def send(
    transport: httpx.AsyncBaseTransport, method: str, url: str, content: bytes | AsyncIterator[bytes] = b"{}",
    timeouts: dict[str, float | None] = NO_READ_TIMEOUT, headers: list[tuple[bytes, bytes]] | None = None,
) -> httpx.Response:
    """The relay paths' call: an ``httpx.Request`` straight to the transport, no client around it."""
    request = httpx.Request(method, url, headers=headers, content=content, extensions={"timeout": timeouts})
    return await transport.handle_async_request(request)


async def answer_each(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, response: bytes) -> None:
    while True:
        await _request(reader)
        writer.write(response)


def test_idle_connections_expire_before_their_peer_closes_them() -> None:
    """A request written on a connection as the peer closes it for idleness gets no answer: the router gives
    an idle connection to an agent up before the agent does, and the agent before llama-server (5 s)."""
    assert IDLE_S < KEEP_ALIVE_S
    assert UPSTREAM_IDLE_S < 5.0


def test_a_connection_is_reused_while_fresh_and_given_up_after_keepalive_expiry(serve: Servers) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await answer_each(reader, writer, b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")

    async def main() -> None:
        server, url = await serve(handler)
        transport = new_transport(keepalive_expiry=0.5)
        try:
            for pause in (0.0, 0.1, 0.1, 1.2, 0.1):
                await asyncio.sleep(pause)
                response = await send(transport, "POST", url)
                assert await response.aread() == b"ok"
                await response.aclose()
        finally:
            await transport.aclose()
        assert server.connections == 2  # reused within 0.5 s of idleness, not after 1.2 s

    run(main(), serve)


def test_a_connection_the_server_closed_while_idle_is_not_reused(serve: Servers) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()  # then the server closes the connection, keep-alive or not

    async def main() -> None:
        server, url = await serve(handler)
        transport = new_transport(keepalive_expiry=30.0)
        try:
            for _ in range(3):
                response = await send(transport, "POST", url)
                assert await response.aread() == b"ok"
                await response.aclose()
                await asyncio.sleep(0.1)
        finally:
            await transport.aclose()
        assert server.connections == 3

    run(main(), serve)


def test_the_request_carries_the_callers_headers_and_no_cookie_from_an_earlier_answer(serve: Servers) -> None:
    seen: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            seen.append(await _request(reader))
            writer.write(b"HTTP/1.1 200 OK\r\nSet-Cookie: session=agent-a; Path=/\r\n"
                         b"Content-Length: 2\r\n\r\nok")

    async def main() -> None:
        _, url = await serve(handler)
        transport = new_transport(keepalive_expiry=30.0)
        try:
            for body in (b'{"a":1}', b'{"b":2}'):
                response = await send(transport, "POST", url + "/v1/chat/completions?x=1", body,
                                      headers=[(b"x-request-id", b"r-1")])
                assert response.status_code == 200 and await response.aread() == b"ok"
                await response.aclose()
        finally:
            await transport.aclose()
        first, second = (raw.split(b"\r\n\r\n")[0].lower().split(b"\r\n") for raw in seen)
        assert first[0] == b"post /v1/chat/completions?x=1 http/1.1"
        names = sorted(line.split(b":")[0] for line in second[1:])
        assert names == [b"content-length", b"host", b"x-request-id"]  # no cookie, nothing added
        assert seen[1].endswith(b'\r\n\r\n{"b":2}')

    run(main(), serve)


def test_closing_a_response_mid_body_closes_its_connection_at_once(serve: Servers) -> None:
    """A client that goes away closes the upstream response: llama-server cancels the task only when its
    connection closes."""
    closed = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n9\r\ndata: 1\n\n\r\n")
        await writer.drain()
        if await reader.read(1) == b"":
            closed.set()

    async def main() -> None:
        _, url = await serve(handler)
        transport = new_transport(keepalive_expiry=30.0)
        try:
            response = await send(transport, "POST", url)
            chunks = aiter(response.stream)  # type: ignore[arg-type]
            assert await anext(chunks) == b"data: 1\n\n"
            started = time.monotonic()
            await response.aclose()
            await asyncio.wait_for(closed.wait(), 5)
            assert time.monotonic() - started < 1.0
        finally:
            await transport.aclose()

    run(main(), serve)


def test_a_stream_has_no_read_timeout_unless_one_is_asked_for(serve: Servers) -> None:
    """The router reads a stream with no read timeout (its relay watchdog decides what a stall is); the agent
    with one (``--read-timeout``), counted from each read."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(4):
            writer.write(b"2\r\nok\r\n")
            await writer.drain()
            await asyncio.sleep(0.3)
        await asyncio.sleep(0.8)
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async def read(url: str, timeouts: dict[str, float | None]) -> bytes:
        transport = new_transport(keepalive_expiry=30.0)
        try:
            response = await send(transport, "POST", url, timeouts=timeouts)
            try:
                return await response.aread()
            finally:
                await response.aclose()
        finally:
            await transport.aclose()

    async def main() -> None:
        _, url = await serve(handler)
        assert await read(url, NO_READ_TIMEOUT) == b"ok" * 4
        with pytest.raises(httpx.ReadTimeout):  # each 0.3 s wait passes; the 0.8 s silence does not
            await read(url, {**NO_READ_TIMEOUT, "read": 0.5})

    run(main(), serve)


def test_failures_map_to_the_httpx_errors_the_relay_paths_handle(serve: Servers) -> None:
    """Refused: ConnectError (the router fails over, counting it against the node's circuit). Closed before
    any answer: RemoteProtocolError (the router fails over; the agent answers 503). Closed mid-body: ReadError
    (a stream ends with an error event)."""

    async def no_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _request(reader)

    async def half_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()

    async def main() -> None:
        transport = new_transport(keepalive_expiry=30.0)
        try:
            with pytest.raises(httpx.ConnectError):
                await send(transport, "POST", "http://127.0.0.1:1/")
            _, url = await serve(no_answer)
            with pytest.raises(httpx.RemoteProtocolError):
                await send(transport, "POST", url)
            _, url = await serve(half_answer)
            response = await send(transport, "POST", url)
            received = b""
            with pytest.raises(httpx.ReadError):
                async for part in response.stream:  # type: ignore[union-attr]
                    received += part
            await response.aclose()
            assert received == b"hello"
        finally:
            await transport.aclose()

    run(main(), serve)


def test_head_and_a_streamed_request_body_go_through(serve: Servers) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HEAD ")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n")
        head = await reader.readuntil(b"\r\n\r\n")
        assert b"transfer-encoding: chunked" in head.lower()
        assert await reader.readuntil(b"0\r\n\r\n") == b"4\r\npart\r\n0\r\n\r\n"
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        await reader.read(1)

    async def body() -> AsyncIterator[bytes]:
        yield b"part"

    async def main() -> None:
        _, url = await serve(handler)
        transport = new_transport(keepalive_expiry=30.0)
        try:
            response = await send(transport, "HEAD", url, b"")
            assert (response.status_code, await response.aread()) == (200, b"")
            await response.aclose()
            response = await send(transport, "POST", url, body())
            assert await response.aread() == b"ok"
            await response.aclose()
        finally:
            await transport.aclose()

    run(main(), serve)
