"""The transport of every relayed upstream call: router -> agent and agent -> llama-server.

httpx's API (requests, responses, exceptions) over aiohttp's HTTP/1.1 client, through ``httpx-aiohttp``:
as the upstream client of a relay, aiohttp's C parser and its connection pool cost a fraction of the CPU per
relayed chunk and per request that httpx's default transport does (``macpool bench relay
--compare-transports``).
"""

from __future__ import annotations

import aiohttp
import httpx
from httpx_aiohttp import AiohttpTransport

# aiohttp adds these to a request that lacks them; a relay sends the caller's headers and nothing more
_NOT_ADDED = ("User-Agent", "Accept", "Accept-Encoding", "Content-Type")


class _Transport(AiohttpTransport):
    """httpx-aiohttp's transport, its request errors named as httpx's own transport names them.

    httpx-aiohttp turns every aiohttp connection error into ``httpx.ConnectTimeout``: a refused connection
    and a server that closed without answering too. The router fails over on all of them, but it counts a
    connect failure against a node's circuit, and the agent and the router log the error's name.
    """

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            return await super().handle_async_request(request)
        except httpx.ConnectTimeout as exc:
            cause = exc.__cause__
            if isinstance(cause, aiohttp.ServerTimeoutError):
                raise  # a timeout indeed
            if isinstance(cause, aiohttp.ClientConnectorError):
                raise httpx.ConnectError(str(exc), request=request) from cause
            if isinstance(cause, aiohttp.ServerDisconnectedError):
                raise httpx.RemoteProtocolError(str(exc), request=request) from cause
            if isinstance(cause, aiohttp.ClientOSError):
                raise httpx.ReadError(str(exc), request=request) from cause
            raise


def new_transport(keepalive_expiry: float, max_connections: int | None = None) -> httpx.AsyncBaseTransport:
    """A pooled transport; an idle connection is given up after ``keepalive_expiry`` seconds.

    No cookie jar: one upstream's cookies must never reach another caller's request.
    """

    def session() -> aiohttp.ClientSession:  # made on the first request, inside the running event loop
        connector = aiohttp.TCPConnector(limit=max_connections or 0, keepalive_timeout=keepalive_expiry)
        return aiohttp.ClientSession(connector=connector, cookie_jar=aiohttp.DummyCookieJar(),
                                     skip_auto_headers=_NOT_ADDED, auto_decompress=False)

    return _Transport(client=session)
