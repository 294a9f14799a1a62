"""The HTTP client of every upstream call: router -> agent and agent -> llama-server.

One aiohttp ``ClientSession`` (aiohttp's C parser and connection pool) serves two APIs:

- httpx's, for ordinary calls (the agent's probes, ``/props``, ``/slots``): ``Upstream`` is an httpx
  transport, through ``httpx-aiohttp``, so ``httpx.AsyncClient(transport=upstream)`` works as ever;
- a direct one for the relays, ``Upstream.send`` returning aiohttp's response. A relay is the request path:
  building an ``httpx.Request`` and wrapping aiohttp's response back into an ``httpx.Response`` (and its
  stream, chunk by chunk) costs about a third of the router's CPU per proxied request
  (docs/architecture.md, "Upstream HTTP").

Both raise httpx's exceptions, so callers handle one set of errors whichever API they use.
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from types import TracebackType

import aiohttp
import httpx
from aiohttp.http import HttpProcessingError
from httpx_aiohttp import AiohttpTransport
from yarl import URL as URL  # re-exported: the parsed URL ``Upstream.send`` takes

# aiohttp adds these to a request that lacks them; a relay sends the caller's headers and nothing more
_NOT_ADDED = ("User-Agent", "Accept", "Accept-Encoding", "Content-Type")

Response = aiohttp.ClientResponse


def timeouts(connect: float | None, read: float | None, pool: float | None = 30.0) -> aiohttp.ClientTimeout:
    """A relay's timeouts: to connect, between two reads (None: none), and for a pooled connection (a name
    lookup included). Build it once, not per call."""
    return aiohttp.ClientTimeout(sock_connect=connect, sock_read=read, connect=pool)


def url(text: str) -> URL:
    """A parsed URL for ``Upstream.send``; parse it once, not on every request."""
    return URL(text)


class _Mapped:
    """Raises aiohttp's errors as the httpx exceptions the relay paths handle.

    A refused connection: ConnectError (the router fails over, counting it against the node's circuit). A
    connection closed before any answer: RemoteProtocolError. A connection lost mid-body: ReadError.
    """

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if not isinstance(exc, aiohttp.ClientError):
            return
        message = str(exc) or type(exc).__name__
        mapped: type[httpx.HTTPError]
        if isinstance(exc, aiohttp.ConnectionTimeoutError):
            mapped = httpx.ConnectTimeout
        elif isinstance(exc, aiohttp.ServerTimeoutError):  # aiohttp's is a TimeoutError: never let it pass
            mapped = httpx.ReadTimeout
        elif isinstance(exc, aiohttp.ClientConnectorError):
            mapped = httpx.ConnectError
        elif isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientResponseError):
            mapped = httpx.RemoteProtocolError
        elif isinstance(exc, aiohttp.ClientConnectionResetError):
            mapped = httpx.WriteError
        elif isinstance(exc, aiohttp.ClientPayloadError | aiohttp.ClientConnectionError):
            mapped = httpx.ReadError
        elif isinstance(exc, aiohttp.InvalidURL):
            mapped = httpx.UnsupportedProtocol
        else:
            mapped = httpx.TransportError
        raise mapped(message) from exc


_mapped = _Mapped()


class _Chunks:
    """A response's body as it arrives, chunk by chunk; errors as httpx's."""

    __slots__ = ("_content",)

    def __init__(self, response: Response) -> None:
        self._content = response.content

    def __aiter__(self) -> _Chunks:
        return self

    async def __anext__(self) -> bytes:
        with _mapped:
            chunk = await self._content.readany()
        if not chunk:
            raise StopAsyncIteration
        return chunk


class _Transport(AiohttpTransport):
    """httpx-aiohttp's transport, its request errors named as ``_Mapped`` names them.

    httpx-aiohttp turns every aiohttp connection error into ``httpx.ConnectTimeout``: a refused connection
    and a server that closed without answering too.
    """

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            return await super().handle_async_request(request)
        except httpx.ConnectTimeout as exc:
            if exc.__cause__ is None:
                raise
            with _mapped:
                raise exc.__cause__ from None
            raise


def client_tls(ca: Path | None, cert: Path | None = None, key: Path | None = None) -> ssl.SSLContext | None:
    """How https:// upstreams are checked: their certificate chains to ``ca`` (None: the system's CAs) and
    names the host connected to; ``cert`` and ``key`` are shown to servers that ask for a client
    certificate. None when nothing is given: aiohttp's own default, the system's CAs."""
    if ca is None and cert is None:
        return None
    context = ssl.create_default_context(cafile=str(ca) if ca else None)
    if cert is not None:
        context.load_cert_chain(cert, key)
    return context


class Upstream(httpx.AsyncBaseTransport):
    """A pooled client; an idle connection is given up after ``keepalive_expiry`` seconds; https:// servers
    are checked with ``tls`` (see :func:`client_tls`).

    No cookie jar: one upstream's cookies must never reach another caller's request.
    """

    def __init__(self, keepalive_expiry: float, max_connections: int | None = None,
                 tls: ssl.SSLContext | None = None) -> None:
        self._keepalive_expiry = keepalive_expiry
        self._max_connections = max_connections or 0
        self._tls = tls
        self._session: aiohttp.ClientSession | None = None
        self._transport = _Transport(client=self.session)

    def session(self) -> aiohttp.ClientSession:
        """The session, made on first use (inside the running event loop)."""
        if self._session is None:
            expiry = self._keepalive_expiry
            connector = aiohttp.TCPConnector(limit=self._max_connections, keepalive_timeout=expiry,
                                             ssl=self._tls if self._tls is not None else True)
            self._session = aiohttp.ClientSession(connector=connector, cookie_jar=aiohttp.DummyCookieJar(),
                                                  skip_auto_headers=_NOT_ADDED, auto_decompress=False)
        return self._session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self._transport.handle_async_request(request)

    async def send(
        self, method: str, url: URL, headers: Iterable[tuple[str, str]], body: bytes | None,
        timeouts: aiohttp.ClientTimeout,
    ) -> Response:
        """Send a request; the response once its head is in. Close it with ``close``, always."""
        with _mapped:
            return await self.session().request(method, url, headers=list(headers), data=body or None,
                                                timeout=timeouts, allow_redirects=False)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def chunks(response: Response) -> AsyncIterator[bytes]:
    """The response's body as it arrives."""
    return _Chunks(response)


async def lines(response: Response, longest: int) -> AsyncIterator[str]:
    """The response's body line by line, without line ends; a line longer than ``longest`` bytes is an
    ``httpx.DecodingError``."""
    with _mapped:
        try:
            while line := await response.content.readline(max_line_length=longest):
                yield line.decode("utf-8", "replace").rstrip("\r\n")
        except HttpProcessingError as exc:  # aiohttp's LineTooLong
            raise httpx.DecodingError(f"a line of the response is longer than {longest} bytes") from exc


async def read(response: Response) -> bytes:
    """The whole body (then the connection goes back to the pool)."""
    try:
        with _mapped:
            return await response.read()
    finally:
        close(response)


def close(response: Response | None) -> None:
    """Give the response's connection back: to the pool once the body is read whole, else closed at once
    (which is what makes llama-server cancel a generation whose client went away)."""
    if response is None:
        return
    if response.content.is_eof():
        response.release()
    else:
        response.close()


def raw_headers(response: Response) -> list[tuple[bytes, bytes]]:
    """The response's headers as a raw ASGI list: lower-case names, in order."""
    return [(name.lower(), value) for name, value in response.raw_headers]


def content_type(response: Response) -> str:
    return response.headers.get("content-type", "")


def as_str(headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[str, str]]:
    """Raw (ASGI) headers as the ``str`` pairs ``Upstream.send`` takes."""
    return [(name.decode("latin-1"), value.decode("latin-1")) for name, value in headers]
