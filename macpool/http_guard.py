"""The router's HTTP protocol: uvicorn's httptools protocol, its response heads corked (macpool/corked.py),
with two additions.

1. Cut off clients that trickle their request in. uvicorn bounds an idle keep-alive connection, but not
   the time a client may take to send a request's headers and body, so a slowloris client holds a socket
   (and, once its headers are in, a request handler) for as long as it likes. This protocol closes a
   connection whose request is not fully received within ``timeout`` seconds of its first byte (or of the
   connection, for a client that sends nothing).
2. Early answers: while the application says it may refuse requests from memory (the router under
   overload: Redis has just said every node is full), a POST to one of its paths is held until its body is
   in and offered to the application *before* any ASGI machinery exists for it (no scope, no task, no
   receive/send). When the application answers, the response is written straight to the socket; when it
   declines (anything but a refusal it can decide at once: a bad key, a bad body, a model with room), the
   request goes through ASGI exactly as if it had never been held. Refusing is what an overloaded router
   does most, and this is where it costs least (docs/benchmarks.md, "Rejections below ASGI").
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from starlette.responses import Response
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from macpool.corked import CorkedProtocol

log = logging.getLogger("macpool.router")


class EarlyAnswers(Protocol):
    """What an application offers to answer below ASGI (router/app.py ``Router``)."""

    early_paths: frozenset[bytes]  # exact request targets (no query string) that may be answered early
    max_body_bytes: int  # a longer body is never held: it goes through ASGI (which answers 413)

    def armed(self) -> bool:
        """Whether early answers are possible now; holding a request costs nothing when they are not."""
        ...

    def answer(self, path: str, headers: list[tuple[bytes, bytes]], body: bytes) -> Response | None:
        """The whole response to a complete POST, or None to let the ASGI application handle it."""
        ...


def read_bounded_protocol(timeout: float, early: EarlyAnswers | None = None) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with a bound on reading each request and, given ``early``, early
    answers (pass as ``Config(http=...)``)."""

    class RouterProtocol(CorkedProtocol):
        _read_deadline: asyncio.TimerHandle | None = None
        _held: list[bytes] | None = None  # the body of a request held for an early answer
        _held_size = 0

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm()

        def on_headers_complete(self) -> None:
            if self._may_answer_early():
                self._held, self._held_size = [], 0  # decided in on_message_complete
                return
            super().on_headers_complete()

        def on_body(self, body: bytes) -> None:
            if self._held is None:
                super().on_body(body)
                return
            self._held.append(body)
            self._held_size += len(body)
            if early is not None and self._held_size > early.max_body_bytes:
                self._to_asgi()

        def on_message_complete(self) -> None:
            self._disarm()
            if self._held is not None:
                body = b"".join(self._held)
                self._held = None
                if self._answered_early(body):
                    return
                self._to_asgi(body)
            super().on_message_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        # --- early answers -------------------------------------------------------------------------

        def _may_answer_early(self) -> bool:
            parser = self.parser
            return (
                early is not None
                and self.url in early.early_paths
                and early.armed()
                and parser.get_method() == b"POST"
                and parser.get_http_version() == "1.1"
                and parser.should_keep_alive()
                and not parser.should_upgrade()
                and not self.expect_100_continue  # the client waits for a 100 only ASGI would send
                and not self.access_log  # an early answer would not be logged
                and (self.cycle is None or self.cycle.response_complete)  # no answer still being sent
            )

        def _answered_early(self, body: bytes) -> bool:
            assert early is not None
            try:
                response = early.answer(self.url.decode("ascii"), self.headers, body)
            except Exception:
                log.exception("early answer failed; handing the request to the application")
                return False
            if response is None:
                return False
            if self.transport.is_closing():
                return True  # the client is gone: nobody to answer
            content = [STATUS_LINE[response.status_code]]
            for name, value in (*self.server_state.default_headers, *response.raw_headers):
                content += [name, b": ", value, b"\r\n"]
            content += [b"\r\n", bytes(response.body)]
            self.corked.write_now(b"".join(content))
            self.on_response_complete()  # counts the request, arms the keep-alive timeout
            return True

        def _to_asgi(self, body: bytes | None = None) -> None:
            """Start the ASGI cycle for the held request, as uvicorn would have at its headers."""
            held = b"".join(self._held or ()) if body is None else body
            self._held = None
            super().on_headers_complete()
            if held:
                super().on_body(held)

        # --- the read bound ------------------------------------------------------------------------

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

    return RouterProtocol
