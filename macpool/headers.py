"""Headers a proxy must not forward (RFC 9110 7.6.1), shared by the router and the agent's gateway."""

from __future__ import annotations

HOP_BY_HOP = frozenset(
    {
        "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection", "te",
        "trailer", "trailers", "transfer-encoding", "upgrade",
    }
)
HOP_BY_HOP_RAW = frozenset(name.encode() for name in HOP_BY_HOP)  # for raw ASGI / httpx header lists
