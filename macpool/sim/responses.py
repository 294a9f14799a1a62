"""OpenAI Responses (``/v1/responses``, ``/responses``, their ``/input_tokens``) as llama-server serves them.

llama-server converts the request into a chat completion request
(``server_chat_convert_responses_to_chatcmpl``, tools/server/server-chat.cpp): ``instructions`` become a
system message, ``input`` the messages, ``max_output_tokens`` the ``max_tokens``, and every other field goes
through as it is. The answer and the stream's events are ``to_json_oaicompat_resp*``
(tools/server/server-task.cpp): named SSE events, no ``[DONE]``.
"""

from __future__ import annotations

import time
from typing import Any

from macpool.sim import tokens
from macpool.sim.chat import invalid, string
from macpool.sim.engine import Task
from macpool.sim.shapes import event, random_id

_INPUT_ROLES = ("user", "system", "developer")
_CALL_FIELDS = ("arguments", "call_id", "name")


def to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat completion request llama-server makes of a Responses request."""
    if "input" not in body:
        raise invalid("'input' is required")
    if string(body, "previous_response_id"):
        raise invalid("llama.cpp does not support 'previous_response_id'.")
    chat = {key: value for key, value in body.items() if key not in ("input", "instructions")}
    messages: list[dict[str, Any]] = []
    if "instructions" in body:
        messages.append({"role": "system", "content": string(body, "instructions")})
    given = body["input"]
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    elif isinstance(given, list):
        for item in given:
            _add_item(messages, item)
    else:
        raise invalid("'input' must be a string or array of objects")
    chat["messages"] = messages
    if "tools" in body:
        chat.pop("tools")
        if not isinstance(body["tools"], list):
            raise invalid("'tools' must be an array of objects")
        functions = [_function(tool) for tool in body["tools"] if string(tool, "type") == "function"]
        if functions:
            chat["tools"] = functions
    if "max_output_tokens" in body:
        chat["max_tokens"] = chat.pop("max_output_tokens")
    if "reasoning" in body:
        reasoning = chat.pop("reasoning")
        if isinstance(reasoning, dict) and "effort" in reasoning:
            chat["reasoning_effort"] = reasoning["effort"]
    return chat


def _add_item(messages: list[dict[str, Any]], item: Any) -> None:
    """One input item: a message of the caller's, an earlier answer, a tool call or its output."""
    if not isinstance(item, dict):
        raise invalid("Cannot determine type of 'item'")
    after_assistant = bool(messages) and messages[-1].get("role") == "assistant"
    content, kind, role = item.get("content"), string(item, "type"), item.get("role")
    if isinstance(content, str):  # an input message's text: the same as one input_text part
        item = {**item, "content": [{"text": content, "type": "input_text"}]}
        content = item["content"]
    if isinstance(content, list) and role in _INPUT_ROLES:
        message = {k: v for k, v in item.items() if k not in ("type", "status")}
        messages.append({**message, "content": [_input_part(part) for part in content]})
    elif role == "assistant" and kind == "message":
        parts = [_output_part(part) for part in content] if isinstance(content, list) else []
        if after_assistant:
            previous = messages[-1]
            if not isinstance(previous.get("content"), list):
                previous["content"] = []
            previous["content"] += parts
        else:
            message = {k: v for k, v in item.items() if k not in ("type", "status")}
            messages.append({**message, "content": parts})
    elif kind == "function_call" and all(isinstance(item.get(k), str) for k in _CALL_FIELDS):
        call = {"function": {"arguments": item["arguments"], "name": item["name"]}, "id": item["call_id"],
                "type": "function"}
        if after_assistant:
            messages[-1].setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "tool_calls": [call]})
    elif kind == "function_call_output" and isinstance(item.get("call_id"), str) and isinstance(
        item.get("output"), str | list
    ):
        output = _tool_output(item["output"])
        messages.append({"content": output, "role": "tool", "tool_call_id": item["call_id"]})
    elif kind == "reasoning" and isinstance(item.get("summary"), list):
        text = _reasoning_text(item.get("content"))
        if after_assistant:
            messages[-1]["reasoning_content"] = text
        else:
            messages.append({"role": "assistant", "content": [], "reasoning_content": text})
    else:
        raise invalid("Cannot determine type of 'item'")


def _input_part(part: Any) -> dict[str, Any]:
    kind = string(part, "type")
    if kind == "input_text":
        if "text" not in part:
            raise invalid("'Input text' requires 'text'")
        return {"text": part["text"], "type": "text"}
    if kind == "input_image":
        if "image_url" not in part:
            raise invalid("'image_url' is required")
        return {"image_url": {"url": part["image_url"]}, "type": "image_url"}
    if kind == "input_file":
        raise invalid("'input_file' is not supported by llamacpp at this moment")
    raise invalid("'type' must be one of 'input_text', 'input_image', or 'input_file'")


