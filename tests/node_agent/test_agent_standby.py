"""A standby agent: registered with its model unloaded, loaded on the autoscaler's word, drained back to
standby without cutting a request (node_agent/standby.py)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from redis.asyncio import Redis

from macpool.settings import ConfigError
from macpool.store.elastic import ElasticStore, Mode
from node_agent.cli import build_settings
from node_agent.runtime import Runtime
from node_agent.settings import AgentSettings
from tests.conftest import Server
from tests.node_agent.helpers import SIM_COMMAND, AgentFactory, read_node, status, wait_until


def set_desired(redis_url: str, node_id: str, mode: Mode) -> None:
    async def _set() -> None:
        client = Redis.from_url(redis_url)
        try:
            await ElasticStore(client).set_desired(node_id, mode)
        finally:
            await client.aclose()

    asyncio.run(_set())


def state_is(redis_url: str, state: str) -> Callable[[], bool]:
    return lambda: (doc := read_node(redis_url, "n1")) is not None and doc.state == state


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_supervised_standby_loads_on_activation_and_unloads_after_draining(
    agent: AgentFactory, redis_url: str, tmp_path: Path
) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"x")
    gateway = agent("--llama-server", SIM_COMMAND, "--model", str(model), "--parallel", "3", "--standby",
                    "--wol-mac", "A0-CE-C8-01-02-0F", "--wol-broadcast", "192.0.2.255")
    wait_until(state_is(redis_url, "standby"), what="standby")
    doc = read_node(redis_url, "n1")
    assert doc is not None
    assert (doc.standby_capacity, doc.wol_mac, doc.wol_broadcast) == (3, "a0:ce:c8:01:02:0f", "192.0.2.255")
    assert doc.models == ["m"] and doc.elastic  # found by its model while none is loaded
    assert doc.reason.startswith("standby: no model loaded")
    (model,) = doc.model_states
    assert (model.name, model.state, model.capacity, model.load_s) == ("m", "loadable", 0, None)
    assert status(gateway.url).get("llama_server") is None  # no model loaded, no memory held
    refused = httpx.post(gateway.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "node_unavailable"

    set_desired(redis_url, "n1", "active")
    wait_until(state_is(redis_url, "ready"), what="ready after activation")
    pid = status(gateway.url)["llama_server"]["pid"]
    assert alive(pid)
    loaded = wait_until(lambda: (d := read_node(redis_url, "n1")) and d.model_states[0].capacity and d,
                        what="the model's capacity")
    (model,) = loaded.model_states
    assert (model.name, model.state, model.capacity) == ("m", "loaded", 3)
    assert model.load_s is not None and 0 < model.load_s < 30  # learned from this load

    body = {"prompt": "hi", "max_tokens": 2000, "stream": True}
    with httpx.stream("POST", gateway.url + "/v1/completions", json=body, timeout=60) as running:
        lines = running.iter_lines()
        assert next(lines).startswith("data: ")  # streaming: it holds a slot until its last event
        set_desired(redis_url, "n1", "standby")
        wait_until(state_is(redis_url, "draining-to-standby"), what="draining to standby")
        late = httpx.post(gateway.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4})
        assert late.status_code == 503 and late.json()["error"]["code"] == "node_draining"
        assert alive(pid)  # not unloaded under a running request
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"  # finished, not cut
    wait_until(state_is(redis_url, "standby"), what="standby again")
    wait_until(lambda: not alive(pid), what="llama-server stopped")
    again = read_node(redis_url, "n1")
    assert again is not None
    assert [(m.state, m.load_s) for m in again.model_states] == [("loadable", model.load_s)]  # remembered


def test_attached_standby_becomes_ready_once_its_upstream_answers(
    sim: Callable[..., Server], agent: AgentFactory, redis_url: str
) -> None:
    upstream = sim("--parallel", "2", "--speed", "20")
    agent("--upstream", upstream.url, "--standby")
    wait_until(state_is(redis_url, "standby"), what="standby")
    # the capacity it would have comes from its llama-server's slots, as a ready node's would
    wait_until(lambda: (d := read_node(redis_url, "n1")) is not None and d.standby_capacity == 2,
               what="standby capacity")
    set_desired(redis_url, "n1", "active")
    wait_until(state_is(redis_url, "ready"), what="ready")
    doc = read_node(redis_url, "n1")
    assert doc is not None and doc.capacity == 2
    set_desired(redis_url, "n1", "standby")
    wait_until(state_is(redis_url, "standby"), what="standby again")


def test_a_bad_wol_mac_is_one_line_naming_the_key() -> None:
    with pytest.raises(ConfigError, match="wol_mac='a0:ce:c8': MAC address 'a0:ce:c8': expected six hex"):
        build_settings(["--upstream", "http://127.0.0.1:1", "--wol-mac", "a0:ce:c8"])


def test_the_runtime_holds_standby_until_told_and_loading_until_ready() -> None:
    runtime = Runtime(AgentSettings(upstream="http://upstream", standby=True, cap=3))
    assert (runtime.state, runtime.admitting, runtime.standby_capacity) == ("standby", False, 3)
    # the heartbeat finds llama-server healthy: a standby node stays in standby all the same
    assert runtime.capacity_decided("ready", 2, 4) == "standby" and not runtime.admitting
    assert runtime.standby_capacity == 2  # what it would have, as last decided
    runtime.activate()
    assert runtime.capacity_decided("starting", 0, 0) == "loading" and not runtime.admitting
    assert runtime.capacity_decided("ready", 2, 4) == "ready" and runtime.admitting
    runtime.begin_standby_drain()
    assert runtime.capacity_decided("ready", 2, 4) == "draining-to-standby" and not runtime.admitting
    runtime.activate()  # called back before it was parked: the model is still loaded
    assert runtime.capacity_decided("ready", 2, 4) == "ready" and runtime.admitting
    runtime.begin_standby_drain()
    runtime.enter_standby()
    runtime.begin_drain()  # shutdown: draining is the last state, whatever came before
    runtime.activate()
    assert runtime.capacity_decided("ready", 2, 4) == "draining"
