"""Relaying an upstream answer chunk by chunk: the one core of the router's relay (to its client, from an
agent) and the agent's (to the router, from llama-server).

Whatever ends a relay - the last chunk, an upstream failure, the client going away, a stall, cancellation at
the server's shutdown - the upstream response is closed and :meth:`Relay.finish` runs, exactly once, in
``finally``. Nothing is buffered: each chunk is sent as it is read. After the first byte there is no retry:
an upstream failure ends a stream with its API's error event (macpool/errors.py) and cuts a plain body off
(returning without completing the response makes the server drop the connection, so the client sees a
failure rather than an end).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Literal

import anyio
import httpx
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from macpool import upstream as http
from macpool.asgi import Guard, end_stream
from macpool.errors import sse_error


class Relay(Response):
    """One upstream answer relayed to one client. Subclasses say what a chunk means to them
    (:meth:`relayed`), how the relay ended (:meth:`completed`, :meth:`failed`, :meth:`stopped`) and what its
    end gives back (:meth:`finish`)."""

    guard: Guard | None = None  # the request's own, when it has one already
    # who the upstream is, in the error event that ends a stream it failed
    upstream_name = "the node"
    # the stream's last event when the server stops before the relay ends (status, message, code)
    shutdown_error = (502, "the node shut down mid-stream", "upstream_midstream")

    def __init__(
        self,
        upstream: http.Response,
        headers: list[tuple[bytes, bytes]],
        dialect: str,
        first: bytes = b"",
        chunks: AsyncIterator[bytes] | None = None,
    ) -> None:
        # what Response.__init__ would set, the headers taken as the raw list they are sent as
        self.status_code = upstream.status
        self.raw_headers = headers
        self.background = None
        self.upstream = upstream
        self.dialect = dialect  # macpool/apis.py's: how an error event is framed
        self.streaming = http.content_type(upstream).startswith("text/event-stream")
        self.first = first  # read already (the first byte decided that this answer is relayed)
        self.chunks = chunks if chunks is not None else http.chunks(upstream)
        self.started = False  # the response's head has been sent
        self.ended = True  # the last chunk relayed closed its SSE event
        self.phase: Literal["read", "send"] = "send"  # what the relay waits for (a watchdog's business)
        self.progress_at = time.monotonic()  # when it last made progress

    # --- what a subclass says --------------------------------------------------------------------------

    def relayed(self, chunk: bytes) -> None:
        """A chunk is about to go to the client."""

    def completed(self) -> None:
        """The upstream answer ended and the client has all of it."""

    def failed(self, kind: str) -> None:
        """The upstream failed after the first byte (``midstream``), or stalled (a subclass's own kinds)."""

    def stopped(self) -> None:
        """The server is stopping and cut the relay short."""

    def watch(self, guard: Guard) -> None:
        """The relay begins (a subclass may arm a watchdog on ``guard``)."""

    def unwatch(self) -> None:
        """The relay's body ended, however."""

    async def after(self, guard: Guard, send: Send) -> None:
        """The relay's body ended, however (``guard.reason`` says when the guard ended it)."""

    async def finish(self) -> None:
        """The end: give back what the request held (called once, shielded from cancellation)."""

    # --- the relay -------------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        guard = self.guard or Guard(receive)
        self.watch(guard)
        try:
            try:
                await guard.run(self._relay(send))
            except asyncio.CancelledError:
                # not the guard's: nobody else cancels a relay - the server is stopping and its shutdown
                # timeout has passed; a stream ends with an error event, anything else is cut off
                self.stopped()
                if not (self.streaming and self.started):
                    raise
                await end_stream(send, self.error_event(*self.shutdown_error))
            finally:
                guard.finish()
                self.unwatch()
            await self.after(guard, send)
        finally:
            with anyio.CancelScope(shield=True):
                http.close(self.upstream)
                await self.finish()

    async def _relay(self, send: Send) -> None:
        """Relay every chunk; a stall in either direction is a watchdog's to catch."""
        self.phase = "send"
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        self.started = True
        if self.first:
            await self._pass(send, self.first)
        while True:
            self.phase, self.progress_at = "read", time.monotonic()
            try:
                chunk = await anext(self.chunks, None)
            except httpx.HTTPError:
                await self.fail(send, "midstream")
                return
            if chunk is None:
                break
            self.phase, self.progress_at = "send", time.monotonic()
            await self._pass(send, chunk)
        self.phase, self.progress_at = "send", time.monotonic()
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        self.completed()

    async def _pass(self, send: Send, chunk: bytes) -> None:
        self.relayed(chunk)
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
        self.ended = chunk.endswith(b"\n\n")

    async def fail(self, send: Send, kind: str) -> None:
        """The upstream failed after the first byte: a stream ends with its API's error event, a plain body
        is cut off."""
        self.failed(kind)
        if not self.streaming:
            return
        message = (f"{self.upstream_name} stopped answering mid-stream" if kind == "idle_timeout"
                   else f"{self.upstream_name} failed mid-stream")
        await send({"type": "http.response.body", "body": self.error_event(502, message, f"upstream_{kind}"),
                    "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def error_event(self, status: int, message: str, code: str) -> bytes:
        """The event that ends this stream with an error, in its API's terms (a new event, never the tail of
        a cut one)."""
        return sse_error(status, message, code, ended=self.ended, dialect=self.dialect)
