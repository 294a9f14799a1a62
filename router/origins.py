"""Browser origins: a request a web page on another origin sends is refused (403), unless ``--cors-origins``
allows that origin; and with ``--allowed-hosts``, a request addressed to a host name not on that list (400).

A browser marks what a page sends with ``Origin``; a client that is not a browser (an SDK, curl, a coding
agent) sends none and is not concerned. Without this check a page opened anywhere on the LAN could send
"simple" cross-site requests to the router (they need no preflight), which would burn GPU time or load models
even though the page never reads the answer. The router's own pages (the dashboard) are same-origin: their
``Origin`` names the host the request is addressed to.

That last rule cannot tell the router's page from one that rebinds its own name to the router's address
(DNS rebinding): the page's ``Origin`` and the ``Host`` it sends both carry the page's name. ``Host`` always
names what the client asked for, so a list of the names the router answers to refuses such a page. An IP
address or ``localhost`` is no page's name but the router's or this machine's own, so they always pass.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from macpool.apis import APIS
from macpool.errors import error_response
from macpool.settings import origin_list
from router.dialects import api_of


class OriginGuard:
    """Refuse an HTTP request whose ``Origin`` is neither the router's own nor one of ``allowed``, or, with
    ``hosts``, whose ``Host`` is a name not on that list."""

    def __init__(self, app: ASGIApp, allowed: str | None, hosts: str | None = None) -> None:
        self.app = app
        self.allowed = set(origin_list(allowed or ""))
        self.hosts = {h.lower() for h in origin_list(hosts or "")}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = Headers(scope=scope)
            host = headers.get("host", "")
            if self.hosts and not self.serves(host):
                response = host_refusal(scope["path"], host)
                await response(scope, receive, send)
                return
            origin = headers.get("origin")
            if origin is not None and not self.allows(origin, host):
                response = refusal(scope["path"], origin)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def allows(self, origin: str, host: str) -> bool:
        if "*" in self.allowed or origin in self.allowed:
            return True
        netloc = urlsplit(origin).netloc
        return bool(netloc) and netloc.lower() == host.lower()  # the router's own page

    def serves(self, host: str) -> bool:
        """Whether ``host`` (a ``Host`` header: name or address, and maybe a port) is one the router answers
        to: an address, localhost, a listed name or a name under a listed ``*.domain``; or none at all, which
        no browser sends (a balancer's HTTP/1.0 health check does)."""
        name = urlsplit("//" + host).hostname or ""  # lower case, without port or IPv6 brackets
        if not name:
            return True
        try:
            ipaddress.ip_address(name)
            return True
        except ValueError:
            pass
        if name == "localhost" or name.endswith(".localhost") or name in self.hosts:
            return True
        return any(h.startswith("*.") and name.endswith(h[1:]) for h in self.hosts)


def host_refusal(path: str, host: str) -> Response:
    """The 400 for a request addressed to a host name the router does not answer to, in the path's
    dialect."""
    message = f"this router does not answer to the host name {host[:100]!r} (--allowed-hosts)"
    if path in APIS:
        return api_of(path)[1].error(400, message, "host_not_allowed")
    return error_response(400, message, "host_not_allowed")


def refusal(path: str, origin: str) -> Response:
    """The 403 in the path's own dialect (Anthropic's error document on /v1/messages)."""
    message = f"requests from the browser origin {origin[:100]!r} are not allowed (--cors-origins)"
    if path in APIS:
        return api_of(path)[1].error(403, message, "origin_not_allowed")
    return error_response(403, message, "origin_not_allowed")
