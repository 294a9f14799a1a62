"""Failures: another node is tried before the first byte; after it, the stream ends with an error event."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator

import httpx
import pytest
from redis.asyncio import Redis as AsyncRedis
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from macpool.contract import NodeDoc, now_ms
from macpool.store import Store
from tests import stand_in
from tests.conftest import chat, metric
from tests.inprocess import LocalStack
from tests.router.conftest import AGENT_TOKEN, Pool, queued, wait_until


def test_failover_before_first_byte_then_error_event_mid_stream(pool: Pool) -> None:
    nodes = {name: pool.node(name, cap=4, speed=1) for name in ("a", "b")}
    router = pool.router("--queue-size", "0")
    pool.wait_ready(router, nodes=2)
    model = pool.model(router)
    long_body, short_body = chat(model, 4000), chat(model, 4, stream=False)
    with (
        httpx.Client(base_url=router.url, timeout=30) as client,
        client.stream("POST", "/v1/chat/completions", json=long_body) as held,
    ):
        assert held.status_code == 200
        chunks = held.iter_raw()
        next(chunks)
        busy = held.headers["x-macpool-node"]
        idle = "b" if busy == "a" else "a"

        # the idle node is now the least utilised, but its agent is dead (its heartbeat not yet expired):
        # the connect error releases that reservation and the request lands on the other node
        nodes[idle].agent.child.kill()
        answer = client.post("/v1/chat/completions", json=short_body)
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-macpool-node"] == busy
        assert answer.json()["choices"][0]["message"]["content"] is not None

        # now kill the busy node's agent mid-stream: the client sees an SSE error event, then the end
        nodes[busy].agent.child.kill()
        rest = b"".join(chunks)
    events = [line[len(b"data: ") :] for line in rest.split(b"\n") if line.startswith(b"data: ")]
    assert events, rest
    error = json.loads(events[-1])["error"]
    assert error["code"].startswith("upstream_")
    assert "127.0.0.1" not in error["message"]
    metrics = httpx.get(router.url + "/metrics").text
    assert f'macpool_upstream_errors_total{{kind="connect",node="{idle}"}}' in metrics


@pytest.mark.in_process
def test_a_request_waiting_after_a_node_refused_it_neither_gets_nor_blocks_that_node(pool: Pool) -> None:
    nodes = {name: pool.node(name, cap=1, speed=1) for name in ("a", "b")}
    router = pool.router("--queue-size", "4", "--queue-timeout", "45")
    pool.wait_ready(router, nodes=2)
    model = pool.model(router)
    long_body, short_body = chat(model, 4000), chat(model, 4, stream=False)
    token = {"x-macpool-token": AGENT_TOKEN}
    answers: list[httpx.Response] = []
    # a's only slot is taken behind the router's back (Redis still sees it free): a's agent refuses
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", nodes["a"].agent.url + "/v1/chat/completions", json=long_body,
                      headers=token) as direct,
    ):
        assert direct.status_code == 200
        direct_chunks = direct.iter_raw()
        next(direct_chunks)
        with client.stream("POST", router.url + "/v1/chat/completions", json=long_body) as held:
            assert held.status_code == 200 and held.headers["x-macpool-node"] == "b"
            held_chunks = held.iter_raw()
            next(held_chunks)

            def picky() -> None:  # tries a (refused: node_full), then waits for b
                with httpx.Client(timeout=60) as own:
                    answers.append(own.post(router.url + "/v1/chat/completions", json=short_body))

            waiter = threading.Thread(target=picky)
            waiter.start()
            wait_until(lambda: queued(router.url) == 1)
            assert metric(router.url, 'macpool_upstream_errors_total{kind="node_full",node="a"}') >= 1
            direct.close()  # a is free again
            status = nodes["a"].agent.url + "/status"
            wait_until(lambda: httpx.get(status, timeout=5).json()["in_flight"] == 0)
            # a later request is not held back behind the waiter that will not go to a...
            later = client.post(router.url + "/v1/chat/completions", json=short_body, timeout=20)
            assert later.status_code == 200 and later.headers["x-macpool-node"] == "a"
            # ...and a's slot, released, is not handed to that waiter either: it still waits for b
            time.sleep(1.0)
            assert queued(router.url) == 1 and not answers
        waiter.join(timeout=60)  # b's stream was closed: its slot goes to the waiter
    assert answers and answers[0].status_code == 200, answers
    assert answers[0].headers["x-macpool-node"] == "b"


def test_a_full_node_then_an_unreachable_one_is_a_503_to_retry_not_a_502(pool: Pool) -> None:
    nodes = {name: pool.node(name, cap=1, speed=1) for name in ("a", "b")}
    router = pool.router("--queue-size", "0")
    pool.wait_ready(router, nodes=2)
    model = pool.model(router)
    # a prompt long enough for prefix affinity: its second request goes first to the node that served it
    body = {"model": model, "max_tokens": 4, "messages": [
        {"role": "system", "content": "You answer in one short sentence. " * 20},
        {"role": "user", "content": "hello"},
    ]}
    with httpx.Client(timeout=60) as client:
        first = client.post(router.url + "/v1/chat/completions", json=body)
        assert first.status_code == 200, first.text
        full = first.headers["x-macpool-node"]
        dead = "b" if full == "a" else "a"
        # that node's only slot is taken behind the router's back (its agent refuses: node_full), and the
        # other node's agent is killed (its heartbeat not yet expired: connection refused)
        with client.stream("POST", nodes[full].agent.url + "/v1/chat/completions", json=chat(model, 4000),
                           headers={"x-macpool-token": AGENT_TOKEN}) as direct:
            assert direct.status_code == 200
            direct_chunks = direct.iter_raw()  # kept: a dropped iterator closes the stream
            next(direct_chunks)
            nodes[dead].agent.child.kill()
            answer = client.post(router.url + "/v1/chat/completions", json=body)
    assert metric(router.url, f'macpool_upstream_errors_total{{kind="node_full",node="{full}"}}') == 1
    assert metric(router.url, f'macpool_upstream_errors_total{{kind="connect",node="{dead}"}}') == 1
    # the pool was full, not broken: a 503 with Retry-After, whatever the last node tried did
    assert answer.status_code == 503, answer.text
    assert answer.headers["x-macpool-reason"] == "pool_full" and int(answer.headers["retry-after"]) >= 1
    assert answer.json()["error"]["code"] == "pool_full"


@pytest.mark.in_process
def test_an_agent_that_has_not_yet_seen_a_slot_freed_is_asked_again_before_the_request_fails_over(
        pool: Pool) -> None:
    # Redis gives a slot on as soon as the router releases it, often before the agent has seen that request
    # end (its client gone): the agent's brief "full" must not turn the next request into a 503
    node = pool.node("a", cap=1, speed=1)
    router = pool.router("--queue-size", "0")
    pool.wait_ready(router, nodes=1)
    model = pool.model(router)
    refusals = 'macpool_agent_rejections_total{reason="node_full"}'
    answers: list[httpx.Response] = []
    with httpx.Client(timeout=60) as client:
        # the node's only slot taken behind the router's back (Redis sees it free), given back a moment later
        with client.stream("POST", node.agent.url + "/v1/chat/completions", json=chat(model, 4000),
                           headers={"x-macpool-token": AGENT_TOKEN}) as direct:
            direct_chunks = direct.iter_raw()  # kept: a dropped iterator closes the stream
            next(direct_chunks)
            short = chat(model, 4, stream=False)
            sent = threading.Thread(target=lambda: answers.append(
                httpx.post(router.url + "/v1/chat/completions", json=short, timeout=60)))
            sent.start()
            wait_until(lambda: metric(node.agent.url, refusals) >= 1, timeout=5, interval=0.01)
        sent.join(timeout=30)
    assert answers and answers[0].status_code == 200, answers[0].text if answers else answers
    assert answers[0].headers["x-macpool-node"] == "a"
    assert not metric(router.url, 'macpool_upstream_errors_total{kind="node_full",node="a"}')


async def _head_then_die(request: Request) -> Response:
    async def body() -> AsyncIterator[bytes]:
        raise RuntimeError("the agent is killed here")  # uvicorn has sent the head: it drops the connection
        yield b""  # (a generator)

    return StreamingResponse(body(), media_type="application/json")


@pytest.mark.in_process
def test_a_node_that_dies_between_its_answers_head_and_body_is_failed_over(
        pool: Pool, local_stack: LocalStack, redis_url: str) -> None:
    live = pool.node("live", cap=4, speed=1)
    router = pool.router("--queue-size", "0", "--placement", "least-utilised")
    pool.wait_ready(router, nodes=1)
    model = pool.model(router)
    # a node whose "agent" answers a status line and headers, then its connection is gone; it looks the
    # faster of two idle nodes, so it is tried first
    dying = local_stack.serve("dying", stand_in.app("dying", [
        Route("/v1/chat/completions", _head_then_die, methods=["POST"])]))

    async def register() -> None:
        client = AsyncRedis.from_url(redis_url)
        doc = NodeDoc(node_id="dying", url=dying.url, models=[model], capacity=4, total_slots=4,
                      state="ready", tokens_per_s=10_000.0, updated_at_ms=now_ms())
        await Store(client).heartbeat(doc, 600_000)
        await client.aclose()

    asyncio.run(register())
    pool.wait_ready(router, nodes=2)
    with httpx.Client(base_url=router.url, timeout=30) as client:
        answer = client.post("/v1/chat/completions", json=chat(model, 4, stream=False))
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-macpool-node"] == live.node_id
    reset = 'macpool_upstream_errors_total{kind="reset",node="dying"}'
    assert metric(router.url, reset) == 1
