"""OpenAI Responses: the stream's ``response.completed`` is the response llama-server answers without
``stream``, once its two missing fields are back."""

from __future__ import annotations

import json
from typing import Any

from node_agent.assemblers.responses import ResponsesAssembler
from tests.node_agent.helpers import recorded_body

RANDOM = ("id", "call_id")  # drawn afresh for every answer


def _without_ids(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _without_ids(item) for key, item in value.items() if key not in RANDOM}
    if isinstance(value, list):
        return [_without_ids(item) for item in value]
    return value


def test_the_recorded_stream_folds_into_the_recorded_response() -> None:
    assembler = ResponsesAssembler()
    for line in recorded_body("responses-items-stream.txt").splitlines():
        assembler.feed_line(line)
    assert assembler.complete and assembler.error is None
    folded = assembler.result({})
    recorded = json.loads(recorded_body("responses-items.txt"))
    assert [item["type"] for item in recorded["output"]] == ["reasoning", "message", "function_call"]
    # the same fields in the same order, down to each output item
    assert list(folded) == list(recorded)
    assert [list(item) for item in folded["output"]] == [list(item) for item in recorded["output"]]
    assert folded["completed_at"] == folded["created_at"]
    for response in (folded, recorded):
        assert response["created_at"] and response["id"].startswith("resp_")
        del response["created_at"], response["completed_at"]  # the clock's, a second apart or not
    assert _without_ids(folded) == _without_ids(recorded)


def test_the_streams_timings_are_not_part_of_the_response() -> None:
    # response.completed's data carries timings beside the response; the non-streamed answer has none
    assembler = ResponsesAssembler()
    response = {"id": "resp_1", "object": "response", "created_at": 7, "status": "completed", "model": "m",
                "output": [], "usage": {"input_tokens": 1, "output_tokens": 0, "total_tokens": 1}}
    event = {"type": "response.completed", "response": response, "timings": {"predicted_n": 0}}
    for line in ("event: response.completed", "data: " + json.dumps(event), ""):
        assembler.feed_line(line)
    assert assembler.result({}) == {"completed_at": 7, **response}


def test_an_error_event_mid_stream_is_the_error() -> None:
    # llama-server ends a Responses stream that fails with an OpenAI error event (no event name)
    assembler = ResponsesAssembler()
    assembler.feed_line('data: {"error": {"code": 500, "message": "boom", "type": "server_error"}}')
    assembler.feed_line("")
    assert assembler.error == {"code": 500, "message": "boom", "type": "server_error"}
    assert not assembler.complete
