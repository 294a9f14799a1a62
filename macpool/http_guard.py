"""The HTTP protocol of the router and the agent: uvicorn's httptools protocol, its response heads corked
(macpool/corked.py), with these additions.

1. Bounds on a request's head. uvicorn and httptools take a request line and header fields of any size and
   number, and keep them whole until the head ends: one 50 MB header costs the process 50 MB, for good. Here
   a head over ``HeadLimits.head_bytes`` is answered ``431`` and a request target over
   ``HeadLimits.url_bytes`` ``414`` the moment the bound is crossed, without reading further, and a head
   with more than ``HeadLimits.fields`` fields ``431`` when it ends.
2. Requests the HTTP parser refuses (an unknown method, a control character in a header, Content-Length with
   Transfer-Encoding, ...) get the ``400`` uvicorn gives them, with an OpenAI-shaped JSON body instead of its
   plain text. Every such answer ends the connection: it is half-closed and what the client still sends is
   read and dropped for up to ``LINGER_S``, so a client still sending does not lose the answer to a reset.
   Each refusal is logged once, with its status and reason ("Request refused: 431 ..."), in place of
   uvicorn's "Invalid HTTP request received.".
3. Cut off clients that trickle their request in. uvicorn bounds an idle keep-alive connection, but not
   the time a client may take to send a request's headers and body, so a slowloris client holds a socket
   (and, once its headers are in, a request handler) for as long as it likes. This protocol closes a
   connection whose request is not fully received within ``timeout`` seconds of its first byte (or of the
   connection, for a client that sends nothing).
4. Early answers (the router): while the application says it may refuse requests from memory (the router
   under overload: Redis has just said every node is full), a POST to one of its paths is held until its
   body is in and offered to the application *before* any ASGI machinery exists for it (no scope, no task,
   no receive/send). When the application answers, the response is written straight to the socket; when it
   declines (anything but a refusal it can decide at once: a bad key, a bad body, a model with room), the
   request goes through ASGI exactly as if it had never been held. Refusing is what an overloaded router
   does most, and this is where it costs least (docs/benchmarks.md, "Rejections below ASGI").
"""

from __future__ import annotations

import asyncio
import logging
import sys
from dataclasses import dataclass
from typing import Protocol

import httptools
from starlette.responses import Response
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from macpool.corked import CorkedProtocol
from macpool.errors import error_body

log = logging.getLogger("macpool.router")


@dataclass(frozen=True)
class HeadLimits:
    """Bounds on one request's head."""

    head_bytes: int  # the request line and the header fields, as received
    fields: int  # header fields
    url_bytes: int  # the request target


# What a client may send the router. nginx answers 414 for a request line over 8 KiB and 431 past its
# 4 x 8 KiB header buffers; most servers allow about 64 KiB and 100 fields. An OpenAI client sends about a
# dozen short fields.
MAX_HEAD_BYTES = 64 * 1024
MAX_HEADER_FIELDS = 128
MAX_URL_BYTES = 8 * 1024
ROUTER_HEAD_LIMITS = HeadLimits(MAX_HEAD_BYTES, MAX_HEADER_FIELDS, MAX_URL_BYTES)
# An agent's clients are routers, which forward a client's head with a few fields of their own (X-Request-ID,
# X-Macpool-Token, its own Host and Content-Length): room for those, so no request a router took is refused.
AGENT_HEAD_LIMITS = HeadLimits(MAX_HEAD_BYTES + 4096, MAX_HEADER_FIELDS + 16, MAX_URL_BYTES)
# How long a refused client's remaining bytes are read and dropped before the connection is closed: long
# enough for what it had in flight to arrive, short enough that a client cannot hold the socket.
LINGER_S = 2.0


