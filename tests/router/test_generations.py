"""A request running several generations at once (several prompts, n > 1) through the router: refused with
a 400 when no node could ever run them all at once, else sent so that its agent counts each on its cap."""

from __future__ import annotations

import contextlib
import threading
import time

import httpx
import pytest
import redis

from macpool.contract import now_ms
from macpool.store import Keys
from tests.conftest import chat, metric, wait_until
from tests.router.conftest import Pool

pytestmark = pytest.mark.in_process  # none of these tests is about a process


def test_more_generations_than_any_node_runs_are_a_400_and_the_others_count_each(pool: Pool) -> None:
    node = pool.node("n1", cap=2, parallel=8, speed=20.0)
    router = pool.router()
    pool.wait_ready(router, 1)
    url = router.url + "/v1/chat/completions"
    too_many = httpx.post(url, json={**chat(stream=False), "n": 3}, timeout=10)
    assert too_many.status_code == 400
    error = too_many.json()["error"]
    assert error["code"] == "too_many_generations"
    assert error["message"].endswith("no node in the pool runs more than 2")
    prompts = {"prompt": ["a", "b", "c"], "max_tokens": 5}
    assert httpx.post(router.url + "/v1/completions", json=prompts, timeout=10).status_code == 400
    assert metric(router.url, 'macpool_requests_total{model="",node="",status="400"}') == 2
    assert node.stats()["completed"] == 0  # none of them reached a node
    # two fit: streamed through the router, the agent still counts them as two while they run
    with httpx.stream("POST", url, json={**chat(max_tokens=2000), "n": 2}, timeout=30) as pair:
        assert pair.status_code == 200
        chunks = pair.iter_raw()  # keep the generator: dropping it closes the stream
        next(chunks)
        assert node.status()["in_flight"] == 2
    wait_until(lambda: node.status()["in_flight"] == 0, timeout=2)


def test_a_request_holds_a_slot_per_generation_in_the_pool_through_renewals(pool: Pool,
                                                                            redis_url: str) -> None:
    # what the agent counts, Redis counts too: the pool view, the scale hint and the other replicas see it
    node = pool.node("n1", cap=3, parallel=8, speed=1.0)
    router = pool.router("--lease-seconds", "1", "--queue-size", "0")
    pool.wait_ready(router, 1)
    store = redis.Redis.from_url(redis_url)
    live = lambda: int(store.zcount(Keys().reservations("n1"), now_ms(), "+inf"))  # noqa: E731
    reserved = lambda: next(n["reserved"] for n in httpx.get(router.url + "/api/pool").json()["nodes"])  # noqa: E731
    url = router.url + "/v1/chat/completions"
    with httpx.stream("POST", url, json={**chat(max_tokens=4000), "n": 2}, timeout=30) as pair:
        assert pair.status_code == 200
        chunks = pair.iter_raw()  # keep the generator: dropping it closes the stream
        next(chunks)
        time.sleep(2.5)  # past two lease times: renewed, both slots
        assert live() == 2 and node.status()["in_flight"] == 2
        wait_until(lambda: reserved() == 2, timeout=3)
        # one slot left: a second pair is refused by Redis, without asking the node; a single gets through
        refused = httpx.post(url, json={**chat(stream=False), "n": 2}, timeout=10)
        assert refused.status_code == 503 and refused.headers["x-macpool-reason"] == "pool_full"
        assert not metric(node.agent.url, 'macpool_agent_rejections_total{reason="node_full"}')
        assert httpx.post(url, json=chat(stream=False, max_tokens=2), timeout=10).status_code == 200
    wait_until(lambda: live() == 0, timeout=5)
    wait_until(lambda: reserved() == 0, timeout=5)
    store.close()


