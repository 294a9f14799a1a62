"""A slot's life: freed when the client leaves, renewed while a stream lives, never leaked by a crash."""

from __future__ import annotations

import time

import httpx
import pytest
import redis

from macpool.contract import now_ms
from macpool.store import Keys
from tests import stand_in
from tests.conftest import metric
from tests.inprocess import LocalStack
from tests.router import lingering_upstream
from tests.router.conftest import AGENT_TOKEN, Pool, wait_until

LEASE_S = 2.0


def test_disconnect_renewal_and_crash(pool: Pool, redis_url: str) -> None:
    node = pool.node("n1", cap=1, speed=1)
    router = pool.router("--queue-size", "0", "--lease-seconds", str(LEASE_S))
    pool.wait_ready(router, nodes=1)
    model = pool.model(router)
    store = redis.Redis.from_url(redis_url)
    slots = Keys().reservations(node.node_id)

    def live() -> int:
        return int(store.zcount(slots, now_ms(), "+inf"))

    body = {
        "model": model,
        "stream": True,
        "max_tokens": 4000,
        "messages": [{"role": "user", "content": "hi"}],
    }
    with httpx.Client(base_url=router.url, timeout=30) as client:
        def idle() -> bool:  # the reservation, the agent's cap and the Mac's slot all given back
            return live() == 0 and node.status()["in_flight"] == 0 and node.stats()["processing"] == 0

        # a client that goes away frees the slot: in the router's reservations, the agent and the Mac
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            chunks = response.iter_raw()  # keep a reference: a collected iterator closes the connection
            next(chunks)
            assert live() == 1
        wait_until(idle, timeout=10, interval=0.02)

        # the same for a non-streamed request, and both are counted as the node's
        with pytest.raises(httpx.ReadTimeout):
            client.post("/v1/chat/completions", json={**body, "stream": False},
                        timeout=httpx.Timeout(30, read=0.5))
        wait_until(idle, timeout=10, interval=0.02)
        closed = f'macpool_requests_total{{model="{model}",node="n1",status="client_closed"}}'
        wait_until(lambda: metric(router.url, closed) == 2, timeout=5)

        # a live stream keeps its lease past the lease time (the renewal loop)
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            chunks = response.iter_raw()
            next(chunks)
            started = time.monotonic()
            while time.monotonic() - started < LEASE_S * 2:
                next(chunks)
            assert live() == 1

            # kill -9 the router mid-stream: the reservation lapses with its lease, nothing leaks
            router.child.kill()
            expiry = max(score for _, score in store.zrange(slots, 0, -1, withscores=True))
            assert expiry <= now_ms() + LEASE_S * 1000  # leased, never held for good
            wait_until(lambda: live() == 0, timeout=LEASE_S + 10)
    store.close()


@pytest.mark.in_process
def test_a_client_leaving_after_done_was_served(pool: Pool, local_stack: LocalStack) -> None:
    """The OpenAI SDK closes the connection once it reads `data: [DONE]`, often before the end of the body
    reaches the router: that stream was served whole - counted with its status, not as `client_closed`."""
    upstream = local_stack.serve("lingering", stand_in.app("lingering", lingering_upstream.ROUTES))
    local_stack.agent("agent-n1", upstream.url, pool.redis_url, "n1", "--token", AGENT_TOKEN)
    router = pool.router()
    pool.wait_ready(router, nodes=1)
    body = {"model": "lingering", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    with httpx.Client(base_url=router.url, timeout=30) as client:
        for _ in range(2):
            with client.stream("POST", "/v1/chat/completions", json=body) as response:
                assert response.status_code == 200
                lines = response.iter_lines()
                assert "data: [DONE]" in lines  # read up to it, then leave as the SDK does
    served = 'macpool_requests_total{model="lingering",node="n1",status="200"}'
    wait_until(lambda: metric(router.url, served) == 2, timeout=5)
    closed = 'macpool_requests_total{model="lingering",node="n1",status="client_closed"}'
    assert metric(router.url, closed) == 0


def test_a_nodes_backlog_is_the_prompts_it_has_not_answered_yet_less_the_time_it_has_had() -> None:
    from typing import Any, cast

    from macpool.contract import NodeDoc
    from router.leases import Lease, Leases
    from router.placement import PREFILL_HALVING_DEPTH as H
    from router.settings import Settings

    # only the leases held are read: no store, pool or Retry-After is reached
    unused = cast(Any, None)
    leases = Leases(Settings(redis_url="redis://127.0.0.1:9"), unused, unused, unused)
    # measured at 1,000 prompt tokens a second, on tokens at the start of their prompts
    a, b, unmeasured = (NodeDoc(node_id=n, url="http://127.0.0.1:9", capacity=4, state="ready", models=["m"],
                                prefill_tokens_per_s=1000.0, prefill_depth=0) for n in "ab?")
    unmeasured.node_id, unmeasured.prefill_tokens_per_s = "a", None
    assert leases.backlog_s(a) == 0.0
    now = time.monotonic()
    leases.hold(Lease("r1", a, prefill_tokens=2_000, acquired_at=now - 4.0))  # sent 4 s ago
    leases.hold(Lease("r2", a, prefill_tokens=1_000, prefill_from=20_000, acquired_at=now))  # a later turn
    leases.hold(Lease("r3", b, prefill_tokens=50_000, acquired_at=now))
    leases.hold(Lease("r4", a, prefill_tokens=0, acquired_at=now - 100.0))  # answers already
    # each token costs 1 + its depth / H a token at the start: 2,000 from the start, 1,000 after 20,000
    expected = 2 * (1 + 1_000 / H) + 1 * (1 + 20_500 / H) - 4.0
    assert expected - 0.5 < leases.backlog_s(a) <= expected
    assert leases.backlog_s(unmeasured) == 0.0  # prompt speed not known: nothing counted
    leases.active.clear()
    assert leases.backlog_s(b) == 0.0