class Refusal(Exception):
    """An answer to a request that will not be read whole; raised from a parser callback, it stops the
    parser."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


# uvicorn logs this for every request its parser refuses, before GuardedProtocol answers it: the answer's own
# line (``_refuse``) says which refusal it was, so in a process serving the guarded protocol this one goes
_UVICORN_INVALID = "Invalid HTTP request received."


def _not_uvicorn_invalid(record: logging.LogRecord) -> bool:
    return record.msg != _UVICORN_INVALID


class GuardedProtocol(CorkedProtocol):
    """Corked httptools with bounds on each request's head (``limits``) and JSON answers to the requests it
    refuses. It must come first in a subclass's bases: it counts on seeing every parser callback."""

    limits = ROUTER_HEAD_LIMITS
    _head_size = 0  # bytes received of the current request's head
    _head_in = False  # the current request's head has ended (its body, if any, follows)
    _since_body = 0  # bytes received after the head without a byte of body: a chunked body's trailer, if many
    _refused = False  # answered and ending: what the client still sends is dropped
    _linger: asyncio.TimerHandle | None = None
    _offered = False  # the current request offers an upgrade (h2c, WebSocket): it is served without it
    _upgrade_at: int | None = None  # where, in the bytes just parsed, the parser stopped for that upgrade

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._head_in:
            self._read_body(data)
            return
        room = self.limits.head_bytes - self._head_size
        fits = data if len(data) <= room else data[:room]
        # counted before parsing: a request that ends within ``fits`` starts the next head's count at zero
        # (its bytes in this read go uncounted, so a bound may be passed by at most one read)
        self._head_size += len(fits)
        super().data_received(fits)
        if self._upgrade_at is not None:
            self._serve_without_upgrade(data)
            return
        if len(fits) == len(data) or self._refused or self.transport.is_closing():
            return
        if self._head_in or self._head_size < self.limits.head_bytes:
            self.data_received(data[room:])  # the head ended within what fitted: the rest is read as usual
        else:
            message = f"Request header fields over {self.limits.head_bytes} bytes"
            self._refuse(Refusal(431, "headers_too_large", message))

    def _read_body(self, data: bytes) -> None:
        # A trailer's fields (after a chunked body's last chunk) are kept whole by httptools too, like the
        # head's: they count against the same bound. A read that carries body bytes does not count.
        self._since_body += len(data)
        super().data_received(data)
        if self._upgrade_at is not None:  # a request pipelined behind this body offers one
            self._serve_without_upgrade(data)
            return
        if self._head_in and self._since_body > self.limits.head_bytes and not self._refused:
            message = f"Trailer fields over {self.limits.head_bytes} bytes"
            self._refuse(Refusal(431, "headers_too_large", message))

    def on_url(self, url: bytes) -> None:
        if len(self.url) + len(url) > self.limits.url_bytes:
            raise Refusal(414, "url_too_long", f"Request target over {self.limits.url_bytes} bytes")
        super().on_url(url)

    def on_headers_complete(self) -> None:
        # counted here, not per field: that would cost a call per field, and the byte bound already keeps
        # a head with many fields small
        if len(self.headers) > self.limits.fields:
            raise Refusal(431, "headers_too_large", f"More than {self.limits.fields} request header fields")
        if self.parser.should_upgrade() and self.parser.get_method() != b"CONNECT":
            # llhttp stops at the end of an upgrade's head, taking its body for the new protocol's bytes:
            # no request yet - it is parsed again without the offer (_serve_without_upgrade)
            self._offered = True
            return
        self._head_in, self._since_body = True, 0
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        self._since_body = 0
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._head_in, self._head_size = False, 0
        if not self._offered:
            super().on_message_complete()

    # The router and the agent serve HTTP/1.1 only. A request offering an upgrade - to h2c, as curl --http2,
    # Java's and Ktor's clients do on every request, or to WebSocket - is served as if it had not (RFC 9110
    # 7.8), as llama-server does: uvicorn's WebSocket protocol would take it (a POST then never answered,
    # past every bound here), and its HTTP protocol would lose the request's body to the upgrade.

    def _should_upgrade(self) -> bool:
        return False

    def _unsupported_upgrade_warning(self) -> None:
        # called by uvicorn as it handles the parser's stop at the upgrade (nothing to warn about)
        error = sys.exc_info()[1]
        if self._offered and isinstance(error, httptools.HttpParserUpgrade):
            self._upgrade_at = error.args[0]

    def _serve_without_upgrade(self, data: bytes) -> None:
        """Parse the request the parser stopped at again, without its upgrade offer, with what follows its
        head in ``data`` (its body, and any requests after it) and the bytes still to come."""
        assert self._upgrade_at is not None
        rest = data[self._upgrade_at:]
        version = self.parser.get_http_version().encode()
        head = [self.parser.get_method(), b" ", self.url, b" HTTP/", version, b"\r\n"]
        for name, value in self.headers:
            if name == b"connection":
                value = b",".join(t for t in value.split(b",") if t.strip().lower() != b"upgrade")
                if not value.strip():
                    continue
            if name != b"upgrade":
                head += [name, b": ", value, b"\r\n"]
        head.append(b"\r\n")
        self._offered, self._upgrade_at, self._head_size = False, None, 0
        self.parser = httptools.HttpRequestParser(self)
        self.data_received(b"".join(head) + rest)

    def send_400_response(self, msg: str) -> None:
        # uvicorn calls this while handling the parser's error, which says why (a Refusal is its context)
        error = sys.exc_info()[1]
        if isinstance(error, httptools.HttpParserCallbackError) and isinstance(error.__context__, Refusal):
            self._refuse(error.__context__)
        elif isinstance(error, httptools.HttpParserError) and not isinstance(
            error, httptools.HttpParserCallbackError
        ):
            self._refuse(Refusal(400, "invalid_http_request", f"Invalid HTTP request: {error}"))
        else:
            self._refuse(Refusal(400, "invalid_http_request", msg))

    def connection_lost(self, exc: Exception | None) -> None:
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        if self._refused:  # a request was refused behind this response, unanswered: the connection ends
            self.pipeline.clear()
            self.transport.close()
        super().on_response_complete()

    def _refuse(self, refusal: Refusal) -> None:
        """Answer a request that will not be read whole, and end the connection."""
        self._refused = True
        self.logger.warning("Request refused: %d %s", refusal.status, refusal)
        cycle = self.cycle
        body_broke = self._head_in and cycle is not None and not cycle.response_started
        if self.pipeline or (cycle is not None and not cycle.response_complete and not body_broke):
            # behind a response still to be sent (pipelined requests): an answer now would be read as that
            # response, so this one goes unanswered and the connection ends after it (on_response_complete)
            return
        if body_broke:  # the request whose body was being read: its handler is told the client is gone
            assert cycle is not None
            cycle.disconnected = True
            cycle.waiting_for_100_continue = False  # and writes no "100 Continue"
            cycle.message_event.set()
        body = error_body(refusal.status, str(refusal), refusal.code, "invalid_request_error")
        head = [STATUS_LINE[refusal.status]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head.append(b"content-type: application/json\r\ncontent-length: %d\r\n" % len(body))
        head.append(b"connection: close\r\n\r\n")
        self.corked.write_now(b"".join(head) + body)
        self._half_close()

    def _half_close(self) -> None:
        """Close for writing now, and for reading once the client closes too or ``LINGER_S`` has passed: a
        connection closed with unread bytes in it is reset, and the reset can destroy the answer before the
        client reads it (RFC 9112, 9.6)."""
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        self.transport.write_eof()
        self._linger = self.loop.call_later(LINGER_S, self.transport.close)


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


def read_bounded_protocol(
    timeout: float, early: EarlyAnswers | None = None, limits: HeadLimits = ROUTER_HEAD_LIMITS
) -> type[HttpToolsProtocol]:
    """The guarded protocol (bounds on each request's head, JSON refusals) with a bound on reading each
    request and, given ``early``, early answers (pass as ``Config(http=...)``)."""

    class ReadBoundedProtocol(CorkedProtocol):
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
                # one line per connection, like the refusals: a slowloris shows up in the log
                peer = self.transport.get_extra_info("peername")
                where = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else peer
                log.info("closed a connection from %s: no whole request within %.3g s "
                         "(--request-read-timeout)", where, timeout)
                self.transport.close()

    class HttpProtocol(GuardedProtocol, ReadBoundedProtocol):
        """GuardedProtocol first: it sees every request's head and end, also those ReadBoundedProtocol
        holds or answers early without uvicorn."""

    HttpProtocol.limits = limits
    uvicorn_log = logging.getLogger("uvicorn.error")
    if _not_uvicorn_invalid not in uvicorn_log.filters:
        uvicorn_log.addFilter(_not_uvicorn_invalid)
    return HttpProtocol
