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

import ssl
from pathlib import Path
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


def tls_options(cert: Path | None, key: Path | None, client_ca: Path | None = None) -> dict[str, Any]:
    """uvicorn's documented TLS options: serve HTTPS with ``cert`` and ``key`` (none: plain HTTP); with
    ``client_ca``, every client must show a certificate of that CA (mutual TLS) or the handshake fails."""
    if cert is None:
        return {}
    options: dict[str, Any] = {"ssl_certfile": str(cert), "ssl_keyfile": str(key) if key else None}
    if client_ca is not None:
        options |= {"ssl_ca_certs": str(client_ca), "ssl_cert_reqs": ssl.CERT_REQUIRED}
    return options


def check_tls_files(
    cert: Path | None, key: Path | None, ca: Path | None, names: tuple[str, str, str]
) -> None:
    """ValueError naming the flag of a TLS file that is missing or does not load, or of a key given without
    its certificate; ``names`` are the flags of ``cert``, ``key`` and ``ca``."""
    cert_flag, key_flag, ca_flag = names
    for flag, path in zip(names, (cert, key, ca), strict=True):
        if path is not None and not path.is_file():
            raise ValueError(f"{flag} {str(path)!r}: no such file")
    if key is not None and cert is None:
        raise ValueError(f"{key_flag} without {cert_flag}: the key of which certificate?")
    try:
        if cert is not None:
            ssl.create_default_context().load_cert_chain(cert, key)
    except ssl.SSLError as exc:
        raise ValueError(f"{cert_flag} {str(cert)!r} and {key_flag}: not a PEM certificate and its key "
                         f"({exc.reason or exc})") from None
    try:
        if ca is not None:
            ssl.create_default_context(cafile=str(ca))
    except ssl.SSLError as exc:
        raise ValueError(f"{ca_flag} {str(ca)!r}: not a PEM CA certificate ({exc.reason or exc})") from None
