"""Abandoned non-streaming requests free their llama-server slot at once (real llama-server).

llama-server only notices a gone non-streaming client after a second without results for any task, so
the agent serves non-streaming requests from a streamed upstream one (node_agent/unstream.py).
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from macpool.dev import tiny_model
from macpool.dev.procs import macpool_argv
from macpool.dev.redis_server import free_port
from tests.conftest import SpawnFactory
from tests.e2e.conftest import require_llama_server, wait_until

pytestmark = pytest.mark.llama_server


def _busy_slots(llama_url: str) -> int:
    slots: list[dict[str, Any]] = httpx.get(llama_url + "/slots", timeout=5).json()
    return sum(1 for slot in slots if slot["is_processing"])


def test_non_streaming_reply_and_abandonment(spawn: SpawnFactory, redis_url: str) -> None:
    binary = require_llama_server()
    model = tiny_model.ensure("small")
    port = free_port()
    argv = macpool_argv(
        "agent", "run", "--redis-url", redis_url, "--node-id", "mac-u", "--port", str(port),
        "--llama-server", str(binary), "--model", str(model), "--parallel", "2", "--ctx-per-slot", "1024",
        "--", "-t", "1",
    )
    agent = spawn(argv=argv, port=port, ready_path="/status", timeout=60, name="agent")
    status = wait_until(
        lambda: (s := httpx.get(agent.url + "/status", timeout=5).json())["state"] == "ready" and s,
        60, "agent ready",
    )
    llama_url: str = status["llama_server"]["url"]

    body = {"model": "small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    reply = httpx.post(agent.url + "/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 200
    document = reply.json()
    assert document["object"] == "chat.completion"
    assert document["choices"][0]["message"]["role"] == "assistant"
    assert document["usage"]["completion_tokens"] == 8
    assert reply.headers["content-type"].startswith("application/json")

    # several prompts: one answer per prompt, as llama-server gives it (the agent passes such a request
    # through; folded from a stream, the prompts' tokens came back interleaved as one answer)
    several = {"prompt": ["hello", "world"], "temperature": 0}
    for path, request in (("/v1/completions", {**several, "max_tokens": 4}),
                          ("/completion", {**several, "n_predict": 4})):
        direct = httpx.post(llama_url + path, json=request, timeout=60).json()
        through = httpx.post(agent.url + path, json=request, timeout=60).json()
        if path == "/completion":
            assert isinstance(through, list) and len(through) == 2
            assert [answer["content"] for answer in through] == [answer["content"] for answer in direct]
        else:
            assert sorted(choice["index"] for choice in through["choices"]) == [0, 1]
            texts = {choice["index"]: choice["text"] for choice in through["choices"]}
            assert texts == {choice["index"]: choice["text"] for choice in direct["choices"]}

    # n: llama-server runs n generations, each in a slot, and answers n choices; the agent counts n slots
    pair = httpx.post(agent.url + "/v1/chat/completions", json={**body, "n": 2}, timeout=60)
    assert pair.status_code == 200, pair.text
    assert sorted(choice["index"] for choice in pair.json()["choices"]) == [0, 1]
    # past llama-server's 2 slots n is llama-server's own 400 (its limit), not a refusal of ours
    three = httpx.post(agent.url + "/v1/chat/completions", json={**body, "n": 3}, timeout=60)
    assert three.status_code == 400
    long = {**body, "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", agent.url + "/v1/chat/completions", json=long, timeout=60) as held:
        chunks = held.iter_raw()  # keep the generator: dropping it closes the stream
        next(chunks)
        # one slot of two is busy: two prompts need two (uncounted, one would wait inside llama-server)
        refused = httpx.post(agent.url + "/v1/completions", json={**several, "max_tokens": 4}, timeout=60)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "node_full"
        assert _busy_slots(llama_url) == 1
    wait_until(lambda: _busy_slots(llama_url) == 0, 10, "the held stream's slot to be free")

    long = {**body, "max_tokens": 1000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(agent.url + "/v1/chat/completions", json=long, timeout=httpx.Timeout(60, read=1.0))
    left = time.monotonic()
    wait_until(lambda: _busy_slots(llama_url) == 0, 10, "the abandoned request's slot to be free")
    freed_after = time.monotonic() - left
    assert freed_after < 2.0, f"slot freed only after {freed_after:.2f}s"
    assert httpx.get(agent.url + "/status", timeout=5).json()["in_flight"] == 0
