"""How the router and the agent are served: one uvicorn Config, built from uvicorn's documented options.

What guards a request at which layer (docs/reliability.md, "Which layer guards what"):

- uvicorn (here): HTTP/1.1 parsing (httptools when installed, else h11), no WebSocket (an upgrade offer is
  not taken), idle keep-alive connections closed after ``keep_alive`` seconds, in-flight requests given
  ``graceful_shutdown`` seconds at shutdown; on h11, a head over ``MAX_HEAD_BYTES`` is refused.
- the ASGI applications (macpool/asgi.py, router/app.py, node_agent/gateway.py): a body's size (413) and
  the time to read it (408), OpenAI-shaped 404/405/500, the trailing-slash rule.
- the fronting proxy (deploy/haproxy/haproxy.cfg): bounds on a request's head (size, field count, target
  length), the time to send it, and a client that connects and sends nothing.
"""

from __future__ import annotations

from typing import Any

import uvicorn
from starlette.types import ASGIApp

# the most a request's head may hold where uvicorn bounds it (h11); the fronting proxy bounds it always
MAX_HEAD_BYTES = 64 * 1024


def server_config(app: ASGIApp, *, keep_alive: int, graceful_shutdown: int, **options: Any) -> uvicorn.Config:
    """The uvicorn Config for ``app``; ``options`` are further uvicorn.Config arguments (host, port, ...)."""
    return uvicorn.Config(
        app,
        http="auto",  # httptools when installed (uvicorn[standard]), else h11
        ws="none",  # neither process serves WebSocket: an upgrade offer is not taken
        h11_max_incomplete_event_size=MAX_HEAD_BYTES,
        timeout_keep_alive=keep_alive,
        timeout_graceful_shutdown=graceful_shutdown,
        server_header=False,
        log_config=None,  # uvicorn's loggers write through the root logger's format (macpool/logs.py)
        **options,
    )
