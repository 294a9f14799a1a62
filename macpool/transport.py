"""An httpx transport for plain HTTP/1.1 upstreams: asyncio protocols and httptools' C parser.

httpx's default transport (httpcore + h11) parses every response in pure Python, writes a request's head
and body with two socket sends, and polls every idle pooled connection on each request; on the router's
and the agent's relay paths that was most of their CPU per chunk and per request (docs/profiles/). This
transport keeps the httpx API - the same client, requests, responses and exception classes - and
differs only in cost:

- one write per request (head and body together);
- the response is parsed in C, and body bytes that are already here when the reader asks are handed
  over as one piece (never waiting for more: a chunk that arrives alone is returned alone);
- idle keep-alive connections are known dead the moment the peer closes them (the event loop reports
  it), so reusing one needs no syscall; and one is given up a second before the idle timeout its server
  announced (``Keep-Alive: timeout=N``, as llama-server sends), since a request written as the server closes
  the connection gets no answer at all.

The relay paths call :meth:`HTTP11Transport.post` rather than ``handle_async_request``: the same exchange,
written from the request's bytes without building an ``httpx.Request`` first.

Reading applies backpressure: past ``_HIGH_WATER`` unread bytes the socket stops being read. There is no
cap on open connections (httpx's ``max_connections``): the router's admission and the agent's in-flight cap
bound them. Anything it does not handle (https, a streamed request body, HEAD) goes to httpx's default
transport.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator
from typing import Any, cast

import httptools
import httpx

_HIGH_WATER = 256 * 1024  # unread response bytes per connection before reading pauses
_IDLE_MARGIN_S = 1.0  # an idle connection is given up this long before the server's announced idle timeout
_Origin = tuple[str, int]


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection; serves one request/response at a time."""

    def __init__(self, origin: _Origin) -> None:
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.lost = False
        self.idle_until = 0.0  # monotonic time after which this idle connection is not reused
        # the read timeout: one timer per connection, re-armed only when it fires (see _wait)
        self.wait_deadline: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.reason = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.head: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.body: list[bytes] = []
        self.buffered = 0
        self.complete = False
        self.keep_alive = False
        self.error: httpx.TransportError | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.writable: asyncio.Future[None] | None = None
        self.paused = False

    # --- asyncio.Protocol --------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not subclasses
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(httpx.RemoteProtocolError("unexpected protocol upgrade"))
        except httptools.HttpParserError as exc:
            self._fail(httpx.RemoteProtocolError(f"malformed response: {exc}"))
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if not self.complete and self.error is None:
            if not self.head.done():
                if exc is None:
                    self.error = httpx.RemoteProtocolError("Server disconnected without sending a response.")
                else:
                    self.error = httpx.ReadError(str(exc) or type(exc).__name__)
            elif exc is None and self._close_delimited():
                self.complete = True
            else:
                reason = "peer closed connection without sending complete message body"
                self.error = httpx.RemoteProtocolError(reason) if exc is None else httpx.ReadError(str(exc))
        self._wake()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.writable is not None and not self.writable.done():
            self.writable.set_result(None)

    def pause_writing(self) -> None:
        self.writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self.writable is not None and not self.writable.done():
            self.writable.set_result(None)
        self.writable = None

    # --- httptools callbacks -----------------------------------------------------------------------

    def on_status(self, status: bytes) -> None:
        self.reason += status

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        if self.status < 200:  # an interim response (100 Continue): wait for the real one
            self.reason, self.headers = b"", []
            return
        if not self.head.done():
            self.head.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.body.append(body)
        self.buffered += len(body)
        if self.buffered > _HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        if self.status < 200:
            return
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()

    # --- used by the transport ---------------------------------------------------------------------

    def _close_delimited(self) -> bool:
        names = {name.lower() for name, _ in self.headers}
        return b"content-length" not in names and b"transfer-encoding" not in names

    def _fail(self, error: httpx.TransportError) -> None:
        if self.error is None:
            self.error = error
        self.close()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self, seconds: float | None) -> None:
        """Until data arrives or the connection ends; httpx.ReadTimeout after ``seconds`` without either.

        A relayed stream waits once per chunk: an ``asyncio.timeout`` each time scheduled and cancelled a
        timer per chunk (~3 us). Here a wait only stamps its deadline, and the connection's one timer, when
        it fires, fails the wait then in progress if that wait's deadline has passed, else re-arms for it.
        """
        loop = asyncio.get_running_loop()
        self.waiter = waiter = loop.create_future()
        if seconds is None:
            self.wait_deadline = None
        else:
            self.wait_deadline = deadline = loop.time() + seconds
            if self._timer is None:
                self._timer = loop.call_at(deadline, self._check_wait)
        try:
            await waiter
        finally:
            self.waiter = None

    def _check_wait(self) -> None:
        self._timer = None
        waiter, deadline = self.waiter, self.wait_deadline
        if waiter is None or waiter.done() or deadline is None:
            return  # no timed wait now: the next one arms the timer again
        loop = asyncio.get_running_loop()
        if loop.time() >= deadline:
            waiter.set_exception(httpx.ReadTimeout("timed out waiting for the upstream"))
        else:
            self._timer = loop.call_at(deadline, self._check_wait)

    async def send(self, data: bytes, seconds: float | None) -> None:
        assert self.transport is not None
        self._reset()
        if self.lost:
            raise httpx.WriteError("the connection is closed")
        self.transport.write(data)
        if self.writable is not None:  # the kernel buffer is full: wait for it to drain
            try:
                async with asyncio.timeout(seconds):
                    await self.writable
            except TimeoutError:
                raise httpx.WriteTimeout("timed out writing the request") from None
            if self.lost and not self.head.done():
                raise httpx.WriteError("the connection closed while the request was written")

    async def response_head(self, seconds: float | None) -> None:
        while not self.head.done():
            if self.error is not None:
                raise self.error
            await self._wait(seconds)

    async def read(self, seconds: float | None) -> bytes:
        """What has arrived of the body since the last read (waiting only if nothing has); b"" at the end."""
        while not self.body:
            if self.complete:
                return b""
            if self.error is not None:
                raise self.error
            await self._wait(seconds)
        data = self.body[0] if len(self.body) == 1 else b"".join(self.body)
        self.body.clear()
        self.buffered = 0
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return data

    def reusable(self) -> bool:
        return self.complete and self.keep_alive and not self.lost and self.error is None

    def server_idle_timeout(self) -> float | None:
        """The idle timeout the server announced (``Keep-Alive: timeout=N``), if any."""
        for name, value in self.headers:
            if name.lower() == b"keep-alive":
                for param in value.split(b","):
                    key, _, number = param.strip().partition(b"=")
                    if key.strip().lower() == b"timeout":
                        try:
                            return float(number.strip())
                        except ValueError:
                            return None
        return None

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()


