"""macpool/upstream.py (the router's and the agent's upstream client) against a real HTTP/1.1 server on a
free port, scripted byte for byte: what the relay paths rely on it for, through both of its APIs (httpx's,
and ``Upstream.send`` that the relays use)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

import httpx
import pytest

from macpool import upstream as http
from macpool.upstream import Upstream
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


class Api:
    """One of the client's two APIs, behind the calls the tests make."""

    def __init__(self, name: str, client: Upstream) -> None:
        self.name = name
        self.client = client

    async def send(
        self, method: str, url: str, content: bytes | AsyncIterator[bytes] = b"{}",
        timeouts: dict[str, float | None] = NO_READ_TIMEOUT, headers: list[tuple[bytes, bytes]] | None = None,
    ) -> Any:
        if self.name == "httpx":  # an ``httpx.Request`` straight to the transport, no client around it
            request = httpx.Request(method, url, headers=headers, content=content,
                                    extensions={"timeout": timeouts})
            return await self.client.handle_async_request(request)
        assert isinstance(content, bytes)
        limits = http.timeouts(timeouts["connect"], timeouts["read"], timeouts["pool"])
        return await self.client.send(method, http.url(url), http.as_str(headers or []), content, limits)

    def status(self, response: Any) -> int:
        return int(response.status_code if self.name == "httpx" else response.status)

    async def read(self, response: Any) -> bytes:
        if self.name == "httpx":
            try:
                return bytes(await response.aread())
            finally:
                await response.aclose()
        return await http.read(response)

    def chunks(self, response: Any) -> AsyncIterator[bytes]:
        return aiter(response.stream) if self.name == "httpx" else http.chunks(response)

    async def close(self, response: Any) -> None:
        if self.name == "httpx":
            await response.aclose()
        else:
            http.close(response)


@pytest.fixture(params=["httpx", "direct"])
def api(request: pytest.FixtureRequest) -> Callable[[float], Api]:
    return lambda keepalive_expiry: Api(request.param, Upstream(keepalive_expiry=keepalive_expiry))


async def answer_each(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, response: bytes) -> None:
    while True:
        await _request(reader)
        writer.write(response)


def test_idle_connections_expire_before_their_peer_closes_them() -> None:
    """A request written on a connection as the peer closes it for idleness gets no answer: the router gives
    an idle connection to an agent up before the agent does, and the agent before llama-server (5 s)."""
    assert IDLE_S < KEEP_ALIVE_S
    assert UPSTREAM_IDLE_S < 5.0


