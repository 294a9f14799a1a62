"""A chat request's prompt, with the checks llama-server makes of its messages first.

llama-server turns every chat-shaped request - chat completions, Anthropic Messages and OpenAI Responses once
converted (``anthropic.py``, ``responses.py``), their token counts, ``/apply-template`` -
into a prompt in ``oaicompat_chat_params_parse`` (tools/server/server-common.cpp). Its errors are reproduced
here with their status, type and text: a plain check is a 400 ``invalid_request_error``; what llama-server
only finds out while parsing the messages (``Failed to parse messages: ...``) or loading media is a 500
``server_error``, as it throws those as runtime errors.
"""

from __future__ import annotations

import json
from typing import Any

from macpool.sim import tokens

_UNSUPPORTED = "{} input is not supported - hint: if this is unexpected, you may need to provide the mmproj"
# content parts the simulated model cannot take: it reports no vision, audio or video in /props
_MEDIA = {
    "image_url": _UNSUPPORTED.format("image"), "input_audio": _UNSUPPORTED.format("audio"),
    "input_video": _UNSUPPORTED.format("video"), "video_url": _UNSUPPORTED.format("video"),
}
_NO_TEXT = "[json.exception.out_of_range.403] key 'text' not found"


class RequestError(Exception):
    """A request llama-server refuses: the status, message and type of its error document."""

    def __init__(self, message: str, status: int = 400, type_: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type_


def invalid(message: str) -> RequestError:
    return RequestError(message)


def server_error(message: str) -> RequestError:
    return RequestError(message, 500, "server_error")


def type_name(value: Any) -> str:
    """A JSON value's type as nlohmann::json names it in its errors."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def type_error(expected: str, value: Any) -> str:
    return f"[json.exception.type_error.302] type must be {expected}, but is {type_name(value)}"


def dump(value: Any) -> str:
    """A JSON value as nlohmann::json's ``dump()`` writes it in error messages (compact, keys in order)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def string(obj: Any, key: str, default: str = "") -> str:
    """llama-server's ``json_value(obj, key, std::string())``: the default when absent or not a string."""
    value = obj.get(key) if isinstance(obj, dict) else None
    return value if isinstance(value, str) else default


def prompt(body: dict[str, Any]) -> str:
    """The prompt llama-server renders for a chat request (``RequestError`` as it refuses one)."""
    if "messages" not in body:
        raise invalid("'messages' is required")
    messages = body["messages"]
    if not isinstance(messages, list):
        raise invalid("Expected 'messages' to be an array")
    for message in messages:
        _check(message)
    parsed = [_parse(message) for message in messages]
    generation_prompt = body.get("add_generation_prompt", True)
    if not isinstance(generation_prompt, bool):
        generation_prompt = True
    if parsed and parsed[-1]["role"] == "assistant":  # prefilled: the model continues that message
        if len(parsed) >= 2 and parsed[-2]["role"] == "assistant":
            raise invalid("Cannot have 2 or more assistant messages at the end of the list.")
        if parsed[-1].get("tool_calls"):
            raise invalid("Cannot continue an assistant message that contains tool calls.")
    return tokens.render_chat(parsed, generation_prompt)


def _check(message: Any) -> None:
    role = string(message, "role")
    has_content = isinstance(message, dict) and "content" in message
    if role != "assistant" and not has_content:
        raise invalid("All non-assistant messages must contain 'content'")
    if not has_content:
        if "tool_calls" not in message:
            raise invalid("Assistant message must contain either 'content' or 'tool_calls'!")
        return
    content = message["content"]
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise invalid("Expected 'content' to be a string or an array")
    for part in content:
        kind = string(part, "type")
        if kind in _MEDIA:
            raise server_error(_MEDIA[kind])
        if kind != "text":
            raise invalid("unsupported content[].type")


def _parse(message: dict[str, Any]) -> dict[str, Any]:
    """One message as llama-server reads it for its template (``common_chat_msgs_parse_oaicompat``)."""
    if "role" not in message:
        raise server_error(f"Failed to parse messages: Missing 'role' in message: {dump(message)}")
    if not isinstance(message["role"], str):
        raise server_error(f"Failed to parse messages: {type_error('string', message['role'])}")
    content = message.get("content")
    parts = []
    for part in content if isinstance(content, list) else []:
        if "text" not in part:
            raise server_error(f"Failed to parse messages: {_NO_TEXT}")
        if not isinstance(part["text"], str):
            raise server_error(f"Failed to parse messages: {type_error('string', part['text'])}")
        parts.append({"type": "text", "text": part["text"]})
    tool_calls = message.get("tool_calls")
    # llama-server makes a developer message a system one for every template but GPT-OSS's
    role = "system" if message["role"] == "developer" else message["role"]
    return {
        "role": role, "content": parts if isinstance(content, list) else content,
        "tool_calls": tool_calls if isinstance(tool_calls, list) else [],
    }
