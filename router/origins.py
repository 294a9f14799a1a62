"""Browser origins: a request a web page on another origin sends is refused (403), unless ``--cors-origins``
allows that origin.

A browser marks what a page sends with ``Origin``; a client that is not a browser (an SDK, curl, a coding
agent) sends none and is not concerned. Without this check a page opened anywhere on the LAN could send
"simple" cross-site requests to the router (they need no preflight), which would burn GPU time or load models
even though the page never reads the answer. The router's own pages (the dashboard) are same-origin: their
``Origin`` names the host the request is addressed to.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from macpool.apis import APIS
from macpool.errors import error_response
from macpool.settings import origin_list
from router.dialects import api_of


class OriginGuard:
    """Refuse an HTTP request whose ``Origin`` is neither the router's own nor one of ``allowed``."""

    def __init__(self, app: ASGIApp, allowed: str | None) -> None:
        self.app = app
        self.allowed = set(origin_list(allowed or ""))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = Headers(scope=scope)
            origin = headers.get("origin")
            if origin is not None and not self.allows(origin, headers.get("host", "")):
                response = refusal(scope["path"], origin)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def allows(self, origin: str, host: str) -> bool:
        if "*" in self.allowed or origin in self.allowed:
            return True
        netloc = urlsplit(origin).netloc
        return bool(netloc) and netloc.lower() == host.lower()  # the router's own page


def refusal(path: str, origin: str) -> Response:
    """The 403 in the path's own dialect (Anthropic's error document on /v1/messages)."""
    message = f"requests from the browser origin {origin[:100]!r} are not allowed (--cors-origins)"
    if path in APIS:
        return api_of(path)[1].error(403, message, "origin_not_allowed")
    return error_response(403, message, "origin_not_allowed")
