"""uvicorn's httptools protocol, writing a response's head and its first body bytes with one send.

uvicorn writes a response's head the moment the application sends ``http.response.start`` and its body
with each ``http.response.body``: two sends for every response, and for a relayed stream the peer wakes up
for a head it can do nothing with before the first event follows. Here a write that starts a response is
held until the next write (the first body bytes, usually in the same event-loop step) or, failing that,
until the end of the current loop step, and the two go out together. Nothing is reordered or dropped: bytes
are only delayed to the end of the step at most, and closing the connection writes what is held first.
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

_HEAD = b"HTTP/1.1 "


class CorkedTransport:
    """Wraps a connection's transport; everything but ``write`` and ``close`` goes to the transport."""

    __slots__ = ("_held", "_loop", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None

    def write(self, data: bytes) -> None:
        held = self._held
        if held is not None:
            self._held = None
            self._transport.write(held + data)
        elif data.startswith(_HEAD):
            self._held = data
            self._loop.call_soon(self.flush)
        else:
            self._transport.write(data)

    def write_now(self, data: bytes) -> None:
        """A whole response: written at once (after anything held)."""
        held, self._held = self._held, None
        self._transport.write(data if held is None else held + data)

    def flush(self) -> None:
        held, self._held = self._held, None
        if held is not None and not self._transport.is_closing():
            self._transport.write(held)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class CorkedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol over a :class:`CorkedTransport` (pass as ``Config(http=...)``)."""

    corked: CorkedTransport

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.corked = CorkedTransport(transport, self.loop)
        super().connection_made(cast(asyncio.Transport, self.corked))
