"""Issue 9 through real routers, agents and simulators: prefix affinity, priority classes, fair queueing
between API keys and per-key concurrency limits."""

from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import chat, metric
from tests.router.conftest import Pool, wait_until

LONG_DOCUMENT = "The quarterly report says revenue grew in every region. " * 40  # ~2.2 KB: worth caching


pytestmark = pytest.mark.in_process  # none of these tests is about a process


def _model(router_url: str, key: str) -> str:
    models = httpx.get(router_url + "/v1/models", headers={"Authorization": f"Bearer {key}"}).json()
    name: str = models["data"][0]["id"]
    return name


def test_a_conversation_stays_on_the_node_holding_its_prefix_across_replicas(pool: Pool) -> None:
    nodes = {name: pool.node(name, cap=4) for name in ("a", "b", "c")}
    routers = [pool.router(), pool.router()]
    for router in routers:
        pool.wait_ready(router, nodes=3)
    model = pool.model(routers[0])
    messages: list[dict[str, str]] = [{"role": "system", "content": LONG_DOCUMENT}]
    served = []
    with httpx.Client(timeout=30) as client:
        for turn in range(6):
            messages.append({"role": "user", "content": f"question {turn}?"})
            body = chat(model, 8, stream=False) | {"messages": messages}
            router = routers[turn % 2]  # alternate replicas
            answer = client.post(router.url + "/v1/chat/completions", json=body)
            assert answer.status_code == 200, answer.text
            served.append(answer.headers["x-macpool-node"])
            reply = answer.json()["choices"][0]["message"]["content"]
            messages.append({"role": "assistant", "content": reply})
    assert len(set(served)) == 1, served  # every turn, through either replica, on the node holding the prefix
    holder = nodes[served[0]]
    assert holder.stats()["prompt_tokens_cached_total"] > 5 * 400  # five turns re-used the document's KV
    hits = sum(metric(r.url, 'macpool_affinity_total{outcome="hit"}') for r in routers)
    assert hits == 5
    assert metric(routers[0].url, 'macpool_affinity_total{outcome="miss"}') == 1
    view = httpx.get(routers[1].url + "/api/pool").json()
    assert view["affinity"]["enabled"] is True and view["affinity"]["hit_rate"] == 1.0


def test_without_affinity_the_same_conversation_is_spread_by_load(pool: Pool) -> None:
    for name in ("a", "b", "c"):
        pool.node(name, cap=4)
    router = pool.router("--no-affinity")
    pool.wait_ready(router, nodes=3)
    model = pool.model(router)
    body = chat(model, 4, stream=False) | {"messages": [{"role": "user", "content": LONG_DOCUMENT}]}
    with httpx.Client(timeout=30) as client:
        served = {client.post(router.url + "/v1/chat/completions", json=body).headers["x-macpool-node"]
                  for _ in range(12)}
    assert len(served) >= 2  # random tie-breaks among idle nodes
    assert "macpool_affinity_total{" not in httpx.get(router.url + "/metrics").text


def _keys_file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "keys"
    path.write_text(text)
    return str(path)


def test_a_key_over_its_concurrency_limit_gets_429_and_others_are_served(pool: Pool, tmp_path: Path) -> None:
    pool.node("n1", cap=4, speed=1)
    keys = _keys_file(tmp_path, "sk-small name=small max_concurrency=1\nsk-big name=big\n")
    router = pool.router("--api-keys-file", keys, "--key-max-concurrency", "2")
    pool.wait_ready(router, nodes=1)
    model = _model(router.url, "sk-big")
    small, big = ({"Authorization": f"Bearer {k}"} for k in ("sk-small", "sk-big"))
    url = router.url + "/v1/chat/completions"
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", url, json=chat(model, 4000), headers=small) as held:
            chunks = held.iter_raw()
            next(chunks)
            refused = client.post(url, json=chat(model, 4, stream=False), headers=small)
            assert refused.status_code == 429
            assert refused.json()["error"]["code"] == "key_limit"
            assert refused.json()["error"]["type"] == "rate_limit_error"
            assert refused.headers["x-macpool-reason"] == "key_limit"
            assert 1 <= int(refused.headers["retry-after"]) <= 30
            assert client.post(url, json=chat(model, 4, stream=False), headers=big).status_code == 200
            # the router-wide default (2) applies to keys without their own limit
            with client.stream("POST", url, json=chat(model, 4000), headers=big) as one, \
                    client.stream("POST", url, json=chat(model, 4000), headers=big) as two:
                assert one.status_code == two.status_code == 200
                assert client.post(url, json=chat(model, 4, stream=False), headers=big).status_code == 429
        # the held stream is over (its release is a moment behind the client closing it): small may send again
        again = chat(model, 4, stream=False)
        wait_until(lambda: client.post(url, json=again, headers=small).status_code == 200)
    assert metric(router.url, 'macpool_key_limited_total{tenant="small"}') >= 1
    assert metric(router.url, 'macpool_key_limited_total{tenant="big"}') == 1
    bad = httpx.post(url, json=chat(model, 4, stream=False), headers=big | {"X-Macpool-Priority": "urgent"})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_priority"


