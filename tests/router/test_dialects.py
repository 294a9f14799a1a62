"""router/dialects/ and router/affinity.py: what the router reads of each API's bodies and answers."""

from __future__ import annotations

import json
from typing import Any

import pytest

from router.affinity import SESSION_SHARE, prefix_hashes
from router.aliases import Aliases
from router.dialects import DIALECTS, Usage, api_of
from router.dialects.chat import MAX_PARTS

CHAT, MESSAGES, RESPONSES = DIALECTS["chat"], DIALECTS["messages"], DIALECTS["responses"]
LONG = "x" * 500  # over the shortest prefix worth steering for


def hashes(parts: list[bytes]) -> tuple[str, ...]:
    return prefix_hashes(parts, "m")[0]


def _chat(count: int) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": f"turn {i} " + "x" * 40} for i in range(count)]}


def test_a_prompt_is_hashed_by_its_first_parts_only() -> None:
    # each part costs a json.dumps: past MAX_PARTS messages (or blocks) a conversation keeps its node by its
    # first ones, so a body of very many tiny messages is never hashed whole
    assert len(CHAT.prefix_parts(_chat(MAX_PARTS + 50))) == MAX_PARTS
    capped = hashes(CHAT.prefix_parts(_chat(MAX_PARTS)))
    assert capped and hashes(CHAT.prefix_parts(_chat(MAX_PARTS + 50))) == capped
    assert hashes(CHAT.prefix_parts(_chat(MAX_PARTS - 1)))[0] != capped[0]
    completion = DIALECTS["completion"]
    tokens = list(range(256 * (MAX_PARTS + 10)))
    capped_tokens = {"prompt": tokens[:256 * MAX_PARTS]}
    assert completion.prefix_parts({"prompt": tokens}) == completion.prefix_parts(capped_tokens)
    assert len(CHAT.prefix_parts({"messages": [{"role": "user", "content": ""}] * 250_000})) == MAX_PARTS


def test_each_prefix_says_the_share_of_the_prompt_it_covers_and_a_session_comes_first() -> None:
    parts = [b"s" * 400, b"a" * 400, b"b" * 800]
    found, shares = prefix_hashes(parts, "m")
    assert shares == (1.0, 0.5, 0.25) and len(found) == 3
    with_session, session_shares = prefix_hashes(parts, "m", session="0f3c")
    assert with_session[1:] == found and session_shares == (SESSION_SHARE, *shares)
    assert with_session[0].startswith("s") and with_session[0] not in found
    assert prefix_hashes(parts, "other", session="0f3c")[0][0] != with_session[0]  # per model
    assert prefix_hashes([], "m", session="0f3c")[0] == with_session[:1]  # a short prompt keeps its session


def test_sessions_come_from_the_headers_coding_agents_send_or_the_body() -> None:
    from starlette.datastructures import Headers

    assert MESSAGES.session(Headers({"x-claude-code-session-id": "cc1"}), {}) == "cc1"
    assert RESPONSES.session(Headers({"session-id": "codex1"}), {"prompt_cache_key": "codex1"}) == "codex1"
    assert RESPONSES.session(Headers({}), {"prompt_cache_key": "pk"}) == "pk"
    assert CHAT.session(Headers({"x-session-id": "mine", "session-id": "x"}), {}) == "mine"
    assert CHAT.session(Headers({}), {"prompt_cache_key": 3}) == ""


def test_chat_without_tools_hashes_its_messages_alone() -> None:
    body = {"messages": [{"role": "system", "content": LONG}, {"role": "user", "content": "hi"}]}
    with_tools = {**body, "tools": [{"type": "function", "function": {"name": "f"}}]}
    assert len(CHAT.prefix_parts(body)) == 2
    assert len(CHAT.prefix_parts(with_tools)) == 3  # the tools are rendered before the messages
    assert set(hashes(CHAT.prefix_parts(body))).isdisjoint(
        hashes(CHAT.prefix_parts(with_tools)))


