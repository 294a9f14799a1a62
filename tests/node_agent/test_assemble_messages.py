"""Anthropic Messages: the stream folded is the message llama-server answers without ``stream``."""

from __future__ import annotations

import json
from typing import Any

import pytest

from node_agent.assemblers.messages import MessagesAssembler
from tests.node_agent.helpers import recorded_body


def _fed(name: str) -> MessagesAssembler:
    assembler = MessagesAssembler()
    for line in recorded_body(name).splitlines():
        assembler.feed_line(line)
    return assembler


def _ids(message: dict[str, Any]) -> list[object]:
    """The message's ids (its own, and each tool call's): random, so never alike in two answers."""
    return [message.pop("id"), *(block.pop("id") for block in message["content"] if "id" in block)]


@pytest.mark.parametrize("name", ["messages-thinking-text", "messages-tool-use"])
def test_a_recorded_stream_folds_into_the_recorded_message(name: str) -> None:
    assembler = _fed(f"{name}-stream.txt")
    assert assembler.complete and assembler.error is None
    folded = assembler.result({})
    recorded = json.loads(recorded_body(f"{name}.txt"))
    assert list(folded) == list(recorded)  # the same fields, in the same order
    assert all(_ids(folded)) and all(_ids(recorded))
    assert folded == recorded
    assert [block["type"] for block in folded["content"]] == (
        ["thinking", "text"] if name == "messages-thinking-text" else ["thinking", "tool_use"])


def test_an_error_event_is_the_error_llama_server_answers_without_a_stream() -> None:
    assembler = _fed("messages-error-stream.txt")
    assert assembler.error == json.loads(recorded_body("messages-error.txt"))["error"]
    assert assembler.error["code"] == 500


def _event(kind: str, **data: Any) -> list[str]:
    return [f"event: {kind}", "data: " + json.dumps({"type": kind, **data}), ""]


def _message(*events: list[str]) -> dict[str, Any]:
    assembler = MessagesAssembler()
    start = {"id": "msg_1", "type": "message", "role": "assistant", "content": [], "model": "m",
             "stop_reason": None, "stop_sequence": None,
             "usage": {"cache_read_input_tokens": 3, "input_tokens": 5, "output_tokens": 0}}
    stop_delta = {"stop_reason": "tool_use", "stop_sequence": None}
    lines = [*_event("message_start", message=start), *(line for event in events for line in event),
             *_event("message_delta", delta=stop_delta, usage={"output_tokens": 9}), *_event("message_stop")]
    for line in lines:
        assembler.feed_line(line)
    assert assembler.complete
    return assembler.result({})


def _block_start(index: int, block: dict[str, Any]) -> list[str]:
    return _event("content_block_start", index=index, content_block=block)


def _delta(index: int, **delta: Any) -> list[str]:
    return _event("content_block_delta", index=index, delta=delta)


def test_text_and_tool_calls_fold_by_kind_in_llama_servers_order() -> None:
    tool = {"type": "tool_use", "id": "call_a", "name": "get_weather"}
    message = _message(
        _block_start(0, tool), _delta(0, type="input_json_delta", partial_json='{"city": '),
        # a later text block, then the last event starting the same tool call's block again under the index
        # it would have among the blocks started so far (server-task.cpp to_json_anthropic_stream)
        _block_start(1, {"type": "text", "text": ""}), _delta(1, type="text_delta", text="Sure"),
        _block_start(1, tool), _delta(1, type="input_json_delta", partial_json='"Paris"}'),
        _block_start(2, {"type": "tool_use", "id": "call_b", "name": "now"}),
        _delta(2, type="input_json_delta", partial_json="NaN"),  # not JSON to llama-server's parser
        _event("content_block_stop", index=0),
    )
    assert message == {
        "id": "msg_1", "type": "message", "role": "assistant",
        "content": [{"type": "text", "text": "Sure"},
                    {"type": "tool_use", "id": "call_a", "name": "get_weather", "input": {"city": "Paris"}},
                    {"type": "tool_use", "id": "call_b", "name": "now", "input": {}}],
        "model": "m", "stop_reason": "tool_use", "stop_sequence": None,
        "usage": {"cache_read_input_tokens": 3, "input_tokens": 5, "output_tokens": 9},
    }


def test_a_stream_without_message_stop_is_incomplete() -> None:
    assembler = MessagesAssembler()
    for line in recorded_body("messages-thinking-text-stream.txt").splitlines():
        if "message_stop" not in line:
            assembler.feed_line(line)
    assert not assembler.complete
