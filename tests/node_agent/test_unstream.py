"""Non-streaming requests are served from a streamed upstream: the folded document matches llama-server's."""

from __future__ import annotations

import json

import pytest

from macpool.apis import APIS
from macpool.contract import generations, slots_needed
from node_agent import unstream
from node_agent.assemblers import Assembler
from tests.node_agent.helpers import recorded_body as _body


def _fold(endpoint: str, name: str, request: dict[str, object] | None = None) -> dict[str, object]:
    assembler = fed(unstream.assembler(endpoint), name)
    assert assembler.complete
    return assembler.result(request or {})


def fed(assembler: Assembler, name: str) -> Assembler:
    """``assembler`` fed the recorded stream ``name``."""
    for line in _body(name).splitlines():
        assembler.feed_line(line)
    return assembler


def test_chat_stream_folds_into_the_non_streamed_shape() -> None:
    folded = _fold("/v1/chat/completions", "chat-stream-usage.txt")
    recorded = json.loads(_body("chat-nonstream.txt"))
    assert list(folded) == list(recorded)  # the same fields, in the same order
    assert folded["object"] == "chat.completion"
    choice = folded["choices"][0]  # type: ignore[index]
    assert choice["message"] == {"role": "assistant", "content": "z\x1f1\n"}
    assert choice["finish_reason"] == "length"
    assert folded["usage"]["completion_tokens"] == 4  # type: ignore[index]
    assert folded["id"] == "chatcmpl-EI9ZD5uKOmcVwGuJhqypHkJF1fsTM2nA"


def test_completions_and_native_completion_fold() -> None:
    folded = _fold("/v1/completions", "completions-stream.txt")
    assert folded["object"] == "text_completion"
    assert folded["choices"] == [{"text": ";/LE", "index": 0, "logprobs": None, "finish_reason": "length"}]
    assert folded["usage"]["total_tokens"] == 13  # type: ignore[index]
    native = _fold("/completion", "completion-native-stream.txt")
    recorded = json.loads(_body("completion-native.txt"))
    assert native.keys() == recorded.keys()
    assert native["content"] == "\ufffd##"
    assert native["stop"] is True and native["tokens"] == []
    assert native["generation_settings"]["stream"] is False  # type: ignore[index]


def test_infill_folds_like_completion() -> None:
    folded = _fold("/infill", "infill-stream.txt")
    recorded = json.loads(_body("infill.txt"))
    assert list(folded) == list(recorded)  # the same fields, in the same order
    for document in (folded, recorded):
        del document["timings"], document["id_slot"]  # the clock's, and the slot that happened to be free
    assert folded == recorded


@pytest.mark.parametrize(
    ("endpoint", "name", "last"),
    [
        ("/v1/chat/completions", "chat-stream-usage.txt", '"finish_reason":"'),
        ("/completion", "completion-native-stream.txt", '"stop":true'),
        ("/infill", "infill-stream.txt", '"stop":true'),
        ("/v1/messages", "messages-tool-use-stream.txt", '"message_stop"'),
        ("/v1/responses", "responses-items-stream.txt", '"response.completed"'),
    ],
)
def test_a_stream_cut_before_its_last_event_is_incomplete(endpoint: str, name: str, last: str) -> None:
    # a stream that stops short of the event llama-server ends a generation with broke off: folding what
    # came would answer 200 with half an answer
    lines = _body(name).splitlines()
    cut = unstream.assembler(endpoint)
    for line in lines[: next(i for i, line in enumerate(lines) if last in line)]:
        cut.feed_line(line)
    assert cut.events > 0 and not cut.complete and cut.error is None


def test_tool_calls_and_errors_fold() -> None:
    assembler = unstream.assembler("/v1/chat/completions")
    for delta in (
        {"tool_calls": [{"index": 0, "id": "call_1", "function": {"name": "get_", "arguments": '{"a"'}}]},
        {"tool_calls": [{"index": 0, "function": {"name": "weather", "arguments": ": 1}"}}]},
    ):
        assembler.feed_line("data: " + json.dumps({"choices": [{"index": 0, "delta": delta}]}))
        assembler.feed_line("")  # the blank line that ends an event
    message = assembler.result({})["choices"][0]["message"]
    assert message["content"] is None
    assert message["tool_calls"] == [
        {"type": "function", "id": "call_1", "function": {"name": "get_weather", "arguments": '{"a": 1}'}}
    ]
    failing = unstream.assembler("/v1/completions")
    failing.feed_line('data: {"error": {"code": 500, "message": "boom", "type": "server_error"}}')
    failing.end()  # the stream ended with that event (no blank line after it)
    assert failing.error == {"code": 500, "message": "boom", "type": "server_error"}


