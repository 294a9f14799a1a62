"""OpenAI Responses on llama-server: the same assertions hold for the simulator and the real server."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.contract.conftest import Target
from tests.contract.shapes import TIMINGS, error, named_events, skeleton

BODY = {
    "model": "gpt-x", "max_output_tokens": 3, "instructions": "Be brief.", "input": "Say hello to the pool.",
}
USAGE = {
    "input_tokens": "number", "output_tokens": "number", "total_tokens": "number",
    "input_tokens_details": {"cached_tokens": "number"},
}
TEXT = {"type": "string", "annotations": [], "logprobs": [], "text": "string"}
ITEM = {"content": [TEXT], "id": "string", "role": "string", "status": "string", "type": "string"}
RESPONSE = {
    "completed_at": "number", "created_at": "number", "id": "string", "model": "string", "object": "string",
    "output": [ITEM], "status": "string", "usage": USAGE,
}
OPENING = {"type": "string", "response": {"id": "string", "object": "string", "status": "string"}}
STREAM = {  # each event's data
    "response.created": OPENING,
    "response.in_progress": OPENING,
    "response.output_item.added": {"type": "string", "item": {**ITEM, "content": []}},
    "response.content_part.added": {"type": "string", "item_id": "string",
                                    "part": {"type": "string", "text": "string"}},
    "response.output_text.delta": {"type": "string", "item_id": "string", "delta": "string"},
    "response.output_text.done": {"type": "string", "item_id": "string", "text": "string"},
    "response.content_part.done": {"type": "string", "item_id": "string", "part": TEXT},
    "response.output_item.done": {"type": "string", "item": ITEM},
    "response.completed": {"type": "string", "timings": TIMINGS, "response": {
        "id": "string", "object": "string", "created_at": "number", "status": "string", "model": "string",
        "output": [ITEM], "usage": USAGE,
    }},
}


def post(target: Target, path: str, body: Any) -> httpx.Response:
    return httpx.post(target.url + path, json=body, timeout=60)


def count(target: Target, body: dict[str, Any], path: str = "/v1/responses/input_tokens") -> int:
    response = post(target, path, body)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer == {"input_tokens": answer["input_tokens"], "object": "response.input_tokens"}
    n: int = answer["input_tokens"]
    return n


@pytest.mark.parametrize("path", ["/v1/responses", "/responses"])
def test_an_answer(api_target: Target, path: str) -> None:
    response = post(api_target, path, BODY)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert skeleton(answer) == RESPONSE
    assert answer["id"].startswith("resp_") and answer["output"][0]["id"].startswith("msg_")
    assert (answer["object"], answer["status"]) == ("response", "completed")
    assert answer["model"] == api_target.model  # the server's name, not the request's
    item = answer["output"][0]
    assert (item["type"], item["role"], item["status"]) == ("message", "assistant", "completed")
    usage = answer["usage"]
    assert usage["output_tokens"] == 3 and usage["total_tokens"] == usage["input_tokens"] + 3
    assert count(api_target, BODY, path + "/input_tokens") == usage["input_tokens"]


def test_a_stream(api_target: Target) -> None:
    events = named_events(post(api_target, "/v1/responses", {**BODY, "stream": True}))
    names = [name for name, _ in events]
    assert names == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", *["response.output_text.delta"] * 3, "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed",
    ]
    for name, data in events:
        assert skeleton(data) == STREAM[name], name
    data = dict(events)  # the last of each name
    response = data["response.completed"]["response"]
    assert data["response.created"]["response"]["id"] == response["id"] and response["id"].startswith("resp_")
    message_id = data["response.output_item.added"]["item"]["id"]
    assert {d.get("item_id", message_id) for _, d in events if "item_id" in d} == {message_id}
    text = "".join(d["delta"] for name, d in events if name == "response.output_text.delta")
    assert data["response.output_text.done"]["text"] == text
    assert response["output"][0]["content"][0]["text"] == text and response["output"][0]["id"] == message_id
    assert response["model"] == api_target.model and response["status"] == "completed"
    assert response["usage"]["output_tokens"] == 3 == data["response.completed"]["timings"]["predicted_n"]
    assert response["usage"]["input_tokens"] == count(api_target, BODY)


def test_several_generations_answer_an_array(api_target: Target) -> None:
    # every field but input, instructions and max_output_tokens reaches the chat request: n too
    answers = post(api_target, "/v1/responses", {**BODY, "n": 2}).json()
    assert isinstance(answers, list) and len(answers) == 2
    assert all(skeleton(answer) == RESPONSE for answer in answers)


def test_input_items_are_counted_as_the_chat_they_become(api_target: Target) -> None:
    # instructions a system message; input_text parts; an earlier answer, its tool call merged into it; the
    # tool's output a tool message; a string content an input_text part
    body = {
        "instructions": "Be brief.",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "Weather?"},
                                         {"type": "input_text", "text": "Paris."}]},
            {"type": "message", "role": "assistant",
             "content": [{"type": "output_text", "text": "Checking."}]},
            {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "Sunny"},
            {"role": "developer", "content": "Answer in French."},
            {"role": "user", "content": "Thanks."},
        ],
    }
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}
    chat = {"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather?"},
                                     {"type": "text", "text": "Paris."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."}], "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "Sunny"},
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Thanks."},
    ]}
    assert count(api_target, body) == count(api_target, chat, "/v1/chat/completions/input_tokens")
    answer = post(api_target, "/v1/responses", {**body, "max_output_tokens": 1}).json()
    assert answer["usage"]["input_tokens"] == count(api_target, body)


@pytest.mark.parametrize(("body", "message"), [
    ({"max_output_tokens": 2}, "'input' is required"),
    ({"input": 5}, "'input' must be a string or array of objects"),
    ({"input": "x", "previous_response_id": "resp_1"}, "llama.cpp does not support 'previous_response_id'."),
    ({"input": [{"foo": 1}]}, "Cannot determine type of 'item'"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "'Input text' requires 'text'"),
    ({"input": [{"role": "user", "content": [{"type": "audio"}]}]},
     "'type' must be one of 'input_text', 'input_image', or 'input_file'"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "'input_file' is not supported by llamacpp at this moment"),
    ({"input": "x", "tools": {"type": "function"}}, "'tools' must be an array of objects"),
    ({"input": [{"type": "message", "role": "assistant", "content": [{"type": "output_text"}]}]},
     "'Output text' requires 'text'"),
])
def test_errors(api_target: Target, body: dict[str, Any], message: str) -> None:
    expected = error(400, "invalid_request_error", message)
    for stream in (False, True):
        response = post(api_target, "/v1/responses", {**body, "stream": stream})
        assert (response.status_code, response.json()) == (400, expected)
    counted = post(api_target, "/v1/responses/input_tokens", body)
    assert (counted.status_code, counted.json()) == (400, expected)


def test_a_limit_of_the_wrong_type_is_named_as_the_chat_field(api_target: Target) -> None:
    response = post(api_target, "/v1/responses", {**BODY, "max_output_tokens": "3"})
    message = "Field 'max_tokens': [json.exception.type_error.302] type must be number, but is string"
    assert (response.status_code, response.json()) == (400, error(400, "invalid_request_error", message))


def test_a_prompt_over_the_context(api_target: Target) -> None:
    body = {**BODY, "input": "pool " * api_target.n_ctx_per_slot}
    for stream in (False, True):
        response = post(api_target, "/v1/responses", {**body, "stream": stream})
        assert response.status_code == 400
        detail = response.json()["error"]
        assert (detail["type"], detail["n_ctx"]) == ("exceed_context_size_error", api_target.n_ctx_per_slot)
        assert detail["n_prompt_tokens"] == count(api_target, body)
