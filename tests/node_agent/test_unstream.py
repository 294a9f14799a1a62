"""Non-streaming requests are served from a streamed upstream: the folded document matches llama-server's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from macpool.contract import generations, slots_needed
from node_agent import unstream

# recorded from a real llama-server (copied from shared/reference/llama-server)
REFERENCE = Path(__file__).resolve().parent / "fixtures" / "llama-server"


def _body(name: str) -> str:
    text = (REFERENCE / name).read_text()
    return text.split("\n\n", 1)[1]


def _fold(endpoint: str, name: str, request: dict[str, object] | None = None) -> dict[str, object]:
    assembler = unstream.Assembler(endpoint)
    for line in _body(name).splitlines():
        assembler.feed_line(line)
    return assembler.result(request)


def test_chat_stream_folds_into_the_non_streamed_shape() -> None:
    folded = _fold("/v1/chat/completions", "chat-stream-usage.txt")
    recorded = json.loads(_body("chat-nonstream.txt"))
    assert folded.keys() == recorded.keys()
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


def test_tool_calls_and_errors_fold() -> None:
    assembler = unstream.Assembler("/v1/chat/completions")
    for delta in (
        {"tool_calls": [{"index": 0, "id": "call_1", "function": {"name": "get_", "arguments": '{"a"'}}]},
        {"tool_calls": [{"index": 0, "function": {"name": "weather", "arguments": ": 1}"}}]},
    ):
        assembler.feed_line("data: " + json.dumps({"choices": [{"index": 0, "delta": delta}]}))
    message = assembler.result()["choices"][0]["message"]
    assert message["content"] is None
    assert message["tool_calls"] == [
        {"type": "function", "id": "call_1", "function": {"name": "get_weather", "arguments": '{"a": 1}'}}
    ]
    failing = unstream.Assembler("/v1/completions")
    failing.feed_line('data: {"error": {"code": 500, "message": "boom", "type": "server_error"}}')
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
    ],
)
def test_which_requests_are_streamed_upstream(endpoint: str, body: bytes, streams: bool) -> None:
    streamed = unstream.streamed_body(endpoint, body)
    assert (streamed is not None) == streams
    if streamed is not None:
        request = json.loads(streamed)
        assert request["stream"] is True
        assert ("stream_options" in request) == (endpoint != "/completion")


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
