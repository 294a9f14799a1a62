"""macpool/transport.py against a real HTTP/1.1 server on a free port, scripted byte for byte."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest

from macpool.transport import HTTP11Transport

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    return head + await reader.readexactly(length)


class Server:
    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@pytest.fixture
def serve() -> Callable[[Handler], Awaitable[tuple[Server, str]]]:
    servers: list[asyncio.Server] = []

    async def start(handler: Handler) -> tuple[Server, str]:
        server = Server(handler)
        listening = await asyncio.start_server(server._serve, "127.0.0.1", 0)
        servers.append(listening)
        port = listening.sockets[0].getsockname()[1]
        return server, f"http://127.0.0.1:{port}"

    yield start
    for listening in servers:
        listening.close()


def run(coro: Awaitable[None]) -> None:
    asyncio.run(coro)


@pytest.fixture
def client() -> Callable[[], httpx.AsyncClient]:
    return lambda: httpx.AsyncClient(transport=HTTP11Transport(), timeout=5.0)


def test_keep_alive_reuses_one_connection_and_sends_one_request_per_call(serve, client) -> None:
    seen: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            seen.append(await _request(reader))
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")

    async def main() -> None:
        server, url = await serve(handler)
        async with client() as http:
            for _ in range(3):
                response = await http.post(url + "/v1/x?a=1", content=b'{"q":1}', headers={"X-Id": "7"})
                assert (response.status_code, response.content, response.reason_phrase) == (200, b"{}", "OK")
        assert server.connections == 1
        first = seen[0]
        assert first.startswith(b"POST /v1/x?a=1 HTTP/1.1\r\n")
        assert b"\r\nX-Id: 7\r\n" in first and first.endswith(b'\r\n\r\n{"q":1}')

    run(main())


def test_post_writes_the_request_from_its_bytes_on_the_same_connections(serve) -> None:
    """``post`` (the relay paths' call): request line, Host, Content-Length, the given headers, the body."""
    seen: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            seen.append(await _request(reader))
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: 9\r\n\r\n")
            writer.write(b"data: 1\n\n")

    async def main() -> None:
        server, url = await serve(handler)
        transport = HTTP11Transport()
        target = httpx.URL(url + "/v1/chat/completions?x=1")
        for body in (b'{"stream":true}', b"{}"):
            response = await transport.post(target, [(b"x-request-id", b"r-1")], body, {"read": 5.0})
            assert response.status_code == 200
            assert response.headers["content-type"] == "text/event-stream"
            assert await response.aread() == b"data: 1\n\n"
            await response.aclose()
        await transport.aclose()
        assert server.connections == 1
        port = target.port
        assert seen[0] == (b"POST /v1/chat/completions?x=1 HTTP/1.1\r\nhost: 127.0.0.1:%d\r\n"
                           b"content-length: 15\r\nx-request-id: r-1\r\n\r\n{\"stream\":true}" % port)
        assert seen[1].endswith(b"content-length: 2\r\nx-request-id: r-1\r\n\r\n{}")

    run(main())


def test_post_to_https_goes_through_the_fallback_as_an_httpx_request() -> None:
    received: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        received.append(request)
        return httpx.Response(200, content=b"{}")

    async def main() -> None:
        transport = HTTP11Transport(fallback=httpx.MockTransport(answer))
        url = httpx.URL("https://agent.example:8443/v1/completions")
        response = await transport.post(url, [(b"x-request-id", b"r-2")], b'{"a":1}', {"read": 5.0})
        assert response.status_code == 200 and response.request is received[0]
        assert received[0].headers["x-request-id"] == "r-2" and received[0].content == b'{"a":1}'
        assert received[0].headers["host"] == "agent.example:8443"

    run(main())


def test_chunked_body_already_here_comes_in_one_piece(serve, client) -> None:
    events = [b"data: %d\n\n" % i for i in range(5)]

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        writer.write(b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events[:3]))
        await writer.drain()
        await asyncio.sleep(0.2)  # the reader gets what was there, without waiting for the rest
        writer.write(b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events[3:]) + b"0\r\n\r\n")
        await asyncio.sleep(1)

    async def main() -> None:
        _, url = await serve(handler)
        async with client() as http, http.stream("POST", url, content=b"{}") as response:
            parts = [part async for part in response.aiter_raw()]
        assert parts == [b"".join(events[:3]), b"".join(events[3:])]

    run(main())


def test_server_closing_before_answering_is_a_protocol_error(serve, client) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _request(reader)

    async def main() -> None:
        _, url = await serve(handler)
        async with client() as http:
            with pytest.raises(httpx.RemoteProtocolError):
                await http.post(url, content=b"{}")

    run(main())


def test_server_closing_mid_body_is_a_protocol_error(serve, client) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()

    async def main() -> None:
        _, url = await serve(handler)
        async with client() as http, http.stream("POST", url, content=b"{}") as response:
            received = b""
            with pytest.raises(httpx.RemoteProtocolError):
                async for part in response.aiter_raw():
                    received += part
        assert received == b"hello"

    run(main())


def test_closed_keep_alive_connection_is_not_reused(serve, client) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()  # then the server closes the connection (keep-alive or not)

    async def main() -> None:
        server, url = await serve(handler)
        async with client() as http:
            assert (await http.get(url)).status_code == 200
            await asyncio.sleep(0.1)
            assert (await http.get(url)).status_code == 200
        assert server.connections == 2

    run(main())


