"""Anthropic Messages (``/v1/messages``, ``/v1/messages/count_tokens``) as llama-server serves them.

llama-server converts the request into a chat completion request (``server_chat_convert_anthropic_to_oai``,
tools/server/server-chat.cpp) and runs that; only the fields named there survive the conversion (``n``,
``ignore_eos`` and the other llama.cpp extensions do not). The answer and the stream's events are
``to_json_anthropic*`` (tools/server/server-task.cpp): named SSE events, no ``[DONE]``. Errors keep
llama-server's own document (``{"error": {"code", "message", "type"}}``), not Anthropic's.
"""

from __future__ import annotations

from typing import Any

from macpool.sim import shapes
from macpool.sim.chat import server_error, string
from macpool.sim.engine import Task
from macpool.sim.shapes import event

DEFAULT_MAX_TOKENS = 4096  # llama-server's, when the request names none
_PASSED = ("temperature", "top_p", "top_k", "stream", "chat_template_kwargs")
_BILLING_HEADER = "x-anthropic-billing-header:"


def to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat completion request llama-server makes of a Messages request."""
    messages: list[Any] = []
    system = body.get("system")
    if system is not None:
        messages.append({"role": "system", "content": _system_text(system)})
    if "messages" not in body:
        raise server_error("'messages' is required")
    if isinstance(body["messages"], list):
        for message in body["messages"]:
            messages += _converted(message)
    chat: dict[str, Any] = {"messages": messages}
    tools = body.get("tools")
    if isinstance(tools, list):
        chat["tools"] = [_tool(tool) for tool in tools]
    if "stop_sequences" in body:
        chat["stop"] = body["stop_sequences"]
    chat["max_tokens"] = body.get("max_tokens", DEFAULT_MAX_TOKENS)
    chat.update({key: body[key] for key in _PASSED if key in body})
    return chat


def _system_text(system: Any) -> str:
    if isinstance(system, str):
        return _normalized(system)
    if isinstance(system, list):
        texts = [string(block, "text") for block in system if string(block, "type") == "text"]
        return "".join(_normalized(text) for text in texts)
    return ""


def _normalized(text: str) -> str:
    # Claude Code stamps its system prompt with a per-request "cch=xxxxx;" that would defeat the prompt
    # cache; llama-server overwrites it with f's
    if not text.startswith(_BILLING_HEADER):
        return text
    at = text.find("cch=", len(_BILLING_HEADER))
    start = at + 4
    if at < 0 or start + 5 >= len(text) or text[start + 5] != ";":
        return text
    return text[:start] + "fffff" + text[start + 5 :]


def _converted(message: Any) -> list[Any]:
    role = string(message, "role")
    if not isinstance(message, dict) or "content" not in message:
        return [] if role == "assistant" else [message]
    content = message["content"]
    if not isinstance(content, list):
        return [message]
    parts: list[Any] = []
    tool_calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    reasoning = ""
    for block in content:
        kind = string(block, "type")
        if kind == "text":
            parts.append(block)
        elif kind == "thinking":
            reasoning += string(block, "thinking")
        elif kind == "image":
            parts += _image(block.get("source"))
        elif kind == "tool_use":
            arguments = block.get("input")
            arguments = {} if arguments is None else arguments
            tool_calls.append({"id": string(block, "id"), "type": "function", "function": {
                "name": string(block, "name"), "arguments": shapes.dumps(arguments).decode(),
            }})
        elif kind == "tool_result":
            results.append({"role": "tool", "tool_call_id": string(block, "tool_use_id"),
                            "content": _result_content(block.get("content"))})
    out: list[Any] = []
    if parts or tool_calls or reasoning:
        converted: dict[str, Any] = {"role": role, "content": parts or ""}
        if tool_calls:
            converted["tool_calls"] = tool_calls
        if reasoning:
            converted["reasoning_content"] = reasoning
        out.append(converted)
    return out + results


def _image(source: Any) -> list[dict[str, Any]]:
    kind = string(source, "type")
    if kind == "base64":
        url = f"data:{string(source, 'media_type', 'image/jpeg')};base64,{string(source, 'data')}"
    elif kind == "url":
        url = string(source, "url")
    else:
        return []
    return [{"type": "image_url", "image_url": {"url": url}}]


def _result_content(content: Any) -> Any:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    parts: list[dict[str, Any]] = []
    for item in content:
        kind = string(item, "type")
        if kind == "text":
            parts.append({"type": "text", "text": string(item, "text")})
        elif kind == "image":
            parts += _image(item.get("source"))
    if any(part["type"] != "text" for part in parts):
        return parts
    return "".join(part["text"] for part in parts)  # text only: one plain string


def _tool(tool: Any) -> dict[str, Any]:
    schema = tool.get("input_schema", {}) if isinstance(tool, dict) else {}
    return {"type": "function", "function": {
        "name": string(tool, "name"), "description": string(tool, "description"), "parameters": schema,
    }}


def count_answer(n_tokens: int) -> dict[str, Any]:
    return {"input_tokens": n_tokens}


def stop_reason(task: Task) -> str:
    return "max_tokens" if task.finish_reason == "length" else "end_turn"


def usage(task: Task) -> dict[str, int]:
    return {
        "cache_read_input_tokens": task.n_cache, "input_tokens": task.n_prompt - task.n_cache,
        "output_tokens": task.n_decoded,
    }


class MessagesShaper:
    """The answer to one Messages request, whole or as its stream's events."""

    def __init__(self, model: str) -> None:
        self.id = shapes.completion_id()
        self.model = model

    def answer(self, task: Task, text: str) -> dict[str, Any]:
        return {
            "id": self.id, "type": "message", "role": "assistant",
            "content": [{"type": "text", "text": text}] if text else [], "model": self.model,
            "stop_reason": stop_reason(task), "stop_sequence": None, "usage": usage(task),
        }

    def start(self, task: Task) -> list[bytes]:
        """The events of the first token: the message, then its text block."""
        message: dict[str, Any] = {
            "id": self.id, "type": "message", "role": "assistant", "content": [], "model": self.model,
            "stop_reason": None, "stop_sequence": None, "usage": {**usage(task), "output_tokens": 0},
        }
        block = {"type": "text", "text": ""}
        return [
            event("message_start", {"type": "message_start", "message": message}),
            event("content_block_start", {"type": "content_block_start", "index": 0, "content_block": block}),
        ]

    @staticmethod
    def delta(text: str) -> bytes:
        delta = {"type": "text_delta", "text": text}
        return event("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta})

    @staticmethod
    def stop(task: Task) -> list[bytes]:
        """The events after the last token."""
        delta = {"stop_reason": stop_reason(task), "stop_sequence": None}
        return [
            event("content_block_stop", {"type": "content_block_stop", "index": 0}),
            event("message_delta", {"type": "message_delta", "delta": delta,
                                    "usage": {"output_tokens": task.n_decoded}}),
            event("message_stop", {"type": "message_stop"}),
        ]