def test_a_connection_is_reused_while_fresh_and_given_up_after_keepalive_expiry(
    serve: Servers, api: Callable[[float], Api]
) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await answer_each(reader, writer, b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")

    async def main() -> None:
        server, url = await serve(handler)
        client = api(0.5)
        try:
            for pause in (0.0, 0.1, 0.1, 1.2, 0.1):
                await asyncio.sleep(pause)
                assert await client.read(await client.send("POST", url)) == b"ok"
        finally:
            await client.client.aclose()
        assert server.connections == 2  # reused within 0.5 s of idleness, not after 1.2 s

    run(main(), serve)


def test_a_connection_the_server_closed_while_idle_is_not_reused(
    serve: Servers, api: Callable[[float], Api]
) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()  # then the server closes the connection, keep-alive or not

    async def main() -> None:
        server, url = await serve(handler)
        client = api(30.0)
        try:
            for _ in range(3):
                assert await client.read(await client.send("POST", url)) == b"ok"
                await asyncio.sleep(0.1)
        finally:
            await client.client.aclose()
        assert server.connections == 3

    run(main(), serve)


def test_the_request_carries_the_callers_headers_and_no_cookie_from_an_earlier_answer(
    serve: Servers, api: Callable[[float], Api]
) -> None:
    seen: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            seen.append(await _request(reader))
            writer.write(b"HTTP/1.1 200 OK\r\nSet-Cookie: session=agent-a; Path=/\r\n"
                         b"Content-Length: 2\r\n\r\nok")

    async def main() -> None:
        _, url = await serve(handler)
        client = api(30.0)
        try:
            for body in (b'{"a":1}', b'{"b":2}'):
                response = await client.send("POST", url + "/v1/chat/completions?x=1", body,
                                             headers=[(b"x-request-id", b"r-1")])
                assert client.status(response) == 200 and await client.read(response) == b"ok"
        finally:
            await client.client.aclose()
        first, second = (raw.split(b"\r\n\r\n")[0].lower().split(b"\r\n") for raw in seen)
        assert first[0] == b"post /v1/chat/completions?x=1 http/1.1"
        names = sorted(line.split(b":")[0] for line in second[1:])
        assert names == [b"content-length", b"host", b"x-request-id"]  # no cookie, nothing added
        assert seen[1].endswith(b'\r\n\r\n{"b":2}')

    run(main(), serve)


def test_closing_a_response_mid_body_closes_its_connection_at_once(
    serve: Servers, api: Callable[[float], Api]
) -> None:
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
        client = api(30.0)
        try:
            response = await client.send("POST", url)
            assert await anext(client.chunks(response)) == b"data: 1\n\n"
            await client.close(response)
            await asyncio.wait_for(closed.wait(), 5)  # the server sees its connection closed
        finally:
            await client.client.aclose()

    run(main(), serve)


def test_a_stream_has_no_read_timeout_unless_one_is_asked_for(
    serve: Servers, api: Callable[[float], Api]
) -> None:
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
        client = api(30.0)
        try:
            return await client.read(await client.send("POST", url, timeouts=timeouts))
        finally:
            await client.client.aclose()

    async def main() -> None:
        _, url = await serve(handler)
        assert await read(url, NO_READ_TIMEOUT) == b"ok" * 4
        with pytest.raises(httpx.ReadTimeout):  # each 0.3 s wait passes; the 0.8 s silence does not
            await read(url, {**NO_READ_TIMEOUT, "read": 0.5})

    run(main(), serve)


def test_failures_map_to_the_httpx_errors_the_relay_paths_handle(
    serve: Servers, api: Callable[[float], Api]
) -> None:
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
        client = api(30.0)
        try:
            with pytest.raises(httpx.ConnectError):
                await client.send("POST", "http://127.0.0.1:1/")
            _, url = await serve(no_answer)
            with pytest.raises(httpx.RemoteProtocolError):
                await client.send("POST", url)
            _, url = await serve(half_answer)
            response = await client.send("POST", url)
            received = b""
            with pytest.raises(httpx.ReadError):
                async for part in client.chunks(response):
                    received += part
            await client.close(response)
            assert received == b"hello"
        finally:
            await client.client.aclose()

    run(main(), serve)


def test_head_and_a_streamed_request_body_go_through(serve: Servers) -> None:
    """Through httpx's API (the relays send bytes they have read whole)."""
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
        client = Api("httpx", Upstream(keepalive_expiry=30.0))
        try:
            response = await client.send("HEAD", url, b"")
            assert (client.status(response), await client.read(response)) == (200, b"")
            assert await client.read(await client.send("POST", url, body())) == b"ok"
        finally:
            await client.client.aclose()

    run(main(), serve)


def test_lines_come_whole_up_to_the_longest_asked_for(serve: Servers) -> None:
    """A stream the agent assembles ends with one event holding the whole answer (or prompt): far past
    aiohttp's own line limit, and read whole; past the bound given, a DecodingError (the agent's 502)."""
    long = b"data: " + b"x" * 1_000_000

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _request(reader)
        body = b"data: a\n\n" + long + b"\n\n"
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        await writer.drain()

    async def lines(url: str, longest: int) -> list[str]:
        client = Upstream(keepalive_expiry=1.0)
        try:
            limits = http.timeouts(5.0, 5.0)
            response = await client.send("POST", http.url(url), [], b"{}", limits)
            try:
                return [line async for line in http.lines(response, longest)]
            finally:
                http.close(response)
        finally:
            await client.aclose()

    async def main() -> None:
        _, url = await serve(handler)
        assert await lines(url, 2_000_000) == ["data: a", "", long.decode(), ""]
        with pytest.raises(httpx.DecodingError):
            await lines(url, 100_000)

    run(main(), serve)
