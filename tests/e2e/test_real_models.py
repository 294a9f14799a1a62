"""Several models on one Mac, with the real llama-server in router mode: one agent serves ``tiny`` and
``small`` (two generated GGUFs) under a memory budget that holds one of them at a time. Requests through the
router load each model on demand; the second model's load unloads the first, idle, one; the loaded models'
memory never passes the budget."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from macpool.dev import tiny_model
from macpool.dev.procs import macpool_argv
from macpool.dev.stack import Stack, free_port
from macpool.gguf_info import read_shape
from tests.e2e.conftest import require_llama_server, wait_until
from tests.node_agent.helpers import read_node

PARALLEL = 2
CTX_PER_SLOT = 512


def memory_gb(path: Path) -> float:
    """What the agent counts a model as holding: weights + every slot's KV cache (f16)."""
    shape = read_shape(path)
    return shape.weights_gb + PARALLEL * shape.kv_bytes_per_token() * CTX_PER_SLOT / 1e9


def ask(url: str, model: str) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})


def states(agent_url: str) -> dict[str, dict[str, Any]]:
    models: dict[str, dict[str, Any]] = httpx.get(agent_url + "/status", timeout=5).json()["models"]
    return models


@pytest.mark.timeout(300)
def test_one_agent_loads_models_on_demand_within_one_memory_budget(
        stack: Stack, redis_url: str, tmp_path: Path) -> None:
    binary = require_llama_server()
    files = {name: tiny_model.ensure(name) for name in ("tiny", "small")}
    need = {name: memory_gb(path) for name, path in files.items()}
    limit = max(need.values()) + min(need.values()) / 2  # either fits alone, not both
    port = free_port()
    argv = macpool_argv(
        "agent", "run", "--redis-url", redis_url, "--node-id", "mac", "--port", str(port),
        "--llama-server", str(binary), "--models", ",".join(f"{n}={p}" for n, p in files.items()),
        "--parallel", str(PARALLEL), "--ctx-per-slot", str(CTX_PER_SLOT), "--wired-limit-gb", str(limit),
        "--headroom-gb", "0", "--heartbeat-interval", "0.3", "--llama-log", str(tmp_path / "llama.log"),
        "--", "-t", "1",
    )
    agent = stack.spawn("agent", argv, port, ready="/status")
    for name in files:  # each model is a node of its own, in standby, its memory and load cost said
        doc = wait_until(lambda name=name: read_node(redis_url, f"mac/{name}"), what=f"mac/{name}")
        assert doc.state == "standby" and doc.models == [name] and doc.url == f"{agent.url}/m/{name}"
        assert doc.model_states[0].state == "loadable"
        assert doc.model_states[0].memory_gb == pytest.approx(need[name], abs=1e-4)
        assert doc.load_cost == "free"
    router = stack.router("router", redis_url, "--cold-start-timeout", "60", "--refresh-interval", "0.2")

    first = ask(router.url, "tiny")
    assert first.status_code == 200, first.text
    assert first.json()["model"] == "tiny"
    seen = states(agent.url)
    assert seen["tiny"]["state"] == "ready" and seen["small"]["state"] == "standby"
    # small does not fit beside tiny, which is idle: loading small would unload it first
    wait_until(lambda: read_node(redis_url, "mac/small").load_cost == "evict", what="small's cost: evict")

    second = ask(router.url, "small")
    assert second.status_code == 200, second.text
    assert second.json()["model"] == "small"
    seen = states(agent.url)
    assert seen["small"]["state"] == "ready" and seen["tiny"]["state"] == "standby", seen
    held = sum(need[name] for name, status in seen.items() if status["state"] != "standby")
    assert held <= limit
    tiny = wait_until(lambda: (d := read_node(redis_url, "mac/tiny"))
                      and d.model_states[0].state == "loadable" and d, what="tiny's node: loadable again")
    assert tiny.model_states[0].load_s is not None  # its load time, learned, is kept for the next one

    # and back: tiny again, small unloaded for it; the router's /v1/models says where each is loaded
    again = ask(router.url, "tiny")
    assert again.status_code == 200, again.text
    listing = {m["id"]: m["macpool"] for m in httpx.get(router.url + "/v1/models", timeout=5).json()["data"]}
    wait_until(lambda: {m["id"]: m["macpool"]["state"] for m in
                        httpx.get(router.url + "/v1/models", timeout=5).json()["data"]}
               == {"tiny": "loaded", "small": "loadable"}, what="tiny loaded, small loadable")
    assert set(listing) == {"tiny", "small"}
    metrics = httpx.get(agent.url + "/metrics", timeout=5).text
    assert 'macpool_agent_requests_total{endpoint="/v1/chat/completions",model="tiny",status="200"} 2.0' \
        in metrics