def test_batch_is_shed_first_while_interactive_requests_queue(pool: Pool) -> None:
    pool.node("n1", cap=1, speed=1)
    router = pool.router("--queue-size", "2", "--batch-queue-share", "0.5", "--queue-timeout", "60")
    pool.wait_ready(router, nodes=1)
    model = pool.model(router)
    url = router.url + "/v1/chat/completions"
    answers: dict[str, httpx.Response] = {}

    def send(name: str, priority: str) -> None:
        body = chat(model, 4, stream=False)
        answers[name] = httpx.post(url, json=body, headers={"X-Macpool-Priority": priority}, timeout=90)

    def queued() -> int:
        depth: int = httpx.get(router.url + "/api/pool").json()["pool"]["queued"]
        return depth

    threads: list[threading.Thread] = []

    def start(name: str, priority: str, depth: int) -> None:
        thread = threading.Thread(target=send, args=(name, priority))
        thread.start()
        threads.append(thread)
        wait_until(lambda: queued() == depth)

    with httpx.Client(timeout=90) as client, client.stream("POST", url, json=chat(model, 4000)) as held:
        chunks = held.iter_raw()
        next(chunks)
        start("batch-1", "batch", 1)
        send("batch-2", "batch")  # batch may hold half the queue: turned away at once
        assert answers["batch-2"].status_code == 503
        assert answers["batch-2"].json()["error"]["code"] == "batch_shed"
        assert answers["batch-2"].headers["x-macpool-reason"] == "batch_shed"
        assert "retry-after" in answers["batch-2"].headers
        start("interactive-1", "interactive", 2)
        # the queue is full: the next interactive request takes the queued batch request's place
        start("interactive-2", "interactive", 2)
        wait_until(lambda: "batch-1" in answers)
        assert answers["batch-1"].status_code == 503
        assert answers["batch-1"].json()["error"]["code"] == "batch_shed"
    for thread in threads:
        thread.join(timeout=90)
    assert answers["interactive-1"].status_code == answers["interactive-2"].status_code == 200
    view = httpx.get(router.url + "/api/pool").json()
    assert set(view["queue_wait_p50_ms"]["priority"]) == {"interactive"}
    assert metric(router.url, 'macpool_rejections_total{reason="batch_shed"}') == 2


def test_a_flooding_tenant_cannot_starve_a_light_one(pool: Pool, tmp_path: Path) -> None:
    pool.node("n1", cap=2, speed=50)
    keys = _keys_file(tmp_path, "sk-flood name=flood\nsk-light name=light\n")
    router = pool.router("--api-keys-file", keys, "--queue-size", "64", "--queue-timeout", "120")
    pool.wait_ready(router, nodes=1)
    model = _model(router.url, "sk-light")
    url = router.url + "/v1/chat/completions"
    body = chat(model, 600, stream=False)  # ~0.15 s of simulated decode each at --speed 50
    waits: dict[str, list[float]] = {"flood": [], "light": []}
    failures: list[Any] = []

    def client_loop(tenant: str, count: int, pause: float) -> None:
        with httpx.Client(timeout=120, headers={"Authorization": f"Bearer sk-{tenant}"}) as client:
            for _ in range(count):
                started = time.monotonic()
                answer = client.post(url, json=body)
                if answer.status_code != 200:
                    failures.append((tenant, answer.status_code, answer.text))
                waits[tenant].append(time.monotonic() - started)
                time.sleep(pause)

    flood = [threading.Thread(target=client_loop, args=("flood", 3, 0.0)) for _ in range(20)]
    for thread in flood:
        thread.start()
    wait_until(lambda: httpx.get(router.url + "/api/pool").json()["pool"]["queued"] >= 16)
    light = threading.Thread(target=client_loop, args=("light", 4, 0.2))
    light.start()
    light.join(timeout=120)
    for thread in flood:
        thread.join(timeout=120)
    assert not failures, failures[:3]
    # 20 flooding clients keep ~18 requests queued for 2 slots; each light request still goes next in line
    light_p50, flood_p50 = statistics.median(waits["light"]), statistics.median(waits["flood"])
    print(f"latency p50: light {light_p50:.2f} s, flood {flood_p50:.2f} s")
    assert light_p50 * 3 < flood_p50, (waits["light"], flood_p50)