class _Body(httpx.AsyncByteStream):
    """The response body; gives the connection back to the pool (or closes it) exactly once."""

    def __init__(self, pool: HTTP11Transport, connection: _Connection, read_timeout: float | None) -> None:
        self._pool = pool
        self._connection: _Connection | None = connection
        self._read_timeout = read_timeout

    async def __aiter__(self) -> AsyncIterator[bytes]:
        connection = self._connection
        if connection is None:
            return
        while data := await connection.read(self._read_timeout):
            yield data
        await self.aclose()

    async def aclose(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            self._pool.release(connection)


class HTTP11Transport(httpx.AsyncBaseTransport):
    """Keep-alive HTTP/1.1 to ``http://`` origins; see the module docstring for what it saves."""

    def __init__(
        self,
        max_keepalive_connections: int = 64,
        keepalive_expiry: float = 30.0,
        fallback: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.max_keepalive = max_keepalive_connections
        self.keepalive_expiry = keepalive_expiry
        self.fallback = fallback or httpx.AsyncHTTPTransport(
            limits=httpx.Limits(max_keepalive_connections=max_keepalive_connections,
                                keepalive_expiry=keepalive_expiry)
        )
        self._idle: dict[_Origin, list[_Connection]] = {}
        self._closed = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        try:
            body = request.content
        except httpx.RequestNotRead:
            body = None
        if (url.scheme != "http" or body is None or request.method == "HEAD"
                or (body and "content-length" not in request.headers)):
            return await self.fallback.handle_async_request(request)
        timeouts: dict[str, Any] = request.extensions.get("timeout", {})
        return await self._exchange((url.host, url.port or 80), _head(request) + body, timeouts)

    async def post(
        self, url: httpx.URL, headers: list[tuple[bytes, bytes]], body: bytes, timeouts: dict[str, Any]
    ) -> httpx.Response:
        """POST ``body`` to ``url`` with ``headers`` (none of Host, Content-Length, Transfer-Encoding).

        The relay paths' request (router -> agent, agent -> llama-server), written straight from the bytes
        they have: building an ``httpx.Request`` for it first cost ~10-20 us per request, as much as all the
        rest of this transport's work. The response is an ``httpx.Response`` as ever, without ``.request``.
        """
        if url.scheme != "http":
            extensions = {"timeout": timeouts}
            request = httpx.Request("POST", url, headers=headers, content=body, extensions=extensions)
            response = await self.handle_async_request(request)
            response.request = request
            return response
        head = b"POST %s HTTP/1.1\r\nhost: %s\r\ncontent-length: %d\r\n%s\r\n" % (
            url.raw_path, url.netloc, len(body), b"".join([b"%s: %s\r\n" % pair for pair in headers]))
        return await self._exchange((url.host, url.port or 80), head + body, timeouts)

    async def _exchange(self, origin: _Origin, data: bytes, timeouts: dict[str, Any]) -> httpx.Response:
        """Write one request on a keep-alive connection to ``origin`` and wait for its response head."""
        if self._closed:
            raise RuntimeError("the transport is closed")
        connection = self._idle_connection(origin) or await self._connect(origin, timeouts.get("connect"))
        try:
            await connection.send(data, timeouts.get("write"))
            await connection.response_head(timeouts.get("read"))
        except BaseException:
            connection.close()
            raise
        return httpx.Response(
            connection.status,
            headers=connection.headers,
            stream=_Body(self, connection, timeouts.get("read")),
            extensions={"http_version": b"HTTP/1.1", "reason_phrase": connection.reason},
        )

    def _idle_connection(self, origin: _Origin) -> _Connection | None:
        idle = self._idle.get(origin)
        now = time.monotonic()
        while idle:
            connection = idle.pop()
            if not connection.lost and now < connection.idle_until:
                return connection
            connection.close()
        return None

    async def _connect(self, origin: _Origin, seconds: float | None) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(seconds):
                _, protocol = await loop.create_connection(lambda: _Connection(origin), *origin)
        except TimeoutError:
            raise httpx.ConnectTimeout(f"connecting to {origin[0]}:{origin[1]} timed out") from None
        except OSError as exc:
            raise httpx.ConnectError(str(exc) or type(exc).__name__) from None
        return protocol

    def release(self, connection: _Connection) -> None:
        idle = self._idle.setdefault(connection.origin, [])
        if self._closed or not connection.reusable() or len(idle) >= self.max_keepalive:
            connection.close()
            return
        # give an idle connection up before the server may close it: a request written as the server closes
        # the connection fails with no answer (for llama-server, Keep-Alive: timeout=5)
        expiry = self.keepalive_expiry
        announced = connection.server_idle_timeout()
        if announced is not None:
            expiry = min(expiry, max(announced - _IDLE_MARGIN_S, 0.0))
        connection.idle_until = time.monotonic() + expiry
        idle.append(connection)

    async def aclose(self) -> None:
        self._closed = True
        for idle in self._idle.values():
            for connection in idle:
                connection.close()
        self._idle.clear()
        await self.fallback.aclose()


def _head(request: httpx.Request) -> bytes:
    lines = [b"%s %s HTTP/1.1" % (request.method.encode(), request.url.raw_path)]
    lines += [b"%s: %s" % pair for pair in request.headers.raw]
    return b"\r\n".join(lines) + b"\r\n\r\n"
