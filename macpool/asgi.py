"""ASGI pieces shared by the router and the agent: the trailing-slash rule, read bounds on a request's
body, the answer to a request cancelled by the server's shutdown, and the guard that ends a request when
its client goes away."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Literal, TypeVar

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

Endpoint = Callable[[Request], Awaitable[Response]]
T = TypeVar("T")


class TrailingSlash:
    """A trailing slash names the same path: ``/v1/models/`` is ``/v1/models``.

    Starlette's router (``redirect_slashes``, switched off by the apps) would answer with a 307 to the
    other spelling built from the client's own Host header - an open redirect, and plain http behind a TLS
    proxy - and a POST client that does not follow redirects (the OpenAI SDK) would fail. Here a page (GET,
    HEAD) is redirected by path alone, so its relative links get the right base; any other request is
    served under the path without the slash.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope.get("path", "")
        if scope["type"] != "http" or len(path) < 2 or not path.endswith("/"):
            await self.app(scope, receive, send)
            return
        raw: bytes | None = scope.get("raw_path")
        # a slash spelled %2F is served: redirected, the client would be sent to the same target again
        if scope["method"] in ("GET", "HEAD") and (raw is None or raw.endswith(b"/")):
            query = scope.get("query_string", b"").decode("latin-1")
            target = (raw.rstrip(b"/").decode("latin-1") or "/") if raw else path.rstrip("/")
            target = "/" + target.lstrip("/")  # "//host/x" would name another host
            await RedirectResponse(target + ("?" + query if query else ""), 307)(scope, receive, send)
            return
        stripped = path.rstrip("/") or "/"
        raw_stripped = (raw.rstrip(b"/") or b"/") if raw else stripped.encode()
        await self.app({**scope, "path": stripped, "raw_path": raw_stripped}, receive, send)


class BodyTooLarge(Exception):
    """A request body over its bound (answered 413)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"request body over the {limit}-byte limit")


class UpgradeWithBody(Exception):
    """A request offering a protocol upgrade (``Upgrade: h2c``, ``websocket``) with a body (answered 400)."""

    def __init__(self) -> None:
        super().__init__("a request offering a protocol upgrade (Upgrade header) cannot carry a body here: "
                         "send it without the offer")


async def read_body(request: Request, limit: int) -> bytes:
    """The request's whole body; BodyTooLarge past ``limit`` bytes, before reading it when it says so.

    A client may trickle a body in and hold a handler meanwhile: callers bound the read in time as well
    (``asyncio.timeout``, 408).

    uvicorn's httptools parser stops at the end of a head that offers an upgrade, and what follows is lost
    to the request: such a request with a body is refused (UpgradeWithBody) rather than served with an
    empty one. The fronting proxy drops the offer (deploy/haproxy/haproxy.cfg), so it never gets here.
    """
    headers = request.headers
    declared = headers.get("content-length")
    if "upgrade" in headers and (declared not in (None, "0") or "transfer-encoding" in headers):
        raise UpgradeWithBody
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(limit)
    parts = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(limit)
        parts.append(chunk)
    return b"".join(parts)


class ShutdownAnswering:
    """``endpoint`` as an ASGI app for a ``Route``, answering with ``answer(request)`` when the server cancels
    it at its shutdown timeout before its response began (rather than uvicorn's plain-text 500 and a logged
    traceback).

    Cancellations a :class:`Guard` sends are taken back inside the endpoint: one that reaches this far is
    the server's. A response already being sent handles its own (an SSE error event). Starlette routes an
    ASGI app (an object, not a function) as it is, so a relayed stream's chunks reach the server without a
    function endpoint's per-send wrapper; an exception still reaches the app's exception handlers.
    """

    def __init__(self, endpoint: Endpoint, answer: Callable[[Request], Response]) -> None:
        self.endpoint = endpoint
        self.answer = answer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive, send)
        try:
            response = await self.endpoint(request)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is None or not task.cancelling():
                raise
            task.uncancel()
            response = self.answer(request)
        await response(scope, receive, send)


async def end_stream(send: Send, event: bytes) -> None:
    """Send ``event`` as a response's last chunk and complete it, within a second: at shutdown, and a
    client that has gone is no error."""
    with contextlib.suppress(Exception):
        async with asyncio.timeout(1.0):
            await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})


class Guard:
    """Cancels a request's task when its client goes away, or when the router gives up on it (a stall).

    One task per request waits for the client's ``http.disconnect``; the relay's stall check is a timer
    (``Relay``). When the request's code catches the CancelledError it asks :meth:`claim` whether the guard
    sent it (then the cancellation is taken back and the request ends its own way, with ``reason``) or
    someone else did (then it propagates). Plain asyncio on purpose: this is on every request's path.
    """

    def __init__(self, receive: Receive) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.task = task
        self.reason: Literal["client_closed", "read", "send"] | None = None
        self.finished = False
        self._watcher = asyncio.ensure_future(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.cancel("client_closed")

    def cancel(self, reason: Literal["client_closed", "read", "send"]) -> None:
        if self.reason is None and not self.finished:
            self.reason = reason
            self.task.cancel()

    def claim(self) -> bool:
        """On CancelledError: True when the guard sent it (the cancellation is taken back)."""
        if self.reason is None:
            return False
        self.task.uncancel()
        return True

    async def run(self, work: Awaitable[T]) -> T | None:
        """``work``'s result, or None when the guard cancelled it (the cancellation is taken back). On any
        other exit the guard is finished first, so that the server's answer to an error is not cancelled.

        A library may swallow the cancellation (``asyncio.wait_for`` on Python 3.11 returns instead when
        the cancellation meets the end of what it waits for; redis-py writes through it): ``work`` then
        returns its result, the cancellation is taken back, and ``reason`` tells the caller. The next
        ``run`` of a guard that has cancelled is cancelled again at once, so it ends its own way."""
        if self.reason is not None and not self.finished:
            self.task.cancel()
        try:
            result = await work
        except asyncio.CancelledError:
            self.finish()
            if not self.claim():
                raise
            return None
        except BaseException:
            self.finish()
            raise
        self.claim()  # (False, and nothing done, unless the guard cancelled)
        return result

    def finish(self) -> None:
        """No cancellation from here on (the response is complete, or the request's cleanup runs)."""
        self.finished = True
        self._watcher.cancel()
