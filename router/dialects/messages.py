"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``): Claude Code and the
``anthropic`` SDK.

Errors are Anthropic's document (macpool/errors.py): ``{"type": "error", "error": {"type", "message"}}``,
with the macpool reason as the error's ``code`` beside them (the SDK ignores fields it does not know); a
refusal for capacity is a 529 ``overloaded_error``.
"""

from __future__ import annotations

import re
from typing import Any

from macpool.errors import error_body
from router.dialects.base import Dialect, Usage, last_object, number
from router.dialects.chat import MAX_PARTS, message_parts

DEFAULT_MAX_TOKENS = 4096  # what llama-server gives a Messages request without max_tokens (server-chat.cpp)


# Claude Code's system prompt opens with a billing line whose cch= stamp changes with every request;
# llama-server writes it as fffff so that turns share their cached prefix (server-chat.cpp), and so do we
_BILLING_STAMP = re.compile(r"\A(x-anthropic-billing-header:.*?cch=)[^;]{5};", re.DOTALL)


def without_billing_stamp(system: Any) -> Any:
    """``system`` (a string or text blocks) with its billing stamp written as llama-server writes it."""
    if isinstance(system, str):
        return _BILLING_STAMP.sub(r"\1fffff;", system, count=1)
    if isinstance(system, list):
        return [{**block, "text": without_billing_stamp(block["text"])}
                if isinstance(block, dict) and isinstance(block.get("text"), str) else block
                for block in system]
    return system


def without_cache_control(value: Any) -> Any:
    """``value`` without ``cache_control`` markers: a client moves them to the newest turn each time, and
    the prompt is the same prompt wherever they sit."""
    if isinstance(value, dict):
        return {k: without_cache_control(v) for k, v in value.items() if k != "cache_control"}
    if isinstance(value, list):
        return [without_cache_control(v) for v in value]
    return value


def as_blocks(message: Any) -> Any:
    """A message with its content as blocks: Claude Code sends a message as a list of blocks in one turn and
    as a plain string in the next, which llama-server renders alike."""
    if isinstance(message, dict) and isinstance(message.get("content"), str):
        return {**message, "content": [{"type": "text", "text": message["content"]}]}
    return message


class Messages(Dialect):
    name = "messages"
    limit_fields = ("max_tokens",)
    stream_end = b'"message_stop"}\n\n'
    count_path = "/v1/messages/count_tokens"

    def output_limit(self, payload: dict[str, Any]) -> int:
        return super().output_limit(payload) or DEFAULT_MAX_TOKENS

    def prefix_parts(self, payload: dict[str, Any]) -> list[bytes]:
        head = {key: payload[key] for key in ("tools", "system") if payload.get(key)}
        if "system" in head:
            head["system"] = without_billing_stamp(head["system"])
        messages = payload.get("messages")
        if isinstance(messages, list):
            messages = [as_blocks(message) for message in messages[:MAX_PARTS]]
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

    def upstream_error(self, status: int, document: dict[str, Any]) -> bytes | None:
        # llama-server answers its Anthropic endpoints' errors in OpenAI's shape
        error = document.get("error")
        if not isinstance(error, dict):
            return None
        message = str(error.get("message") or "")
        code = error.get("type") if isinstance(error.get("type"), str) else ""
        return error_body(status, message, str(code), dialect=self.name)


DIALECT = Messages()
