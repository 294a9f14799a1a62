"""A real pool: Redis, three agents each supervising a real llama-server (tiny model), the router."""

from __future__ import annotations

import re
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from macpool.dev import tiny_model

from .conftest import CTX_PER_SLOT, PARALLEL, Node, Pool, wait_until

pytestmark = [pytest.mark.llama_server, pytest.mark.slow]

METRIC = re.compile(r"^llamacpp:(requests_processing|requests_deferred) (\S+)$", re.MULTILINE)


def _model_id(pool: Pool) -> str:
    data = httpx.get(pool.router_url + "/v1/models", timeout=5).json()["data"]
    assert len(data) == 1, data
    model_id: str = data[0]["id"]
    return model_id


def test_openai_sdk_chat_through_the_router(pool: Pool) -> None:
    client = openai.OpenAI(base_url=pool.router_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    try:
        model = _model_id(pool)
        assert [m.id for m in client.models.list().data] == [model]
        messages: Any = [{"role": "user", "content": "hello"}]

        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=8)
        assert reply.object == "chat.completion"
        content = reply.choices[0].message.content
        assert content and content.isascii() and content.isprintable()
        assert reply.choices[0].finish_reason in ("length", "stop")
        assert reply.usage is not None and 0 < reply.usage.completion_tokens <= 8

        stream = client.chat.completions.create(model=model, messages=messages, max_tokens=8, stream=True)
        chunks = list(stream)
        assert chunks and all(chunk.object == "chat.completion.chunk" for chunk in chunks)
        assert len({chunk.id for chunk in chunks}) == 1
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text.isascii() and text.isprintable()  # what the tiny model generates, passed through intact
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finishes in (["length"], ["stop"])
    finally:
        client.close()


class _ProcessingWatcher:
    """Polls every llama-server's /metrics and keeps the largest requests_processing/deferred seen."""

    def __init__(self, nodes: list[Node]) -> None:
        self.urls = {node.node_id: node.llama_url() for node in nodes}
        self.max_processing = dict.fromkeys(self.urls, 0.0)
        self.max_deferred = dict.fromkeys(self.urls, 0.0)
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=5) as client:
            while not self._stop.is_set():
                for node_id, url in self.urls.items():
                    try:
                        text = client.get(url + "/metrics").text
                    except httpx.HTTPError:
                        continue
                    values = {name: float(value) for name, value in METRIC.findall(text)}
                    for seen, name in (
                        (self.max_processing, "requests_processing"),
                        (self.max_deferred, "requests_deferred"),
                    ):
                        seen[node_id] = max(seen[node_id], values.get(name, 0.0))
                    self.samples += 1
                self._stop.wait(0.02)

    def __enter__(self) -> _ProcessingWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


def test_overload_gets_503_with_retry_after_and_caps_hold(pool: Pool) -> None:
    model = _model_id(pool)
    body = {
        "model": model, "messages": [{"role": "user", "content": "tell me everything"}],
        "max_tokens": 900, "ignore_eos": True,
    }
    n_requests = 3 * pool.capacity + 2
    start = threading.Barrier(n_requests)

    def one(_: int) -> httpx.Response:
        with httpx.Client(timeout=120) as client:
            start.wait(30)
            return client.post(pool.router_url + "/v1/chat/completions", json=body)

    with _ProcessingWatcher(pool.nodes) as watcher, ThreadPoolExecutor(n_requests) as executor:
        responses = list(executor.map(one, range(n_requests)))
    statuses = sorted(r.status_code for r in responses)
    assert set(statuses) <= {200, 503}, statuses
    rejected = [r for r in responses if r.status_code == 503]
    assert rejected, f"{n_requests} concurrent requests against capacity {pool.capacity}: none rejected"
    assert len(rejected) < n_requests
    for response in rejected:
        assert 1 <= int(response.headers["Retry-After"]) <= 30
        error = response.json()["error"]
        assert error["code"] in ("pool_full", "queue_timeout")
        assert response.headers["X-Macpool-Reason"] == error["code"]
    for response in responses:
        if response.status_code == 200:
            assert response.json()["usage"]["completion_tokens"] == 900
    assert max(watcher.max_processing.values()) >= 1, "the watcher never saw a request being processed"
    for node in pool.nodes:
        processing, deferred = watcher.max_processing, watcher.max_deferred
        assert processing[node.node_id] <= node.effective_cap, (node.node_id, processing)
        assert deferred[node.node_id] == 0, (node.node_id, deferred)
    # every slot was given back
    wait_until(lambda: pool.pool_view()["pool"]["busy"] == 0, 30, "no busy slot left in the pool")


def test_agent_derives_kv_bytes_per_token_from_the_gguf(pool: Pool) -> None:
    expected = tiny_model.kv_bytes_per_token(pool.model_path)
    assert expected == tiny_model.VARIANTS["tiny"].kv_bytes_per_token() == 256
    for node in pool.nodes:
        assert node.status()["model"]["kv_bytes_per_token"] == expected


def test_agent_reports_build_and_slots_from_props(pool: Pool) -> None:
    docs = {doc["node_id"]: doc for doc in pool.pool_view()["nodes"]}
    for node in pool.nodes:
        props = httpx.get(node.llama_url() + "/props", timeout=5).json()
        assert props["total_slots"] == PARALLEL
        assert props["default_generation_settings"]["n_ctx"] == CTX_PER_SLOT
        doc = docs[node.node_id]
        assert doc["llama_build"] == props["build_info"] != ""
        assert doc["total_slots"] == props["total_slots"]
        assert doc["ctx_per_slot"] == CTX_PER_SLOT
        assert doc["capacity"] == node.effective_cap
        assert doc["capacity_breakdown"]["configured"] == node.effective_cap
