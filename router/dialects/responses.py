"""OpenAI's Responses API (``/v1/responses``, ``/v1/responses/input_tokens``): Codex and the ``openai``
SDK's ``responses``.

Errors before the first byte are OpenAI's document; a failure after it ends the stream with
``response.failed``, the event the Responses API ends a failed response with.
"""

from __future__ import annotations

from typing import Any

from macpool.contract import generations
from router.dialects.base import Dialect, Usage, last_object, number
from router.dialects.chat import message_parts


class Responses(Dialect):
    name = "responses"
    limit_fields = ("max_output_tokens",)
    stream_end = b'"response.completed"}\n\n'
    count_path = "/v1/responses/input_tokens"

    def generations(self, payload: dict[str, Any]) -> int:
        return generations(payload)  # llama-server passes n on: n > 1 runs n generations

    def prefix_parts(self, payload: dict[str, Any]) -> list[bytes]:
        head = {key: payload[key] for key in ("tools", "instructions") if payload.get(key)}
        items = payload.get("input")
        if isinstance(items, str):
            items = [{"role": "user", "content": items}]
        return message_parts(head, items)

    def usage(self, head: bytes, tail: bytes) -> Usage | None:
        usage = last_object(tail, b"usage")
        if usage is None:
            return None
        details = usage.get("input_tokens_details")
        cached = number(details.get("cached_tokens")) if isinstance(details, dict) else 0
        return Usage(number(usage.get("input_tokens")), number(usage.get("output_tokens")), cached)


DIALECT = Responses()
