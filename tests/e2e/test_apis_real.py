"""The agent's gateway on llama-server's other APIs, against the real llama-server: a non-streamed request the
agent serves from a stream is answered with exactly the document llama-server answers the same request with
(ids and clocks aside); light requests answer while every slot generates; a client that leaves a
non-streamed Messages or Responses request frees its llama-server slot at once.

One agent supervises one llama-server for the module: the ``small`` model (decoding takes long enough for a
request to be left mid-way), a chat template that renders tools and opens a thinking block
(``fixtures/reasoning-tools.jinja``: the model's own renders neither), fill-in-the-middle tokens set on three
byte tokens (the generated vocabulary has none), and no prompt cache (so that two answers to one request count
their prompt tokens alike).
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from macpool.dev import tiny_model
from macpool.dev.procs import macpool_argv
from macpool.dev.stack import Stack, free_port
from tests.conftest import metric
from tests.e2e.conftest import require_llama_server, wait_until

pytestmark = pytest.mark.llama_server

TEMPLATE = Path(__file__).resolve().parent / "fixtures" / "reasoning-tools.jinja"
FILL_IN_THE_MIDDLE = [arg for name, token in (("pre", 3), ("suf", 4), ("mid", 5))
                      for arg in ("--override-kv", f"tokenizer.ggml.fim_{name}_token_id=int:{token}")]
# clocks, and ids drawn afresh for every answer (id_slot: the slot that happened to be free)
UNALIKE = ("id", "call_id", "created", "created_at", "completed_at", "timings", "id_slot")

USER = {"role": "user", "content": "weather in Paris?"}
# a random-weight model opens no tool call by itself: the last turn opens one, and llama-server parses that
# turn's text with what it generates (tests/node_agent/fixtures/llama-server/README.md)
OPEN_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "'
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Get the weather", "input_schema": SCHEMA}]
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "description": "Get the weather",
                    "parameters": SCHEMA}]


def _messages(*turns: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"model": "small", "max_tokens": 8, "temperature": 0, "messages": [USER, *turns], **extra}


def _thinking_then(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": [{"type": "thinking", "thinking": "plan"},
                                             {"type": "text", "text": text}]}


def _responses(*items: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"model": "small", "max_output_tokens": 8, "temperature": 0, "input": [USER, *items], **extra}


REASONING = {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "plan"}]}

# (path, request, the kinds of content the answer must hold: what the case is there to check)
CASES: dict[str, tuple[str, dict[str, Any], list[str]]] = {
    "messages-thinking": ("/v1/messages", _messages(), ["thinking"]),
    "messages-text-with-a-tool": ("/v1/messages", _messages(_thinking_then("Sure"), tools=ANTHROPIC_TOOLS),
                                  ["thinking", "text"]),
    "messages-tool-use": ("/v1/messages", _messages(_thinking_then("Sure\n" + OPEN_CALL),
                                                    tools=ANTHROPIC_TOOLS), ["thinking", "text", "tool_use"]),
    "responses-reasoning": ("/v1/responses", _responses(), ["reasoning"]),
    "responses-function-call": ("/v1/responses", _responses(REASONING, {
        "role": "assistant", "type": "message", "content": "Sure\n" + OPEN_CALL}, tools=RESPONSES_TOOLS),
        ["reasoning", "message", "function_call"]),
    "infill": ("/infill", {"input_prefix": "def f(", "input_suffix": ")\n", "n_predict": 8, "temperature": 0},
               []),
    "chat": ("/v1/chat/completions", {"model": "small", "max_tokens": 8, "temperature": 0,
                                      "messages": [USER]}, []),
}


def _kinds(path: str, answer: dict[str, Any]) -> list[str]:
    if path == "/v1/messages":
        return [block["type"] for block in answer["content"]]
    if path == "/v1/responses":
        return [item["type"] for item in answer["output"]]
    return []


def _alike(value: Any) -> Any:
    """``value`` without what differs between two answers to one request."""
    if isinstance(value, dict):
        return {key: _alike(item) for key, item in value.items() if key not in UNALIKE}
    if isinstance(value, list):
        return [_alike(item) for item in value]
    return value


# a probe waits as long as a loaded two-core CI machine may take to answer it (no time is measured here)
PROBE_TIMEOUT = 30


class Node:
    def __init__(self, agent_url: str, llama_url: str) -> None:
        self.agent_url = agent_url
        self.llama_url = llama_url

    def busy_slots(self) -> int:
        slots: list[dict[str, Any]] = httpx.get(self.llama_url + "/slots", timeout=PROBE_TIMEOUT).json()
        return sum(1 for slot in slots if slot["is_processing"])

    def in_flight(self) -> tuple[int, int]:
        status = httpx.get(self.agent_url + "/status", timeout=PROBE_TIMEOUT).json()
        return status["in_flight"], status["light_in_flight"]


@pytest.fixture(scope="module")
def node(redis_server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    binary, model = require_llama_server(), tiny_model.ensure("small")
    logs = tmp_path_factory.mktemp("apis-real")
    port = free_port()
    argv = macpool_argv(
        "agent", "run", "--redis-url", redis_server, "--node-id", "mac-apis", "--port", str(port),
        "--llama-server", str(binary), "--model", str(model), "--parallel", "2", "--ctx-per-slot", "2048",
        "--llama-log", str(logs / "llama-server.log"),
        "--", "-t", "1", "--no-cache-prompt", "--chat-template-file", str(TEMPLATE), *FILL_IN_THE_MIDDLE,
    )
    with Stack(logs=logs, keep_logs=True, stop_timeout=15) as stack:
        agent = stack.spawn("agent", argv, port, ready="/status", timeout=60)
        status = wait_until(
            lambda: (s := httpx.get(agent.url + "/status", timeout=5).json())["state"] == "ready" and s,
            60, "agent ready",
        )
        yield Node(agent.url, status["llama_server"]["url"])


@pytest.mark.parametrize("case", list(CASES))
def test_a_folded_answer_is_llama_servers_own(node: Node, case: str) -> None:
    path, request, kinds = CASES[case]
    direct = httpx.post(node.llama_url + path, json=request, timeout=60)
    through = httpx.post(node.agent_url + path, json=request, timeout=60)
    assert direct.status_code == through.status_code == 200, (direct.text, through.text)
    assert through.headers["content-type"].startswith("application/json")
    expected, folded = direct.json(), through.json()
    assert _kinds(path, expected) == kinds  # the case checks what it is there for
    assert list(folded) == list(expected)  # the same fields, in the same order
    assert _alike(folded) == _alike(expected)
    if path == "/v1/responses":
        assert folded["completed_at"] == folded["created_at"]
    assert node.in_flight() == (0, 0)


def test_a_stop_sequence_folds_as_llama_server_answers_it(node: Node) -> None:
    # the stop sequence is a piece of what the model writes after the last turn's "Sure" (it decides)
    request = _messages(_thinking_then("Sure"), max_tokens=16)
    text = httpx.post(node.llama_url + "/v1/messages", json=request, timeout=60).json()["content"][1]["text"]
    stop = text[len("Sure") + 4 : len("Sure") + 6]
    request = {**request, "stop_sequences": [stop]}
    expected = httpx.post(node.llama_url + "/v1/messages", json=request, timeout=60).json()
    folded = httpx.post(node.agent_url + "/v1/messages", json=request, timeout=60).json()
    assert (expected["stop_reason"], expected["stop_sequence"]) == ("end_turn", stop)
    assert _alike(folded) == _alike(expected)


def test_light_paths_answer_while_every_slot_generates(node: Node) -> None:
    # ignore_eos: the two streams hold their slots for their 1,000 tokens, whatever the model writes
    long = {"model": "small", "max_tokens": 1000, "temperature": 0, "stream": True, "ignore_eos": True,
            "messages": [{"role": "user", "content": "hi"}]}
    counted = {"model": "small", "messages": [USER], "tools": ANTHROPIC_TOOLS}
    with httpx.Client(timeout=60) as client, ExitStack() as streams:
        # two streams held open (their generators kept: dropping one closes its stream), a slot each
        held = [streams.enter_context(client.stream("POST", node.agent_url + "/v1/messages", json=long))
                .iter_raw() for _ in range(2)]
        for chunks in held:
            next(chunks)
        assert node.busy_slots() == 2 and node.in_flight() == (2, 0)
        full = client.post(node.agent_url + "/v1/messages", json={**long, "stream": False})
        assert full.status_code == 503 and full.json()["error"]["code"] == "node_full"
        for path, payload in (("/v1/messages/count_tokens", counted), ("/tokenize", {"content": "hi"}),
                              ("/apply-template", {"messages": [USER]})):
            answer = client.post(node.agent_url + path, json=payload)
            assert answer.status_code == 200, (path, answer.text)
            assert answer.json() == client.post(node.llama_url + path, json=payload).json(), path
        assert node.busy_slots() == 2
    wait_until(lambda: node.busy_slots() == 0, 10, "the streams' slots to be free")


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/responses"])
def test_a_client_gone_from_a_non_streamed_request_frees_the_slot_at_once(node: Node, path: str) -> None:
    # 1,000 tokens take seconds on one thread; the agent asks for them as a stream on the client's behalf
    request = _messages(max_tokens=1000) if path == "/v1/messages" else _responses(max_output_tokens=1000)
    request["ignore_eos"] = True  # a request served to its end generates exactly 1,000 tokens
    predicted = metric(node.llama_url, "llamacpp:tokens_predicted_total")
    host, port = httpx.URL(node.agent_url).host, httpx.URL(node.agent_url).port
    leaving = http.client.HTTPConnection(host, port, timeout=60)
    try:
        leaving.request("POST", path, body=json.dumps(request), headers={"Content-Type": "application/json"})
        wait_until(lambda: node.busy_slots() == 1, 30, "generating")
    finally:
        leaving.close()  # the client leaves before any byte of the answer
    wait_until(lambda: node.busy_slots() == 0, 30, "the abandoned request's slot to be free")
    wait_until(lambda: node.in_flight() == (0, 0), 10, "the agent's slot given back")
    # llama-server counts a slot's tokens when the slot is reset: the request was cut mid-way, not run out
    generated = metric(node.llama_url, "llamacpp:tokens_predicted_total") - predicted
    assert generated < 1000, generated
