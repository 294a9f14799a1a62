"""Anthropic Messages (``/v1/messages``): ``message_start``, the content blocks' deltas, ``message_delta`` and
``message_stop`` folded into one ``message``.

llama-server's non-streamed message has at most one thinking block, then at most one text block, then one
``tool_use`` block per tool call (server-task.cpp ``to_json_anthropic``), so the deltas are folded by kind,
not by block index: its stream numbers a tool call's block from the blocks started so far, and its last
event may start a tool call's block again under another index (``to_json_anthropic_stream``).
"""

from __future__ import annotations

import json
from typing import Any

from . import Assembler

_ENDING = ("stop_reason", "stop_sequence")  # message_delta's, unset in message_start's message


class MessagesAssembler(Assembler):
    def __init__(self) -> None:
        super().__init__()
        self._message: dict[str, Any] = {}  # message_start's: id, model, the input side of usage
        self._thinking: list[str] = []
        self._signature: list[str] = []
        self._text: list[str] = []
        self._tools: dict[str, dict[str, Any]] = {}  # tool call id -> its block (with its input's pieces)
        self._tool_at: dict[int, str] = {}  # block index -> tool call id
        self._delta: dict[str, Any] = {}  # message_delta's: stop_reason, stop_sequence
        self._usage: dict[str, Any] = {}  # message_delta's: output_tokens
        self._stopped = False

    def fold(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if kind == "message_start":
            self._message = event.get("message") or {}
        elif kind == "content_block_start":
            self._start(event.get("index"), event.get("content_block") or {})
        elif kind == "content_block_delta":
            self._add(event.get("index"), event.get("delta") or {})
        elif kind == "message_delta":
            self._delta = event.get("delta") or {}
            self._usage = event.get("usage") or {}
        elif kind == "message_stop":
            self._stopped = True

    def _start(self, index: object, block: dict[str, Any]) -> None:
        if block.get("type") != "tool_use" or not isinstance(index, int):
            return
        key = str(block.get("id") or f"#{index}")  # (llama-server gives every tool call an id)
        self._tool_at[index] = key
        self._tools.setdefault(key, {"id": block.get("id"), "name": block.get("name"), "input": []})

    def _add(self, index: object, delta: dict[str, Any]) -> None:
        kind = delta.get("type")
        if kind == "text_delta":
            self._text.append(str(delta.get("text") or ""))
        elif kind == "thinking_delta":
            self._thinking.append(str(delta.get("thinking") or ""))
        elif kind == "signature_delta":
            self._signature.append(str(delta.get("signature") or ""))
        elif kind == "input_json_delta" and isinstance(index, int) and index in self._tool_at:
            self._tools[self._tool_at[index]]["input"].append(str(delta.get("partial_json") or ""))

    @property
    def complete(self) -> bool:
        return self._stopped and bool(self._message)

    def result(self, request: dict[str, Any]) -> dict[str, Any]:
        content: list[dict[str, Any]] = []
        thinking = "".join(self._thinking)
        if thinking:
            content.append({"type": "thinking", "thinking": thinking, "signature": "".join(self._signature)})
        text = "".join(self._text)
        if text:
            content.append({"type": "text", "text": text})
        for tool in self._tools.values():
            content.append({"type": "tool_use", "id": tool["id"], "name": tool["name"],
                            "input": _input("".join(tool["input"]))})
        usage = {**(self._message.get("usage") or {}), **self._usage}
        ending: dict[str, Any] = {key: self._delta[key] for key in _ENDING if key in self._delta}
        # message_start's message lists the non-streamed one's fields, in its order
        return {**self._message, "content": content, **ending, "usage": usage}


def _input(arguments: str) -> Any:
    """A tool call's input: its arguments parsed, or ``{}`` when they are not JSON (as llama-server does)."""
    try:
        return json.loads(arguments, parse_constant=_not_json)
    except (ValueError, RecursionError):
        return {}


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # Python's parser takes NaN and Infinity; llama-server's does not
