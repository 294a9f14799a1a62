"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``): Claude Code and the
``anthropic`` SDK.

Errors are Anthropic's document, ``{"type": "error", "error": {"type", "message"}}``, with the macpool
reason as the error's ``code`` beside them (the SDK ignores fields it does not know). A refusal for
capacity is a 529 ``overloaded_error``, the status Anthropic's own API answers when it is overloaded, which
the SDK and Claude Code retry (honouring Retry-After).
"""

from __future__ import annotations

import json
from typing import Any

from router.dialects.base import Dialect, Usage, last_object, number
from router.dialects.chat import message_parts

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    504: "timeout_error",
    529: "overloaded_error",
}
DEFAULT_MAX_TOKENS = 4096  # what llama-server gives a Messages request without max_tokens (server-chat.cpp)
# macpool's refusals for a pool that is full now: Anthropic's "overloaded", to retry
OVERLOADED = frozenset({"pool_full", "queue_timeout", "batch_shed"})


def without_cache_control(value: Any) -> Any:
    """``value`` without ``cache_control`` markers: a client moves them to the newest turn each time, and
    the prompt is the same prompt wherever they sit."""
    if isinstance(value, dict):
        return {k: without_cache_control(v) for k, v in value.items() if k != "cache_control"}
    if isinstance(value, list):
        return [without_cache_control(v) for v in value]
    return value


class Messages(Dialect):
    name = "messages"
    limit_fields = ("max_tokens",)

    def output_limit(self, payload: dict[str, Any]) -> int:
        return super().output_limit(payload) or DEFAULT_MAX_TOKENS

    def prefix_parts(self, payload: dict[str, Any]) -> list[bytes]:
        head = {key: payload[key] for key in ("tools", "system") if payload.get(key)}
        messages = payload.get("messages")
        return message_parts(without_cache_control(head), without_cache_control(messages))

    def usage(self, head: bytes, tail: bytes) -> Usage | None:
        # a stream says the prompt's tokens in message_start, the answer's in its last message_delta; a
        # document says both at its end
        end = last_object(tail, b"usage")
        if end is None:
            return None
        start = end if "input_tokens" in end else last_object(head, b"usage", first=True) or {}
        cached = number(start.get("cache_read_input_tokens"))
        prompt = number(start.get("input_tokens")) + cached + number(start.get("cache_creation_input_tokens"))
        return Usage(prompt, number(end.get("output_tokens")), cached)

    def error_status(self, status: int, code: str) -> int:
        return 529 if status == 503 and code in OVERLOADED else status

    def error_body(self, status: int, message: str, code: str) -> bytes:
        status = self.error_status(status, code)
        kind = _TYPES.get(status, "overloaded_error" if status == 503 else "api_error")
        error = {"type": kind, "message": message, "code": code}
        return json.dumps({"type": "error", "error": error}).encode()

    def stream_error(self, status: int, message: str, code: str, *, ended: bool = True) -> bytes:
        data = self.error_body(status, message, code)
        return (b"" if ended else b"\n\n") + b"event: error\ndata: " + data + b"\n\n"

    def upstream_error(self, status: int, document: dict[str, Any]) -> bytes | None:
        # llama-server answers its Anthropic endpoints' errors in OpenAI's shape
        error = document.get("error")
        if not isinstance(error, dict):
            return None
        message = str(error.get("message") or "")
        code = error.get("type") if isinstance(error.get("type"), str) else ""
        return self.error_body(status, message, str(code))


DIALECT = Messages()