def test_an_abandoned_stream_closes_its_connection(serve, client) -> None:
    closed = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()
        if await reader.read(1) == b"":
            closed.set()

    async def main() -> None:
        _, url = await serve(handler)
        async with client() as http:
            async with http.stream("POST", url, content=b"{}") as response:
                async for _ in response.aiter_raw():
                    break
            await asyncio.wait_for(closed.wait(), 5)

    run(main())


def test_connect_refused_and_read_timeout_map_to_httpx_errors(serve, client) -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(5)

    async def main() -> None:
        _, url = await serve(silent)
        async with httpx.AsyncClient(transport=HTTP11Transport(), timeout=0.2) as http:
            with pytest.raises(httpx.ReadTimeout):
                await http.get(url)
            with pytest.raises(httpx.ConnectError):
                await http.get("http://127.0.0.1:1/")

    run(main())


def test_the_read_timeout_counts_from_each_wait_not_from_the_response(serve) -> None:
    """Chunks 0.15 s apart under a 0.4 s read timeout: a 1.2 s stream goes through (each wait has its own
    deadline, though one timer serves them all); then 1 s of silence mid-stream is a ReadTimeout, raised
    about 0.4 s into it. A connection with no read timeout waits as long as it takes."""

    async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(8):
            writer.write(b"2\r\nok\r\n")
            await writer.drain()
            await asyncio.sleep(0.15)
        await asyncio.sleep(1.0)  # silence
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async def read(url: str, limits: httpx.Timeout) -> tuple[list[float], BaseException | None]:
        arrivals: list[float] = []
        started = time.monotonic()
        try:
            async with (httpx.AsyncClient(transport=HTTP11Transport(), timeout=limits) as http,
                        http.stream("GET", url) as response):
                async for _ in response.aiter_raw():
                    arrivals.append(time.monotonic() - started)
        except httpx.ReadTimeout as exc:
            arrivals.append(time.monotonic() - started)
            return arrivals, exc
        arrivals.append(time.monotonic() - started)  # the end of the response
        return arrivals, None

    async def main() -> None:
        _, url = await serve(trickle)
        arrivals, error = await read(url, httpx.Timeout(5.0, read=0.4))
        assert isinstance(error, httpx.ReadTimeout)
        assert len(arrivals) >= 8 + 1, arrivals  # every chunk of the 1.2 s trickle, then the timeout
        silence = arrivals[-1] - arrivals[-2]
        assert 0.3 <= silence < 0.9, arrivals  # ~0.4 s after the last chunk, not a full second
        arrivals, error = await read(url, httpx.Timeout(5.0, read=None))
        assert error is None and arrivals[-1] >= 2.0, arrivals

    run(main())


def test_a_streamed_request_body_goes_through_the_fallback(serve) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        assert b"transfer-encoding: chunked" in head.lower()
        await reader.readuntil(b"0\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
        await writer.drain()

    async def body() -> AsyncIterator[bytes]:
        yield b"part"

    async def main() -> None:
        _, url = await serve(handler)
        async with httpx.AsyncClient(transport=HTTP11Transport(), timeout=5) as http:
            assert (await http.post(url, content=body())).content == b"ok"

    run(main())


def test_a_slow_reader_pauses_the_socket_and_still_gets_every_byte(serve, client) -> None:
    body = bytes(range(256)) * 8192  # 2 MiB, well past the read pause threshold

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body))
        writer.write(body)
        await writer.drain()
        await asyncio.sleep(5)

    async def main() -> None:
        _, url = await serve(handler)
        async with client() as http, http.stream("GET", url) as response:
            await asyncio.sleep(0.3)  # let the server fill every buffer
            parts = [part async for part in response.aiter_raw()]
        # reading paused past the threshold (256 KiB, plus at most one socket read): not all buffered
        assert len(parts[0]) <= 512 * 1024
        assert b"".join(parts) == body

    run(main())


def test_an_idle_connection_is_given_up_before_the_server_closes_it(serve) -> None:
    """A request written on a connection as the server closes it for idleness gets no answer: the transport
    gives an idle connection up a second before the server's announced ``Keep-Alive: timeout`` (llama-server
    announces 5 s) and after its own expiry when the server announces nothing (uvicorn: 5 s)."""

    def handler_for(announce: bytes) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:
                await _request(reader)
                writer.write(b"HTTP/1.1 200 OK\r\n" + announce + b"Content-Length: 2\r\n\r\nok")

        return handler

    async def requests(url: str, transport: HTTP11Transport, pauses: list[float]) -> None:
        async with httpx.AsyncClient(transport=transport, timeout=5.0) as http:
            for pause in [0.0, *pauses]:
                await asyncio.sleep(pause)
                assert (await http.post(url, content=b"{}")).content == b"ok"

    async def main() -> None:
        announcing, url = await serve(handler_for(b"Keep-Alive: timeout=1.5, max=100\r\n"))
        await requests(url, HTTP11Transport(keepalive_expiry=30.0), [0.1, 0.1, 0.7, 0.1])
        assert announcing.connections == 2  # reused within 0.5 s of idleness, not after 0.7 s
        silent, url = await serve(handler_for(b""))
        await requests(url, HTTP11Transport(keepalive_expiry=0.5), [0.1, 0.7, 0.1])
        assert silent.connections == 2

    run(main())
