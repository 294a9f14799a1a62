"""Headers a proxy must not forward (RFC 9110 7.6.1), and the router's own to its agents."""

from __future__ import annotations

from collections.abc import Iterable

HOP_BY_HOP = frozenset(
    {
        "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection", "te",
        "trailer", "trailers", "transfer-encoding", "upgrade",
    }
)
HOP_BY_HOP_RAW = frozenset(name.encode() for name in HOP_BY_HOP)  # for raw ASGI / httpx header lists


def connection_listed(headers: Iterable[tuple[bytes, bytes]]) -> frozenset[bytes]:
    """The names ``Connection`` headers list, hop-by-hop too (RFC 9110 7.6.1); ``headers`` is a raw list
    with lower-case names."""
    return frozenset(
        name.strip().lower() for key, value in headers if key == b"connection" for name in value.split(b",")
    )

# The router to an agent (neither is forwarded further): the agent token, and "1" when the body the router
# parsed asks for a stream - the agent then passes it on without parsing the JSON a second time; without
# it the agent looks for itself.
TOKEN_HEADER = "x-macpool-token"
STREAM_HEADER = "x-macpool-stream"
# the session a request names (a digest of it): the agent keeps a session in one slot (node_agent/slots.py)
SESSION_HEADER = "x-macpool-session"