def _output_part(part: Any) -> dict[str, Any]:
    kind = string(part, "type")
    if kind in ("output_text", "input_text"):
        if not isinstance(part.get("text"), str):
            raise invalid("'Output text' requires 'text'")
        return {"text": part["text"], "type": "text"}
    if kind == "refusal":
        if not isinstance(part.get("refusal"), str):
            raise invalid("'Refusal' requires 'refusal'")
        return {"refusal": part["refusal"], "type": "refusal"}
    raise invalid("'type' must be one of 'output_text' or 'refusal'")


def _tool_output(output: str | list[Any]) -> Any:
    if isinstance(output, str):
        return output
    parts = []
    for part in output:
        if not isinstance(part, dict) or "type" not in part:
            raise invalid("Output of tool call missing 'type' field")
        if part["type"] == "input_text":
            parts.append({**part, "type": "text"})
        elif part["type"] == "input_image":
            if "image_url" not in part:
                raise invalid("'image_url' is required")
            parts.append({**part, "type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            raise invalid("Output of tool call should be 'Input text' or 'Input image'")
    return parts


def _reasoning_text(content: Any) -> Any:
    if not isinstance(content, list):
        raise invalid("item['content'] is not an array")
    if not content:
        raise invalid("item['content'] is empty")
    if not isinstance(content[0], dict) or not isinstance(content[0].get("text"), str):
        raise invalid("item['content']['text'] is not a string")
    return content[0]["text"]


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    function = {k: v for k, v in tool.items() if k != "type"}
    function.setdefault("strict", True)
    return {"type": "function", "function": function}


def count_answer(n_tokens: int) -> dict[str, Any]:
    """``/input_tokens`` (and ``/v1/chat/completions/input_tokens``)."""
    return {"input_tokens": n_tokens, "object": "response.input_tokens"}


def usage(task: Task) -> dict[str, Any]:
    return {
        "input_tokens": task.n_prompt, "output_tokens": task.n_decoded,
        "total_tokens": task.n_prompt + task.n_decoded,
        "input_tokens_details": {"cached_tokens": task.n_cache},
    }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "annotations": [], "logprobs": [], "text": text}


class ResponsesShaper:
    """The answer to one Responses request, whole or as its stream's events (one per generation)."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.ids: dict[int, tuple[str, str]] = {}  # generation -> its response and message ids

    def _ids(self, index: int) -> tuple[str, str]:
        return self.ids.setdefault(index, (random_id("resp_"), random_id("msg_")))

    def answer(self, task: Task, text: str, index: int = 0) -> dict[str, Any]:
        response_id, message_id = self._ids(index)
        now = int(time.time())
        output = [{
            "content": [_text_part(text)], "id": message_id, "role": "assistant", "status": "completed",
            "type": "message",
        }] if text else []
        return {
            "completed_at": now, "created_at": now, "id": response_id, "model": self.model,
            "object": "response", "output": output, "status": "completed", "usage": usage(task),
        }

    def start(self, index: int = 0) -> list[bytes]:
        """The events of the first token: the response, its message, the message's text part."""
        response_id, message_id = self._ids(index)
        response = {"id": response_id, "object": "response", "status": "in_progress"}
        item = {
            "content": [], "id": message_id, "role": "assistant", "status": "in_progress", "type": "message",
        }
        part = {"type": "output_text", "text": ""}
        return [
            event("response.created", {"type": "response.created", "response": response}),
            event("response.in_progress", {"type": "response.in_progress", "response": response}),
            event("response.output_item.added", {"type": "response.output_item.added", "item": item}),
            event("response.content_part.added",
                  {"type": "response.content_part.added", "item_id": message_id, "part": part}),
        ]

    def delta(self, text: str, index: int = 0) -> bytes:
        _, message_id = self._ids(index)
        data = {"type": "response.output_text.delta", "item_id": message_id, "delta": text}
        return event("response.output_text.delta", data)

    def stop(self, task: Task, index: int = 0) -> list[bytes]:
        """The events after the last token: each item done, then the response with its usage and timings."""
        response_id, message_id = self._ids(index)
        text = tokens.filler(task.n_decoded)
        part = _text_part(text)
        item = {
            "type": "message", "status": "completed", "id": message_id, "content": [part],
            "role": "assistant",
        }
        response = {
            "id": response_id, "object": "response", "created_at": int(time.time()), "status": "completed",
            "model": self.model, "output": [item], "usage": usage(task),
        }
        return [
            event("response.output_text.done",
                  {"type": "response.output_text.done", "item_id": message_id, "text": text}),
            event("response.content_part.done",
                  {"type": "response.content_part.done", "item_id": message_id, "part": part}),
            event("response.output_item.done", {"type": "response.output_item.done", "item": item}),
            event("response.completed",
                  {"type": "response.completed", "response": response, "timings": task.timings()}),
        ]
