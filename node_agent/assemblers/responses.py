"""OpenAI Responses (``/v1/responses``): the stream's ``response.completed`` event carries the response whole.

It differs from the non-streamed one (server-task.cpp ``to_json_oaicompat_resp`` and ``_resp_stream``) in
two fields only: it has no ``completed_at`` (which the non-streamed response reads from the same clock as
``created_at``, at the same moment), and its reasoning items have no ``status``. Keys are put in the
non-streamed document's order too.
"""

from __future__ import annotations

from typing import Any

from . import Assembler

_TOP = ("completed_at", "created_at", "id", "model", "object", "output", "status", "usage")
_MESSAGE = ("content", "id", "role", "status", "type")  # a message item's keys, in the non-streamed order


class ResponsesAssembler(Assembler):
    def __init__(self) -> None:
        super().__init__()
        self._response: dict[str, Any] | None = None

    def fold(self, event: dict[str, Any]) -> None:
        if event.get("type") == "response.completed" and isinstance(event.get("response"), dict):
            self._response = event["response"]

    @property
    def complete(self) -> bool:
        return self._response is not None

    def result(self, request: dict[str, Any]) -> dict[str, Any]:
        streamed = self._response or {}
        response = {**streamed, "completed_at": streamed.get("created_at"),
                    "output": [_item(item) for item in streamed.get("output") or []]}
        ordered = {key: response[key] for key in _TOP if key in response}
        return {**ordered, **response}


def _item(item: Any) -> Any:
    if not isinstance(item, dict):
        return item
    if item.get("type") == "reasoning":
        return {**item, "status": item.get("status", "completed")}
    if item.get("type") == "message":
        ordered = {key: item[key] for key in _MESSAGE if key in item}
        return {**ordered, **item}
    return item
