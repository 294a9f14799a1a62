"""Cut off clients that trickle their request in.

uvicorn bounds an idle keep-alive connection, but not the time a client may take to send a request's
headers and body, so a slowloris client holds a socket (and, once its headers are in, a request handler)
for as long as it likes. This protocol closes a connection whose request is not fully received within
``timeout`` seconds of its first byte (or of the connection, for a client that sends nothing).
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


def read_bounded_protocol(timeout: float) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with a bound on reading each request (pass as ``Config(http=...)``)."""

    class ReadBoundedProtocol(HttpToolsProtocol):
        _read_deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm()

        def on_message_complete(self) -> None:
            self._disarm()
            super().on_message_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._read_deadline = self.loop.call_later(timeout, self._read_timed_out)

        def _disarm(self) -> None:
            if self._read_deadline is not None:
                self._read_deadline.cancel()
                self._read_deadline = None

        def _read_timed_out(self) -> None:
            self._read_deadline = None
            if not self.transport.is_closing():
                self.transport.close()

    return ReadBoundedProtocol
