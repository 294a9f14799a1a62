"""ASGI pieces shared by the router and the agent: a Starlette application whose hot POST endpoints skip
Starlette's routing and middleware, and the guard that ends a request when its client goes away."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Literal

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.types import Receive, Scope, Send

Endpoint = Callable[[Request], Awaitable[Response]]
ErrorHandler = Callable[[Request, Exception], Awaitable[Response]]


class DirectPosts(Starlette):
    """Starlette, except that a POST to one of ``direct``'s paths goes straight to its endpoint.

    Those endpoints relay streamed responses chunk by chunk, and Starlette's routing and middleware wrap
    every send of every chunk (docs/profiles/router-findings.md, finding 3). Everything else - other
    methods on those paths included - is routed by Starlette as usual. An exception from a direct
    endpoint is answered like Starlette's ``ServerErrorMiddleware`` does: ``on_error``'s response (when
    given), then re-raised for the server to log; one cancelled by the server's shutdown, with
    ``on_shutdown``'s response (when given).
    """

    def __init__(self, direct: Mapping[str, Endpoint], on_error: ErrorHandler | None = None,
                 on_shutdown: Callable[[Request], Response] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # Starlette's router redirects a path to its spelling with a slash (GET /static to /static/, a Mount)
        # on the host the client named; __call__ takes trailing slashes off instead
        self.router.redirect_slashes = False
        self.direct = dict(direct)
        self.on_error = on_error
        self.on_shutdown = on_shutdown

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and len(scope["path"]) > 1 and scope["path"].endswith("/"):
            # a trailing slash names the same path. Starlette would answer with a 307 to the other spelling
            # built from the client's own Host header (an open redirect, and plain http behind a TLS proxy),
            # and a POST client that does not follow redirects (the OpenAI SDK's) would fail: a page is
            # redirected by path alone (its relative links need the right base), anything else is served
            raw: bytes | None = scope.get("raw_path")
            path = scope["path"].rstrip("/") or "/"
            # (a slash spelled %2F is served: redirected, the client would be sent to the same target again)
            if scope["method"] in ("GET", "HEAD") and (raw is None or raw.endswith(b"/")):
                query = scope.get("query_string", b"").decode("latin-1")
                target = (raw.rstrip(b"/").decode("latin-1") or "/") if raw else path
                target = "/" + target.lstrip("/")  # "//host/x" would be another host
                await RedirectResponse(target + ("?" + query if query else ""), 307)(scope, receive, send)
                return
            scope = {**scope, "path": path, "raw_path": raw.rstrip(b"/") or b"/" if raw else path.encode()}
        endpoint = self.direct.get(scope["path"]) if scope["type"] == "http" else None
        if endpoint is None or scope["method"] != "POST" or scope.get("root_path"):
            await super().__call__(scope, receive, send)
            return
        scope["app"] = self
        request = Request(scope, receive, send)
        try:
            response = await endpoint(request)
        except asyncio.CancelledError:
            # a direct endpoint takes back the cancellations it asked for (Guard): this one is the server's,
            # stopping past its shutdown timeout before this request's answer began. Answered with
            # ``on_shutdown``'s response (a 503 to retry) rather than the server's plain-text 500 and a
            # logged traceback
            task = asyncio.current_task()
            if self.on_shutdown is None or task is None or not task.cancelling():
                raise
            task.uncancel()
            response = self.on_shutdown(request)
        except Exception as exc:
            if self.on_error is not None:
                await (await self.on_error(request, exc))(scope, receive, send)
            raise
        await response(scope, receive, send)


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

    def finish(self) -> None:
        """No cancellation from here on (the response is complete, or the request's cleanup runs)."""
        self.finished = True
        self._watcher.cancel()