def test_a_waiting_request_counts_a_slot_per_generation_in_the_pools_demand(pool: Pool) -> None:
    # the scale hint and the saturation read demand in slots: a waiting pair will hold two
    pool.node("n1", cap=2, parallel=8, speed=1.0)
    router = pool.router("--queue-size", "4", "--queue-timeout", "20")
    pool.wait_ready(router, 1)
    url = router.url + "/v1/chat/completions"
    totals = lambda: httpx.get(router.url + "/api/pool").json()["pool"]  # noqa: E731
    with httpx.Client(timeout=30) as client, \
            client.stream("POST", url, json={**chat(max_tokens=4000), "n": 2}) as pair:
        chunks = pair.iter_raw()  # keep the generator: dropping it closes the stream
        next(chunks)
        answers: list[int] = []
        body = {**chat(stream=False, max_tokens=2), "n": 2}
        waiting = threading.Thread(
            target=lambda: answers.append(httpx.post(url, json=body, timeout=30).status_code))
        waiting.start()
        now = wait_until(lambda: (t := totals())["queued"] == 1 and t["queued_slots"] == 2 and t, timeout=5)
        assert now["busy"] == 2 and now["saturation"] == 2.0  # (2 busy + 2 waiting) / capacity 2
        chunks.close()
    waiting.join(timeout=20)
    assert answers == [200]  # served once the pair ended
    wait_until(lambda: totals()["queued_slots"] == 0, timeout=5)


def test_a_full_answer_for_several_generations_does_not_refuse_the_others(pool: Pool) -> None:
    # only the big node can run three generations at once: Redis calling it full says nothing of the small
    # one, so the router must not refuse the model's other requests from its memory of that "full"
    big = pool.node("big", cap=3, parallel=8, speed=1.0)
    pool.node("small", cap=1, parallel=8, speed=20.0)
    router = pool.router("--queue-size", "0", "--admin-key", "admin-key-of-16-chars")
    pool.wait_ready(router, 2)
    admin = {"Authorization": "Bearer admin-key-of-16-chars"}
    url = router.url + "/v1/chat/completions"
    with httpx.Client(timeout=30) as client, contextlib.ExitStack() as held:
        assert client.post(router.url + "/admin/nodes/small/drain", headers=admin).status_code == 200
        for i in range(3):  # the big node full
            body = chat(max_tokens=4000, content=f"{i}")
            response = held.enter_context(client.stream("POST", url, json=body))
            assert response.headers["x-macpool-node"] == "big"
            chunks = response.iter_raw()
            next(chunks)
            held.callback(chunks.close)  # also keeps the generator: dropping it would close the stream
        assert client.post(router.url + "/admin/nodes/small/undrain", headers=admin).status_code == 200
        wait_until(lambda: any(n["node_id"] == "small" and not n["drained"]
                               for n in client.get(router.url + "/api/pool").json()["nodes"]), timeout=5)
        for _ in range(3):
            refused = client.post(url, json={**chat(stream=False), "n": 3})
            assert refused.status_code == 503 and refused.headers["x-macpool-reason"] == "pool_full"
            single = client.post(url, json=chat(stream=False))  # within the 50 ms the memo would last
            assert single.status_code == 200 and single.headers["x-macpool-node"] == "small"
        assert big.status()["in_flight"] == 3


def test_generations_are_counted_as_llama_server_runs_them(pool: Pool) -> None:
    # a list mixing strings and token ids is one prompt; a null n_cmpl leaves n to count
    pool.node("n1", cap=1, parallel=8, speed=20.0)
    router = pool.router()
    pool.wait_ready(router, 1)
    url = router.url + "/v1/completions"
    mixed = httpx.post(url, json={"prompt": ["Say", 42, "hello."], "max_tokens": 2}, timeout=10)
    assert mixed.status_code == 200, mixed.text
    assert len(mixed.json()["choices"]) == 1
    two = httpx.post(url, json={"prompt": "Say hello.", "n_cmpl": None, "n": 2, "max_tokens": 2}, timeout=10)
    assert two.status_code == 400
    assert two.json()["error"]["code"] == "too_many_generations"