@pytest.mark.parametrize(
    ("endpoint", "body", "streams"),
    [
        ("/v1/chat/completions", b'{"messages": []}', True),
        ("/v1/chat/completions", b'{"messages": [], "stream": true}', False),  # already a stream
        ("/v1/chat/completions", b'{"messages": [], "logprobs": true}', False),  # folds unfaithfully
        ("/v1/chat/completions", b'{"messages": [], "n": 2}', False),
        ("/v1/chat/completions", b'{"messages": [], "n": 1}', True),
        ("/v1/chat/completions", b'{"messages": [], "n": null}', True),  # llama-server's default, 1
        # anything but a plain int 1 is llama-server's to judge (and must not crash the agent)
        ("/v1/chat/completions", b'{"messages": [], "n": "abc"}', False),
        ("/v1/chat/completions", b'{"messages": [], "n": [1]}', False),
        ("/v1/chat/completions", b'{"messages": [], "n": 1e400}', False),
        ("/v1/chat/completions", b'{"messages": [], "n": true}', False),
        ("/v1/chat/completions", b'{"messages": [], "n": 1.0}', False),
        ("/v1/chat/completions", b'{"messages": [], "n_cmpl": 2}', False),  # llama-server's name for n
        ("/v1/chat/completions", b'{"messages": [], "n_cmpl": 1}', True),
        ("/v1/embeddings", b'{"input": "x"}', False),
        ("/completion", b'{"prompt": "x"}', True),
        ("/completion", b'{"prompt": [15, 16, 17]}', True),  # one prompt's tokens
        # several prompts: one answer each, and their stream events interleave
        ("/completion", b'{"prompt": ["hello", "world"]}', False),
        ("/v1/completions", b'{"prompt": ["hello", "world"]}', False),
        ("/v1/completions", b'{"prompt": [[15, 16], [17]]}', False),
        ("/v1/completions", b'{"prompt": "hello"}', True),
        ("/v1/completions", b"{not json", False),  # llama-server's own 400
        ("/v1/completions", b"[" * 100_000, False),  # too deep for Python's parser: llama-server's to judge
        ("/chat/completions", b'{"messages": []}', True),
        ("/completions", b'{"prompt": "x"}', True),  # llama-server's own, as /completion
        # the native answer's last event is filtered by response_fields, the others are not
        ("/completion", b'{"prompt": "x", "response_fields": ["content"]}', False),
        ("/infill", b'{"input_prefix": "a", "input_suffix": "b"}', True),
        ("/infill", b'{"input_prefix": "a", "input_suffix": "b", "n_probs": 2}', False),
        ("/v1/messages", b'{"messages": []}', True),
        ("/v1/messages", b'{"messages": [], "stream": true}', False),
        # llama-server's Messages converter passes neither n nor probabilities on: one answer, as asked
        ("/v1/messages", b'{"messages": [], "n": 2, "logprobs": true}', True),
        ("/v1/responses", b'{"input": "x"}', True),
        ("/responses", b'{"input": "x", "logprobs": true}', True),  # no probabilities in either answer
        ("/v1/responses", b'{"input": "x", "n": 2}', False),  # a JSON array of two responses
        ("/v1/rerank", b'{"query": "x", "documents": ["a"]}', False),
        # light: answered at once, never a stream
        ("/v1/messages/count_tokens", b'{"messages": []}', False),
        ("/v1/chat/completions/input_tokens", b'{"messages": []}', False),
        ("/tokenize", b'{"content": "x"}', False),
    ],
)
def test_which_requests_are_streamed_upstream(endpoint: str, body: bytes, streams: bool) -> None:
    streamed = unstream.streamed_body(endpoint, body)
    assert (streamed is not None) == streams
    if streamed is not None:
        request = json.loads(streamed)
        assert request["stream"] is True
        assert ("stream_options" in request) == (APIS[endpoint].dialect in ("chat", "completions"))


def test_a_messages_request_is_one_generation_whatever_its_n() -> None:
    # llama-server's Messages converter drops n (and there are no lists of prompts): one slot
    assert unstream.generations("/v1/messages", {"messages": [], "n": 3}) == 1
    assert unstream.generations("/v1/responses", {"input": "x", "n": 3}) == 3
    assert unstream.generations("/v1/chat/completions", {"messages": [], "n": 3}) == 3


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        ({"messages": []}, 1),
        ({"messages": [], "n": 3}, 3),
        ({"messages": [], "n_cmpl": 2, "n": 5}, 2),  # n is llama-server's fallback for n_cmpl
        ({"messages": [], "n": "3"}, 1),  # llama-server's 400, not a slot count
        ({"messages": [], "n": True}, 1),
        ({"messages": [], "n": 0}, 1),
        ({"messages": [], "n": 2.5}, 2),  # llama-server truncates a number to an integer
        ({"messages": [], "n": float("inf")}, 1),
        ({"prompt": "x"}, 1),
        ({"prompt": [15, 16, 17]}, 1),  # one prompt's token ids
        ({"prompt": []}, 1),
        ({"prompt": ["a", "b", [1, 2]]}, 3),
        ({"prompt": ["a", "b"], "n": 2}, 4),  # each prompt n times
    ],
)
def test_generations_counts_prompts_times_n(payload: dict[str, object], expected: int) -> None:
    assert generations(payload) == expected


def test_slots_needed_stops_at_llama_servers_slots() -> None:
    # past its slots llama-server queues a request's other generations: they hold no slot yet
    assert (slots_needed(4, 8), slots_needed(12, 8), slots_needed(3, 0)) == (4, 8, 3)
