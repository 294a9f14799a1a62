"""Scale to zero, and models loaded on demand: with every node of a model in standby, a request waits while
one loads it (asked by the router itself, or by the autoscaler), bounded by --cold-start-timeout; past it,
503 model_loading (a load was asked for) or cold_start (none could be), with Retry-After."""

from __future__ import annotations

import socket
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from macpool.dev.stack import Stack
from macpool.store import Keys
from tests.blocking_store import sync_redis
from tests.node_agent.helpers import SIM_COMMAND, read_node
from tests.router.conftest import AGENT_TOKEN, PRESET, Server, wait_until


def standby_node(stack: Stack, redis_url: str, node_id: str = "n1", *args: str) -> str:
    """A simulated Mac whose agent starts in standby; returns the model it serves."""
    sim = stack.sim(f"sim-{node_id}", "--preset", PRESET, "--parallel", "2", "--speed", "50")
    stack.agent(f"agent-{node_id}", sim.url, redis_url, node_id, "--standby", "--token", AGENT_TOKEN,
                "--heartbeat-interval", "0.3", *args)
    doc = wait_until(lambda: (d := read_node(redis_url, node_id)) and d.state == "standby" and d.models and d,
                     what="standby with its model")
    model: str = doc.models[0]
    return model


def state_is(redis_url: str, state: str) -> Callable[[], bool]:
    return lambda: (doc := read_node(redis_url, "n1")) is not None and doc.state == state


def router(stack: Stack, redis_url: str, cold_start_timeout: str, *args: str) -> Server:
    return stack.router("router", redis_url, "--agent-token", AGENT_TOKEN, "--cold-start-timeout",
                        cold_start_timeout, "--refresh-interval", "0.2", *args)


