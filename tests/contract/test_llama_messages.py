"""Anthropic Messages on llama-server: the same assertions hold for the simulator and the real server."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.contract.conftest import Target
from tests.contract.shapes import error, named_events, skeleton

BODY = {
    "model": "claude-x", "max_tokens": 3, "system": "Be brief.",
    "messages": [{"role": "user", "content": "Say hello to the pool."}],
}
USAGE = {"cache_read_input_tokens": "number", "input_tokens": "number", "output_tokens": "number"}
MESSAGE = {
    "id": "string", "type": "string", "role": "string", "content": [{"type": "string", "text": "string"}],
    "model": "string", "stop_reason": "string", "stop_sequence": "null", "usage": USAGE,
}
STREAM = {  # each event's data
    "message_start": {"type": "string", "message": {
        **MESSAGE, "content": [], "stop_reason": "null",
    }},
    "content_block_start": {"type": "string", "index": "number",
                            "content_block": {"type": "string", "text": "string"}},
    "content_block_delta": {"type": "string", "index": "number",
                            "delta": {"type": "string", "text": "string"}},
    "content_block_stop": {"type": "string", "index": "number"},
    "message_delta": {"type": "string", "delta": {"stop_reason": "string", "stop_sequence": "null"},
                      "usage": {"output_tokens": "number"}},
    "message_stop": {"type": "string"},
}


QUESTION = [{"type": "text", "text": "Weather?"}, {"type": "text", "text": "Paris."}]


def post(target: Target, path: str, body: Any) -> httpx.Response:
    return httpx.post(target.url + path, json=body, timeout=60)


def count(target: Target, body: dict[str, Any]) -> int:
    response = post(target, "/v1/messages/count_tokens", body)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer == {"input_tokens": answer["input_tokens"]}
    n: int = answer["input_tokens"]
    return n


def chat_count(target: Target, body: dict[str, Any]) -> int:
    n: int = post(target, "/v1/chat/completions/input_tokens", body).json()["input_tokens"]
    return n


def test_an_answer(api_target: Target) -> None:
    response = post(api_target, "/v1/messages", BODY)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert skeleton(answer) == MESSAGE
    assert answer["id"].startswith("chatcmpl-")
    assert (answer["type"], answer["role"], answer["content"][0]["type"]) == ("message", "assistant", "text")
    assert answer["model"] == api_target.model  # the server's name, not the request's
    assert answer["stop_reason"] == "max_tokens" and answer["usage"]["output_tokens"] == 3
    usage = answer["usage"]
    assert count(api_target, BODY) == usage["cache_read_input_tokens"] + usage["input_tokens"]


def test_a_stream(api_target: Target) -> None:
    events = named_events(post(api_target, "/v1/messages", {**BODY, "stream": True}))
    names = [name for name, _ in events]
    assert names == [
        "message_start", "content_block_start", *["content_block_delta"] * 3, "content_block_stop",
        "message_delta", "message_stop",
    ]
    for name, data in events:
        assert skeleton(data) == STREAM[name], name
    message = events[0][1]["message"]
    assert message["id"].startswith("chatcmpl-") and message["model"] == api_target.model
    assert message["usage"]["output_tokens"] == 0
    usage = message["usage"]
    assert count(api_target, BODY) == usage["cache_read_input_tokens"] + usage["input_tokens"]
    assert {data["index"] for name, data in events if "index" in data} == {0}
    assert all(data["delta"]["type"] == "text_delta" and data["delta"]["text"]
               for name, data in events if name == "content_block_delta")
    assert events[-2][1]["delta"]["stop_reason"] == "max_tokens"
    assert events[-2][1]["usage"] == {"output_tokens": 3}


def test_a_conversation_is_counted_as_the_chat_it_becomes(api_target: Target) -> None:
    # llama-server converts Messages into a chat request: system blocks joined, text blocks kept as parts,
    # thinking dropped from the prompt, tool_use a tool call, a tool_result a tool message of its own
    messages = {
        "system": [{"type": "text", "text": "You are "}, {"type": "text", "text": "a pool."}],
        "tools": [{"name": "weather", "description": "d", "input_schema": {"type": "object"}}],
        "messages": [
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Let me see."}, {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "t1", "name": "weather", "input": {"city": "Paris"}},
            ]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
                {"type": "text", "text": "Sunny"}, {"type": "text", "text": ", 20C"},
            ]}]},
            {"role": "user", "content": "Thanks."},
        ],
    }
    call = {"id": "t1", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Paris"}'}}
    chat = {
        "tools": [{"type": "function", "function": {"name": "weather", "description": "d",
                                                    "parameters": {"type": "object"}}}],
        "messages": [
            {"role": "system", "content": "You are a pool."},
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": [{"type": "text", "text": "Checking."}], "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "t1", "content": "Sunny, 20C"},
            {"role": "user", "content": "Thanks."},
        ],
    }
    assert count(api_target, messages) == chat_count(api_target, chat)
    usage = post(api_target, "/v1/messages", {**messages, "max_tokens": 1}).json()["usage"]
    assert usage["cache_read_input_tokens"] + usage["input_tokens"] == count(api_target, messages)


def test_a_last_assistant_message_is_continued(api_target: Target) -> None:
    body = {"max_tokens": 2, "messages": [
        {"role": "user", "content": "Finish this."}, {"role": "assistant", "content": "The pool is"},
    ]}
    chat = {"messages": body["messages"]}
    assert count(api_target, body) == chat_count(api_target, chat)
    assert post(api_target, "/v1/messages", body).json()["stop_reason"] == "max_tokens"


def test_claude_codes_billing_stamp_does_not_defeat_the_prompt_cache(api_target: Target) -> None:
    # llama-server overwrites the per-request "cch=" of Claude Code's system prompt, so two turns that differ
    # only there share their whole prompt
    def turn(stamp: str) -> dict[str, Any]:
        system = f"x-anthropic-billing-header: cc_version=2.1; cch={stamp};" + "You are a coding agent. " * 8
        body = {**BODY, "system": system, "max_tokens": 1}
        usage: dict[str, Any] = post(api_target, "/v1/messages", body).json()["usage"]
        return usage

    turn("a5145")
    usage = turn("b7777")
    assert usage["input_tokens"] == 1  # all but the last prompt token read from the cache


@pytest.mark.parametrize(("body", "status", "type_", "message"), [
    ({"max_tokens": 2}, 500, "server_error", "'messages' is required"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "invalid_request_error",
     "Expected 'content' to be a string or an array"),
    ({"messages": [{"role": "user"}]}, 400, "invalid_request_error",
     "All non-assistant messages must contain 'content'"),
    ({"messages": [{"content": "x"}]}, 500, "server_error",
     'Failed to parse messages: Missing \'role\' in message: {"content":"x"}'),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 500, "server_error",
     "Failed to parse messages: [json.exception.out_of_range.403] key 'text' not found"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://pool.test/a.png"}},
    ]}]}, 500, "server_error",
     "image input is not supported - hint: if this is unexpected, you may need to provide the mmproj"),
    ({"max_tokens": "2", "messages": [{"role": "user", "content": "x"}]}, 400, "invalid_request_error",
     "Field 'max_tokens': [json.exception.type_error.302] type must be number, but is string"),
    ({"max_tokens": -5, "messages": [{"role": "user", "content": "x"}]}, 400, "invalid_request_error",
     "Field 'max_tokens': Value must be between -1 <= value <= 2147483647, but got -5"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "a"},
                   {"role": "assistant", "content": "b"}]}, 400, "invalid_request_error",
     "Cannot have 2 or more assistant messages at the end of the list."),
])
def test_errors(api_target: Target, body: dict[str, Any], status: int, type_: str, message: str) -> None:
    for stream in (False, True):  # an error before the first token is a JSON document, streamed or not
        response = post(api_target, "/v1/messages", {**body, "stream": stream})
        assert response.status_code == status
        assert response.json() == error(status, type_, message)
    if "max_tokens" not in message:  # the count converts and renders alike, with no limit to read
        counted = post(api_target, "/v1/messages/count_tokens", body)
        assert (counted.status_code, counted.json()) == (status, error(status, type_, message))


def test_a_prompt_over_the_context(api_target: Target) -> None:
    body = {**BODY, "messages": [{"role": "user", "content": "pool " * api_target.n_ctx_per_slot}]}
    for stream in (False, True):
        response = post(api_target, "/v1/messages", {**body, "stream": stream})
        assert response.status_code == 400
        detail = response.json()["error"]
        assert (detail["code"], detail["type"], detail["n_ctx"]) == (
            400, "exceed_context_size_error", api_target.n_ctx_per_slot,
        )
        assert detail["n_prompt_tokens"] == count(api_target, body)
        assert detail["message"] == (
            f"request ({detail['n_prompt_tokens']} tokens) exceeds the available context size "
            f"({api_target.n_ctx_per_slot} tokens), try increasing it"
        )


def test_malformed_json(api_target: Target) -> None:
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        response = httpx.post(api_target.url + path, content=b'{"messages": [', timeout=30)
        assert response.status_code == 400
        detail = response.json()["error"]
        assert detail["type"] == "invalid_request_error"
        assert detail["message"].startswith("[json.exception.parse_error.101] parse error at line 1")