def _anthropic_turn(n: int) -> dict[str, Any]:
    """Claude Code's shape: tools, a system prompt in blocks, and cache_control on the newest message."""
    messages: list[dict[str, Any]] = []
    for i in range(n):
        messages += [{"role": "user", "content": [{"type": "text", "text": f"ask {i} " + LONG}]},
                     {"role": "assistant", "content": [{"type": "text", "text": f"answer {i}"}]}]
    messages.append({"role": "user", "content": [{"type": "text", "text": f"ask {n}",
                                                  "cache_control": {"type": "ephemeral"}}]})
    return {"model": "m", "max_tokens": 32, "tools": [{"name": "Bash", "input_schema": {"type": "object"}}],
            "system": [{"type": "text", "text": "You are a coding agent. " + LONG,
                        "cache_control": {"type": "ephemeral"}}],
            "messages": messages}


def test_an_anthropic_conversation_keeps_its_prefix_wherever_the_cache_markers_sit() -> None:
    turn1, turn2 = _anthropic_turn(1), _anthropic_turn(2)
    first = hashes(MESSAGES.prefix_parts(turn1))
    second = hashes(MESSAGES.prefix_parts(turn2))
    # turn 1's whole prompt but its newest message (whose marker moved) is a prefix turn 2 holds
    assert set(first[1:]) <= set(second)
    # the next turn sends the newest message of this one as a plain string
    plain = [{**m, "content": m["content"][0]["text"]} if i == len(turn1["messages"]) - 1 else m
             for i, m in enumerate(turn1["messages"])]
    resent = {**turn1, "messages": [*plain, {"role": "assistant", "content": "ok"}]}
    assert set(first) <= set(hashes(MESSAGES.prefix_parts(resent)))
    other_system = {**turn2, "system": "another agent " + LONG}
    assert set(first).isdisjoint(hashes(MESSAGES.prefix_parts(other_system)))


def test_claude_codes_billing_stamp_does_not_break_its_prefix() -> None:
    def turn(stamp: str) -> dict[str, Any]:
        system = [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1; cch={stamp};"},
                  {"type": "text", "text": "You are Claude Code. " + LONG}]
        return {**_anthropic_turn(1), "system": system}

    assert hashes(MESSAGES.prefix_parts(turn("a5145"))) == hashes(
        MESSAGES.prefix_parts(turn("0e9d1")))


def test_a_responses_conversation_extends_its_instructions_and_items() -> None:
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": LONG}]}]
    turn1 = {"instructions": "You are Codex. " + LONG, "input": items}
    turn2 = {**turn1, "input": [*items, {"type": "function_call_output", "call_id": "c1", "output": "ok"}]}
    assert set(hashes(RESPONSES.prefix_parts(turn1))) < set(
        hashes(RESPONSES.prefix_parts(turn2)))
    assert RESPONSES.prefix_parts({"input": LONG})  # a plain string input is one item


def test_every_path_of_the_table_has_a_dialect() -> None:
    assert api_of("/v1/messages")[1] is MESSAGES
    assert api_of("/v1/messages/count_tokens")[0].light
    assert not api_of("/v1/responses")[0].light
    assert DIALECTS["embeddings"].streamed({"stream": True}) is False


# --- usage, from each API's own fields (shapes as llama-server's server-task.cpp writes them) ---------

def test_usage_of_a_chat_answer_streamed_or_not() -> None:
    done = b'data: {"choices":[],"usage":{"completion_tokens":4,"prompt_tokens":59,"total_tokens":63,' \
           b'"prompt_tokens_details":{"cached_tokens":58}}}\n\ndata: [DONE]\n\n'
    assert CHAT.usage(b"", done) == Usage(59, 4, 58)
    # without include_usage, a chat stream still ends with its timings
    timings = b'data: {"choices":[{"finish_reason":"length","index":0,"delta":{}}],' \
              b'"timings":{"cache_n":3,"prompt_n":56,"predicted_n":6}}\n\ndata: [DONE]\n\n'
    assert CHAT.usage(b"", timings) == Usage(59, 6, 3)
    assert CHAT.usage(b"", b'{"error":{"message":"x"}}') is None
    # a key spelled inside generated text is escaped there: never taken for the answer's usage
    text = b'{"choices":[{"message":{"content":"\\"usage\\":{\\"prompt_tokens\\":1}"}}]}'
    assert CHAT.usage(b"", text) is None