def test_a_request_only_a_node_away_for_now_could_run_is_a_503_not_a_400(pool: Pool) -> None:
    # the big node drained (a restart, maintenance): the request is fine, the pool is short for now
    pool.node("big", cap=3, parallel=8, speed=20.0)
    pool.node("small", cap=1, parallel=8, speed=20.0)
    router = pool.router("--queue-size", "0", "--admin-key", "admin-key-of-16-chars")
    pool.wait_ready(router, 2)
    admin = {"Authorization": "Bearer admin-key-of-16-chars"}
    url = router.url + "/v1/chat/completions"
    with httpx.Client(timeout=30) as client:
        assert client.post(router.url + "/admin/nodes/big/drain", headers=admin).status_code == 200
        wait_until(lambda: any(n["node_id"] == "big" and n["drained"]
                               for n in client.get(router.url + "/api/pool").json()["nodes"]), timeout=5)
        refused = client.post(url, json={**chat(stream=False), "n": 2})
        assert refused.status_code == 503, refused.text
        assert refused.headers["x-macpool-reason"] == "pool_full" and "retry-after" in refused.headers
        assert client.post(url, json={**chat(stream=False), "n": 4}).status_code == 400  # more than big runs
        assert client.post(router.url + "/admin/nodes/big/undrain", headers=admin).status_code == 200
        pair = {**chat(stream=False), "n": 2}
        wait_until(lambda: client.post(url, json=pair).status_code == 200, timeout=5)


def test_a_waiting_pair_that_gives_up_passes_on_at_once_the_slots_held_back_for_it(pool: Pool,
                                                                                     redis_url: str) -> None:
    # a has one slot free, held back for the pair queued ahead of the single (b, of one slot, is full and
    # too small for the pair); when the pair's queue timeout ends its wait, the single is handed a's slot
    # then, not at its own next re-check
    pool.node("a", cap=2, parallel=8, speed=1.0)
    pool.node("b", cap=1, parallel=8, speed=1.0)
    router = pool.router("--queue-size", "4", "--queue-timeout", "1")
    pool.wait_ready(router, 2)
    store = redis.Redis.from_url(redis_url)
    live = lambda: sum(int(store.zcount(Keys().reservations(n), now_ms(), "+inf")) for n in "ab")  # noqa: E731
    queued = lambda: httpx.get(router.url + "/api/pool").json()["pool"]["queued"]  # noqa: E731
    url = router.url + "/v1/chat/completions"
    single_started, done = threading.Event(), threading.Event()

    def single() -> None:
        with httpx.stream("POST", url, json=chat(max_tokens=4000, content="single"), timeout=30) as response:
            assert response.status_code == 200
            chunks = response.iter_raw()
            next(chunks)
            single_started.set()
            done.wait(10)

    with httpx.Client(timeout=30) as client, contextlib.ExitStack() as held:
        for i in range(2):  # one long stream on each node (the least utilised takes the next)
            body = chat(max_tokens=4000, content=f"{i}")
            response = held.enter_context(client.stream("POST", url, json=body))
            chunks = response.iter_raw()
            next(chunks)
            held.callback(chunks.close)  # also keeps the generator: dropping it would close the stream
        assert live() == 2
        answers: list[httpx.Response] = []
        pair = threading.Thread(
            target=lambda: answers.append(httpx.post(url, json={**chat(stream=False), "n": 2}, timeout=30)))
        pair.start()
        wait_until(lambda: queued() == 1, timeout=5)
        time.sleep(0.25)  # the single's own re-checks (every 0.5 s) fall between the pair's
        waiting = threading.Thread(target=single)
        waiting.start()
        held.callback(waiting.join, 10)
        held.callback(done.set)
        pair.join(timeout=10)
        assert answers[0].status_code == 503 and answers[0].headers["x-macpool-reason"] == "queue_timeout"
        assert live() == 3  # the single holds a's free slot already
        assert single_started.wait(5)
