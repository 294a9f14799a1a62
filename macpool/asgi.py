"""A Starlette application whose hot POST endpoints skip Starlette's routing and middleware."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

Endpoint = Callable[[Request], Awaitable[Response]]
ErrorHandler = Callable[[Request, Exception], Awaitable[Response]]


class DirectPosts(Starlette):
    """Starlette, except that a POST to one of ``direct``'s paths goes straight to its endpoint.

    Those endpoints relay streamed responses chunk by chunk, and Starlette's routing and middleware wrap
    every send of every chunk (docs/profiles/router-findings.md, finding 3). Everything else - other
    methods on those paths included - is routed by Starlette as usual. An exception from a direct
    endpoint is answered like Starlette's ``ServerErrorMiddleware`` does: ``on_error``'s response (when
    given), then re-raised for the server to log.
    """

    def __init__(self, direct: Mapping[str, Endpoint], on_error: ErrorHandler | None = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.direct = dict(direct)
        self.on_error = on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = self.direct.get(scope["path"]) if scope["type"] == "http" else None
        if endpoint is None or scope["method"] != "POST" or scope.get("root_path"):
            await super().__call__(scope, receive, send)
            return
        scope["app"] = self
        request = Request(scope, receive, send)
        try:
            response = await endpoint(request)
        except Exception as exc:
            if self.on_error is not None:
                await (await self.on_error(request, exc))(scope, receive, send)
            raise
        await response(scope, receive, send)
