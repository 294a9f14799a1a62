"""Error answers in the caller's dialect, with the right status: OpenAI's ``{"error": {"message", "type",
"code"}}`` on every API but Anthropic's Messages, whose callers get ``{"type": "error", "error": {"type",
"message"}}`` (with the macpool code beside them). A failure after a stream's first byte ends the stream with
the event its API ends one with: an OpenAI ``data:`` error, Anthropic's ``event: error``, the Responses
API's ``response.failed``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

ExceptionHandler = Callable[[Request, Exception], Awaitable[Response]]

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "upstream_error",
    503: "unavailable_error",
    504: "timeout_error",
}


_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}
# refusals for a pool full now: Anthropic's own API answers 529 overloaded_error when it is, and its SDK and
# Claude Code retry that (honouring Retry-After)
_OVERLOADED = frozenset({"pool_full", "queue_timeout", "batch_shed"})


def error_status(status: int, code: str, dialect: str = "chat") -> int:
    """The status a caller of ``dialect`` gets for an error of ``status`` and ``code``."""
    return 529 if dialect == "messages" and status == 503 and code in _OVERLOADED else status


def error_body(
    status: int, message: str, code: str, type_: str | None = None, dialect: str = "chat"
) -> bytes:
    """The error document in the caller's ``dialect`` (macpool/apis.py)."""
    if dialect == "messages":
        kind = _ANTHROPIC_TYPES.get(error_status(status, code, dialect), "api_error")
        anthropic = {"type": kind, "message": message, "code": code}
        return json.dumps({"type": "error", "error": anthropic}).encode()
    error = {"message": message, "type": type_ or _TYPES.get(status, "server_error"), "code": code}
    return json.dumps({"error": error}).encode()


def sse_error(status: int, message: str, code: str, *, ended: bool = True, dialect: str = "chat") -> bytes:
    """An error as the SSE event that ends a stream of ``dialect``. ``ended``: the stream's last chunk
    closed its event; if not, the error starts a new one rather than extend it."""
    head = b"" if ended else b"\n\n"
    if dialect == "messages":
        return head + b"event: error\ndata: " + error_body(status, message, code, dialect=dialect) + b"\n\n"
    if dialect == "responses":
        failed = {"type": "response.failed", "response": {
            "object": "response", "status": "failed", "output": [],
            "error": {"code": code, "message": message},
        }}
        return head + b"event: response.failed\ndata: " + json.dumps(failed).encode() + b"\n\n"
    return head + b"data: " + error_body(status, message, code) + b"\n\n"


def error_response(
    status: int,
    message: str,
    code: str,
    headers: dict[str, str] | None = None,
    type_: str | None = None,
    dialect: str = "chat",
) -> Response:
    return Response(
        error_body(status, message, code, type_, dialect),
        status_code=error_status(status, code, dialect),
        media_type="application/json",
        headers=headers,
    )


def exception_handlers(service: str, log: logging.Logger) -> dict[Any, ExceptionHandler]:
    """Starlette's ``exception_handlers`` for an app: an HTTPException (no route, a method not allowed) is
    answered with its status and headers (405's Allow); anything else is logged with its traceback and
    answered 500 ``internal <service> error``, with no detail for the client."""

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        codes = {404: "not_found", 405: "method_not_allowed"}
        message = {404: f"no route for {request.url.path}", 405: f"{request.method} is not allowed here"}
        return error_response(
            exc.status_code,
            message.get(exc.status_code, str(exc.detail)),
            codes.get(exc.status_code, "http_error"),
            headers=dict(exc.headers) if exc.headers else None,
        )

    async def internal_error(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return error_response(500, f"internal {service} error", "internal_error")

    return {HTTPException: http_error, Exception: internal_error}
