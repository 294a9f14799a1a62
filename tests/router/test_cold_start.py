"""Scale to zero: with every node of a model in standby, a request waits while the autoscaler has one load
it, bounded by --cold-start-timeout; past it, 503 cold_start with Retry-After."""

from __future__ import annotations

import httpx

from macpool.stack import Stack
from tests.node_agent.helpers import read_node
from tests.router.conftest import AGENT_TOKEN, PRESET, Server, wait_until


def standby_node(stack: Stack, redis_url: str, node_id: str = "n1") -> str:
    """A simulated Mac whose agent starts in standby; returns the model it serves."""
    sim = stack.sim(f"sim-{node_id}", "--preset", PRESET, "--parallel", "2", "--speed", "50")
    stack.agent(f"agent-{node_id}", sim.url, redis_url, node_id, "--standby", "--token", AGENT_TOKEN,
                "--heartbeat-interval", "0.3")
    doc = wait_until(lambda: (d := read_node(redis_url, node_id)) and d.state == "standby" and d.models and d,
                     what="standby with its model")
    model: str = doc.models[0]
    return model


def router(stack: Stack, redis_url: str, cold_start_timeout: str) -> Server:
    return stack.router("router", redis_url, "--agent-token", AGENT_TOKEN, "--cold-start-timeout",
                        cold_start_timeout, "--refresh-interval", "0.2")


def test_from_zero_up_on_a_request_and_back_to_standby_after_it(stack: Stack, redis_url: str) -> None:
    model = standby_node(stack, redis_url)
    front = router(stack, redis_url, "30")
    stack.autoscale("autoscale", redis_url, "--interval", "0.2", "--lease", "1", "--up-delay", "0",
                    "--down-delay", "1", "--cooldown", "0", "--min-nodes", "0")
    answer = httpx.post(front.url + "/v1/chat/completions", timeout=60, json={
        "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert answer.status_code == 200, answer.text
    # idle for --down-delay: parked again, and the pool is back at zero
    wait_until(lambda: (d := read_node(redis_url, "n1")) is not None and d.state == "standby", what="standby")


def test_past_the_cold_start_timeout_it_is_a_503_cold_start(stack: Stack, redis_url: str) -> None:
    model = standby_node(stack, redis_url)
    front = router(stack, redis_url, "0.5")  # and no autoscaler: nothing loads it
    listed = wait_until(lambda: httpx.get(front.url + "/v1/models").json()["data"], what="the model listed")
    assert [m["id"] for m in listed] == [model]  # a client may name it: a request for it waits for a node
    answer = httpx.post(front.url + "/v1/chat/completions", timeout=30, json={
        "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert answer.status_code == 503
    assert answer.json()["error"]["code"] == "cold_start"
    assert answer.headers["X-Macpool-Reason"] == "cold_start" and int(answer.headers["Retry-After"]) >= 1
