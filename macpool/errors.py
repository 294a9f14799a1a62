"""OpenAI-shaped error responses: ``{"error": {"message", "type", "code"}}`` with the right status."""

from __future__ import annotations

import json

from starlette.responses import Response

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "upstream_error",
    503: "unavailable_error",
    504: "timeout_error",
}


def error_body(status: int, message: str, code: str, type_: str | None = None) -> bytes:
    error = {"message": message, "type": type_ or _TYPES.get(status, "server_error"), "code": code}
    return json.dumps({"error": error}).encode()


def error_response(
    status: int,
    message: str,
    code: str,
    headers: dict[str, str] | None = None,
    type_: str | None = None,
) -> Response:
    return Response(
        error_body(status, message, code, type_),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )
