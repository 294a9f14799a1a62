"""The bounded queue: a waiter wakes when a slot frees anywhere; a waiter that waits too long gets 503."""

from __future__ import annotations

import contextlib
import threading

import httpx
import pytest
import redis

from macpool.store import Keys
from tests.conftest import chat, metric
from tests.router.conftest import Pool, queued, wait_until

pytestmark = pytest.mark.in_process  # none of these tests is about a process


def test_queued_request_wakes_on_release_and_times_out_otherwise(pool: Pool, redis_url: str) -> None:
    store = redis.Redis.from_url(redis_url)
    pool.node("n1", cap=1, speed=1)
    patient = pool.router("--queue-size", "4", "--queue-timeout", "60")
    hasty = pool.router("--queue-size", "4", "--queue-timeout", "1")
    pool.wait_ready(patient, nodes=1)
    pool.wait_ready(hasty, nodes=1)
    model = pool.model(patient)
    long_body, short_body = chat(model, 4000), chat(model, 4, stream=False)
    answers: list[httpx.Response] = []

    with httpx.Client(timeout=90) as client:
        with client.stream("POST", patient.url + "/v1/chat/completions", json=long_body) as held:
            chunks = held.iter_raw()  # keep a reference: a collected iterator closes the connection
            next(chunks)
            def wait_in_queue() -> None:
                # a client of its own: one httpx.Client shared by two threads can close the other's socket
                with httpx.Client(timeout=90) as own:
                    answers.append(own.post(patient.url + "/v1/chat/completions", json=short_body))

            waiter = threading.Thread(target=wait_in_queue)
            waiter.start()
            wait_until(lambda: queued(patient.url) == 1)

            # a queued client that gives up leaves the queue at once, not after the queue timeout
            with contextlib.suppress(httpx.ReadTimeout), httpx.Client(timeout=1.0) as hasty_client:
                hasty_client.post(patient.url + "/v1/chat/completions", json=short_body)
            wait_until(lambda: store.zcard(Keys().queue) == 1, timeout=15)

            # the other replica's waiter is not woken by anything and times out with an honest 503
            timed_out = client.post(hasty.url + "/v1/chat/completions", json=short_body)
            assert timed_out.status_code == 503
            assert timed_out.json()["error"]["code"] == "queue_timeout"
            assert timed_out.headers["x-macpool-reason"] == "queue_timeout"
            assert 1 <= int(timed_out.headers["retry-after"]) <= 30
        # the held stream ends: its slot is freed, the queued request is admitted
        waiter.join(timeout=60)
    assert answers and answers[0].status_code == 200, answers
    labels = '{priority="interactive",tenant="anonymous"}'
    assert metric(patient.url, "macpool_queue_wait_seconds_count" + labels) == 1
    assert metric(hasty.url, 'macpool_rejections_total{reason="queue_timeout"}') == 1
    wait_until(lambda: httpx.get(patient.url + "/api/pool").json()["pool"]["queued"] == 0)
    store.close()


def test_a_full_pool_is_remembered_briefly_so_rejections_skip_redis(pool: Pool, redis_url: str) -> None:
    store = redis.Redis.from_url(redis_url)
    pool.node("n1", cap=1, speed=1)
    router = pool.router("--queue-size", "0")
    pool.wait_ready(router, nodes=1)
    model = pool.model(router)

    def evalsha_calls() -> int:
        stats = store.info("commandstats").get("cmdstat_evalsha", {})
        return int(stats.get("calls", 0))

    with httpx.Client(timeout=30) as client:
        with client.stream("POST", router.url + "/v1/chat/completions", json=chat(model, 4000)) as held:
            chunks = held.iter_raw()
            next(chunks)
            before = evalsha_calls()
            codes = [client.post(router.url + "/v1/chat/completions", json=chat(model, 4, stream=False))
                     for _ in range(40)]
            calls = evalsha_calls() - before
        assert all(r.status_code == 503 and r.headers["x-macpool-reason"] == "pool_full" for r in codes)
        # the first refusal asks Redis; the next ones within 50 ms (and no release meanwhile) do not
        print(f"{calls} reservation calls for 40 refusals")
        assert calls < 30, calls
        # a release makes the router ask again at once: the next request is admitted
        wait_until(lambda: client.post(router.url + "/v1/chat/completions",
                                       json=chat(model, 4, stream=False)).status_code == 200)
    store.close()
