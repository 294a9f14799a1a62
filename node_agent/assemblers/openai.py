"""OpenAI chat and completions: ``chat.completion.chunk`` or ``text_completion`` events folded into one."""

from __future__ import annotations

from typing import Any

from . import Assembler

_HEAD = ("created", "model", "system_fingerprint", "id")  # the last event's, as the non-streamed answer's
# the non-streamed answer's fields in its order (server-task.cpp to_json_oaicompat*)
_ORDER = ("choices", "created", "model", "system_fingerprint", "object", "usage", "id", "timings")


class _Choices(Assembler):
    """What chat and completions share: one choice's finish reason, and the usage and timings of the last
    events (asked for with ``stream_options.include_usage``)."""

    def __init__(self) -> None:
        super().__init__()
        self._text: list[str] = []
        self._finish_reason: str | None = None
        self._last: dict[str, Any] = {}
        self._extra: dict[str, Any] = {}

    def fold(self, event: dict[str, Any]) -> None:
        self._last = event
        for key in ("usage", "timings"):
            if key in event:
                self._extra[key] = event[key]
        for choice in event.get("choices") or []:
            if choice.get("finish_reason"):
                self._finish_reason = choice["finish_reason"]
            self.fold_choice(choice)

    def fold_choice(self, choice: dict[str, Any]) -> None:
        raise NotImplementedError

    @property
    def complete(self) -> bool:
        return self._finish_reason is not None

    def _document(self, choice: dict[str, Any], kind: str) -> dict[str, Any]:
        head = {key: self._last[key] for key in _HEAD if key in self._last}
        document = {"choices": [choice], **head, "object": kind, **self._extra}
        return {**{key: document[key] for key in _ORDER if key in document}, **document}


class ChatAssembler(_Choices):
    """``/v1/chat/completions``: content, reasoning and tool calls from the deltas."""

    def __init__(self) -> None:
        super().__init__()
        self._reasoning: list[str] = []
        self._tool_calls: dict[int, dict[str, Any]] = {}

    def fold_choice(self, choice: dict[str, Any]) -> None:
        delta = choice.get("delta") or {}
        self._text.append(str(delta.get("content") or ""))
        self._reasoning.append(str(delta.get("reasoning_content") or ""))
        for call in delta.get("tool_calls") or []:
            self._merge_tool_call(call)

    def _merge_tool_call(self, call: dict[str, Any]) -> None:
        merged = self._tool_calls.setdefault(
            int(call.get("index", 0)), {"type": "function", "function": {"name": "", "arguments": ""}}
        )
        if call.get("id"):
            merged["id"] = call["id"]
        function = call.get("function") or {}
        merged["function"]["name"] += function.get("name") or ""
        merged["function"]["arguments"] += function.get("arguments") or ""

    def result(self, request: dict[str, Any]) -> dict[str, Any]:
        text = "".join(self._text)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        reasoning = "".join(self._reasoning)
        if reasoning:
            message["reasoning_content"] = reasoning
        if self._tool_calls:
            message["tool_calls"] = [self._tool_calls[index] for index in sorted(self._tool_calls)]
            message["content"] = text or None
        choice = {"finish_reason": self._finish_reason, "index": 0, "message": message}
        return self._document(choice, "chat.completion")


class CompletionsAssembler(_Choices):
    """``/v1/completions``: the choice's text."""

    def fold_choice(self, choice: dict[str, Any]) -> None:
        self._text.append(str(choice.get("text") or ""))

    def result(self, request: dict[str, Any]) -> dict[str, Any]:
        text = "".join(self._text)
        choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": self._finish_reason}
        return self._document(choice, "text_completion")