def test_usage_of_an_anthropic_stream_comes_from_its_start_and_its_end() -> None:
    start = (b'event: message_start\ndata: {"type":"message_start","message":{"content":[],"usage":'
             b'{"cache_read_input_tokens":100,"input_tokens":20,"output_tokens":0}}}\n\n'
             b'event: content_block_start\ndata: {"type":"content_block_start","index":0}\n\n')
    end = (b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"max_tokens"},'
           b'"usage":{"output_tokens":7}}\n\nevent: message_stop\ndata: {"type":"message_stop"}\n\n')
    assert MESSAGES.usage(start, end) == Usage(120, 7, 100)
    whole = b'{"content":[],"usage":{"cache_read_input_tokens":0,"input_tokens":12,"output_tokens":3}}'
    assert MESSAGES.usage(whole, whole) == Usage(12, 3, 0)


def test_usage_of_a_responses_answer() -> None:
    completed = (b'event: response.completed\ndata: {"response":{"output":[],"status":"completed","usage":'
                 b'{"input_tokens":30,"input_tokens_details":{"cached_tokens":10},"output_tokens":5,'
                 b'"total_tokens":35}},"type":"response.completed"}\n\n')
    assert RESPONSES.usage(b"", completed) == Usage(30, 5, 10)


# --- errors in the caller's dialect -----------------------------------------------------------------

def test_anthropic_errors_are_anthropic_documents() -> None:
    full = MESSAGES.error(503, "every node is at capacity", "pool_full", {"Retry-After": "2"})
    assert full.status_code == 529 and full.headers["retry-after"] == "2"
    assert json.loads(full.body) == {"type": "error", "error": {
        "type": "overloaded_error", "message": "every node is at capacity", "code": "pool_full"}}
    for status, code, kind in ((400, "invalid_json", "invalid_request_error"),
                               (401, "invalid_api_key", "authentication_error"),
                               (404, "model_not_found", "not_found_error"),
                               (413, "request_too_large", "request_too_large"),
                               (429, "key_limit", "rate_limit_error"),
                               (502, "upstream_error", "api_error"),
                               (503, "no_nodes", "overloaded_error")):
        response = MESSAGES.error(status, "m", code)
        assert response.status_code == status
        assert json.loads(response.body)["error"]["type"] == kind
    event = MESSAGES.stream_error(502, "the node failed mid-stream", "upstream_midstream", ended=False)
    assert event.startswith(b"\n\nevent: error\ndata: ") and event.endswith(b"\n\n")
    assert json.loads(event.split(b"data: ", 1)[1])["error"]["type"] == "api_error"


def test_a_node_error_becomes_an_anthropic_one() -> None:
    document = {"error": {"code": 400, "message": "request (900 tokens) exceeds the available context size",
                          "type": "exceed_context_size_error", "n_prompt_tokens": 900, "n_ctx": 512}}
    translated = json.loads(MESSAGES.upstream_error(400, document) or b"")
    assert translated["type"] == "error"
    assert translated["error"]["type"] == "invalid_request_error"
    assert translated["error"]["message"].startswith("request (900 tokens)")
    assert CHAT.upstream_error(400, document) is None  # OpenAI callers get llama-server's own document


def test_a_responses_stream_fails_with_response_failed() -> None:
    event = RESPONSES.stream_error(502, "the node failed mid-stream", "upstream_midstream")
    head, data = event.split(b"\ndata: ", 1)
    assert head == b"event: response.failed"
    failed = json.loads(data)
    assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
    error = {"code": "upstream_midstream", "message": "the node failed mid-stream"}
    assert failed["response"]["error"] == error


# --- aliases ------------------------------------------------------------------------------------------

def test_aliases_exact_names_first_then_patterns_in_order() -> None:
    aliases = Aliases({"claude-*": "coder", "claude-haiku-*": "small", "gpt-5": "chat"})
    assert aliases.resolve("claude-sonnet-4-5") == "coder"
    assert aliases.resolve("claude-haiku-4-5") == "coder"  # the first pattern that matches
    assert aliases.resolve("gpt-5") == "chat"
    assert aliases.resolve("qwen3") == "qwen3"
    assert aliases.of("coder") == ["claude-*"]


@pytest.mark.parametrize("value", ["claude", "=x", "a=", "a=b,c"])
def test_an_alias_without_a_model_is_refused(value: str) -> None:
    from router.settings import ConfigError, Settings

    with pytest.raises(ConfigError, match="model_aliases"):
        Settings.from_argv(["--model-aliases", value])