def test_from_zero_up_on_a_request_and_back_to_standby_after_it(stack: Stack, redis_url: str) -> None:
    model = standby_node(stack, redis_url)
    front = router(stack, redis_url, "30", "--no-load-on-demand")  # the autoscaler loads it
    stack.autoscale("autoscale", redis_url, "--interval", "0.2", "--lease", "1", "--up-delay", "0",
                    "--down-delay", "1", "--cooldown", "0", "--min-nodes", "0")
    answer = httpx.post(front.url + "/v1/chat/completions", timeout=60, json={
        "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert answer.status_code == 200, answer.text
    # idle for --down-delay: parked again, and the pool is back at zero
    wait_until(lambda: (d := read_node(redis_url, "n1")) is not None and d.state == "standby", what="standby")


def test_past_the_cold_start_timeout_it_is_a_503_cold_start(stack: Stack, redis_url: str) -> None:
    model = standby_node(stack, redis_url)
    front = router(stack, redis_url, "0.5", "--no-load-on-demand")  # and no autoscaler: nothing loads it
    listed = wait_until(lambda: httpx.get(front.url + "/v1/models").json()["data"], what="the model listed")
    assert [m["id"] for m in listed] == [model]  # a client may name it: a request for it waits for a node
    answer = httpx.post(front.url + "/v1/chat/completions", timeout=30, json={
        "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert answer.status_code == 503
    assert answer.json()["error"]["code"] == "cold_start"
    assert answer.headers["X-Macpool-Reason"] == "cold_start" and int(answer.headers["Retry-After"]) >= 1


def test_a_request_wakes_a_sleeping_mac_and_is_served_once_it_is_back(stack: Stack, redis_url: str) -> None:
    listener = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    listener.bind(("127.0.0.1", 0))  # the LAN's broadcast address, here: no packet leaves loopback
    listener.settimeout(30)
    try:
        sim = stack.sim("sim-n1", "--preset", PRESET, "--parallel", "2", "--speed", "50")
        wol = ("--wol-mac", "a0:ce:c8:01:02:0f", "--wol-broadcast", "127.0.0.1")
        args = ("--standby", "--token", AGENT_TOKEN, "--heartbeat-interval", "0.3", *wol)
        agent = stack.agent("agent-n1", sim.url, redis_url, "n1", *args)
        stack.autoscale("autoscale", redis_url, "--interval", "0.2", "--lease", "1", "--up-delay", "0",
                        "--wol-port", str(listener.getsockname()[1]))
        front = router(stack, redis_url, "60")
        model = wait_until(lambda: httpx.get(front.url + "/v1/models").json()["data"], what="model")[0]["id"]
        agent.child.kill()  # the Mac sleeps: its heartbeat stops, the autoscaler keeps it as "asleep"
        wait_until(state_is(redis_url, "asleep"), what="asleep")

        with ThreadPoolExecutor(1) as pool:
            asked = pool.submit(httpx.post, front.url + "/v1/chat/completions", timeout=90, json={
                "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
            packet, _ = listener.recvfrom(1024)  # the request's demand woke it
            assert packet == b"\xff" * 6 + bytes.fromhex("a0cec801020f") * 16
            wait_until(state_is(redis_url, "waking"), what="waking")  # on the dashboard
            stack.agent("agent-n1-again", sim.url, redis_url, "n1", *args)  # it boots; its agent starts
            answer = asked.result(timeout=90)
        assert answer.status_code == 200, answer.text
    finally:
        listener.close()


def supervised_standby(stack: Stack, redis_url: str, node_id: str, gguf: Path, load_s: float,
                       *args: str) -> None:
    """A Mac in standby whose agent starts its llama-server (a simulator answering 503 Loading for
    ``load_s``) when asked to load; it serves the model named after ``gguf``."""
    stack.macpool(f"agent-{node_id}", "agent", "run", "--redis-url", redis_url, "--node-id", node_id,
                  "--standby", "--token", AGENT_TOKEN, "--heartbeat-interval", "0.3", "--model", str(gguf),
                  "--parallel", "2", "--llama-server", f"{SIM_COMMAND} --load-seconds {load_s}", *args)
    wait_until(lambda: (d := read_node(redis_url, node_id)) is not None and d.state == "standby",
               what=f"{node_id} in standby")


def test_requests_for_a_cold_model_load_it_on_one_node_and_it_unloads_when_idle(
        stack: Stack, redis_url: str, tmp_path: Path) -> None:
    gguf = tmp_path / "cold.gguf"
    gguf.write_bytes(b"x")
    # a load takes 2 s, while the waiting requests look again every second: a node already loading is not
    # one in standby, so only the marker in Redis keeps them from asking the other node too
    for node_id in ("n1", "n2"):
        supervised_standby(stack, redis_url, node_id, gguf, 2, "--idle-unload", "2")
    front = router(stack, redis_url, "30")  # no autoscaler: the requests ask for the load themselves
    body = {"model": "cold", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda _: httpx.post(front.url + "/v1/chat/completions", json=body,
                                                     timeout=60), range(6)))
    assert [a.status_code for a in answers] == [200] * 6, [a.text for a in answers]
    states = {n: doc.state for n in ("n1", "n2") if (doc := read_node(redis_url, n)) is not None}
    assert sorted(states.values()) == ["ready", "standby"], states  # one load for the burst, not one each
    loaded = next(n for n, state in states.items() if state == "ready")
    # idle for --idle-unload: it unloads by itself and says so in Redis, so nothing loads it again
    wait_until(lambda: (d := read_node(redis_url, loaded)) is not None and d.state == "standby", 20,
               what="back in standby once idle")
    with sync_redis(redis_url) as store:
        assert store.get(Keys().desired(loaded)) == "standby"


def test_a_model_still_loading_past_the_timeout_is_a_503_model_loading(
        stack: Stack, redis_url: str, tmp_path: Path) -> None:
    gguf = tmp_path / "slow.gguf"
    gguf.write_bytes(b"x")
    supervised_standby(stack, redis_url, "n1", gguf, 60)
    front = router(stack, redis_url, "1")
    answer = httpx.post(front.url + "/v1/chat/completions", timeout=30, json={
        "model": "slow", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["code"] == "model_loading"
    assert answer.headers["X-Macpool-Reason"] == "model_loading" and int(answer.headers["Retry-After"]) >= 1
    wait_until(state_is(redis_url, "loading"), what="the node loading the model it was asked for")


def _chat(model: str) -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _waiting(redis_url: str) -> int:
    with sync_redis(redis_url) as store:
        return int(store.zcard(Keys().queue))


def test_requests_waiting_for_a_load_count_against_the_queue_and_the_key_limit(
        stack: Stack, redis_url: str, tmp_path: Path) -> None:
    model = standby_node(stack, redis_url)
    keys = tmp_path / "keys"
    keys.write_text("sk-cold-start-one-0001 name=one max_concurrency=1\nsk-cold-start-two-0002 name=two\n")
    # nothing loads the model (no autoscaler, no load on demand): whoever waits, waits the whole timeout
    front = router(stack, redis_url, "8", "--no-load-on-demand", "--queue-size", "2", "--api-keys-file",
                   str(keys))
    one, two = ({"Authorization": f"Bearer sk-cold-start-{k}"} for k in ("one-0001", "two-0002"))
    url = front.url + "/v1/chat/completions"
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(httpx.post, url, json=_chat(model), headers=one, timeout=60)
        wait_until(lambda: _waiting(redis_url) == 1, what="the first request waiting for the load")
        # the key's limit holds for a request waiting on a load: 429, as for one waiting for a slot
        limited = httpx.post(url, json=_chat(model), headers=one, timeout=30)
        assert limited.status_code == 429, limited.text
        assert limited.json()["error"]["code"] == "key_limit" and int(limited.headers["Retry-After"]) >= 1
        second = pool.submit(httpx.post, url, json=_chat(model), headers=two, timeout=60)
        wait_until(lambda: _waiting(redis_url) == 2, what="the second request waiting for the load")
        # the queue's bound too: a third waiter finds no room, 503 pool_full at once
        full = httpx.post(url, json=_chat(model), headers=two, timeout=30)
        assert full.status_code == 503, full.text
        assert full.json()["error"]["code"] == "pool_full" and full.headers["X-Macpool-Reason"] == "pool_full"
        waited = [first.result(timeout=60), second.result(timeout=60)]
    # those that found room waited for the load until the timeout
    assert [(a.status_code, a.json()["error"]["code"]) for a in waited] == [(503, "cold_start")] * 2
    assert _waiting(redis_url) == 0
