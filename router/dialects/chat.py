"""OpenAI chat completions (``/v1/chat/completions``; its token count and ``/apply-template`` read alike)."""

from __future__ import annotations

from typing import Any

from macpool.contract import generations
from router.dialects.base import Dialect, canonical

MAX_PARTS = 256  # messages hashed for affinity: a longer conversation keeps its node by its first ones


def message_parts(head: dict[str, Any], messages: object) -> list[bytes]:
    """``head`` (what the template renders before the messages: tools, a system prompt), then each message."""
    if not isinstance(messages, list):
        return []
    first = [canonical(head)] if head else []
    return first + [canonical(message) for message in messages[:MAX_PARTS]]


class Chat(Dialect):
    name = "chat"
    count_path = "/v1/chat/completions/input_tokens"

    def generations(self, payload: dict[str, Any]) -> int:
        return generations(payload)

    def prefix_parts(self, payload: dict[str, Any]) -> list[bytes]:
        tools = payload.get("tools")
        return message_parts({"tools": tools} if tools else {}, payload.get("messages"))


DIALECT = Chat()
