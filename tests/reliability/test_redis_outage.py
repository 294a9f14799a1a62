"""Redis killed for about 10 s, then restarted empty: the pool keeps serving and heals by itself."""

from __future__ import annotations

import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from macpool.dev.redis_server import RedisServer
from macpool.dev.stack import Stack
from tests.reliability.conftest import Rig, assert_clean, chat, wait_until

pytestmark = pytest.mark.slow

CAP = 2
OUTAGE_S = 10.0


def test_redis_outage_and_recovery(stack: Stack, own_redis: RedisServer) -> None:
    rig = Rig(stack, own_redis.url)
    nodes = [rig.node(f"n{i}", cap=CAP, speed=20) for i in (1, 2)]
    router = rig.router("--queue-size", "2", "--queue-timeout", "0.5")
    rig.wait_ready(router, nodes=2)
    model = rig.model(router)
    for node in nodes:
        httpx.post(node.sim.url + "/sim/reset", timeout=5)

    def burst(client: httpx.Client, n: int) -> Counter[int]:
        def one(_: int) -> int:
            reply = client.post("/v1/chat/completions", json=chat(model, 24, False))
            if reply.status_code != 200:
                assert_clean(reply.text, *(node.agent.url for node in nodes))
            return reply.status_code

        with ThreadPoolExecutor(n) as pool:
            return Counter(pool.map(one, range(n)))

    with httpx.Client(base_url=router.url, timeout=60) as client:
        assert burst(client, 2)[200] == 2
        own_redis.kill()
        down_at = time.monotonic()
        ready = wait_until(
            lambda: (r := client.get("/ready")).status_code == 503 and r.json(), 10, "/ready 503"
        )
        assert ready["redis_ok"] is False
        # the routers serve from their last view; 3x the pool's capacity at once: served or 503, never worse
        seen: Counter[int] = Counter()
        while time.monotonic() - down_at < OUTAGE_S:
            seen += burst(client, 3 * CAP * 2)
        assert set(seen) <= {200, 503}, seen
        assert seen[200] > 0, seen
        for node in nodes:
            assert node.stats()["max_concurrent"] <= CAP  # the agents' caps held
            assert node.agent.child.alive()
        assert router.child.alive()
        print(f"during a {OUTAGE_S:.0f}s Redis outage: {dict(seen)}")

        # back, empty: agents re-register, the router sees them, /ready is 200 again
        restarted = RedisServer(port=own_redis.port).start()
        try:
            back_at = time.monotonic()
            with rig.store() as store:
                registered = lambda: all(store.exists(rig.keys.node(n.node_id)) for n in nodes)  # noqa: E731
                wait_until(registered, 30, "the agents re-registered")
            print(f"agents re-registered {time.monotonic() - back_at:.2f}s after Redis came back")
            wait_until(lambda: client.get("/ready").status_code == 200, 30, "/ready 200")
            rig.wait_ready(router, nodes=2, timeout=30)
            assert burst(client, 2 * CAP)[200] >= 1
            wait_until(lambda: all(rig.reservations(n.node_id) == 0 for n in nodes), 10, "reservations at 0")
            wait_until(lambda: all(n.status()["in_flight"] == 0 for n in nodes), 10, "agents idle")
            # the router's view converges within a refresh (1 s): its events subscription may still be
            # reconnecting to the restarted Redis when the last slots are freed
            wait_until(lambda: rig.pool_doc(router)["pool"]["busy"] == 0, 5, "the router sees the pool idle")
            # the outage is one warning when it began and one line when it ended, not one per retry
            assert router.child.log_path is not None
            lines = router.child.log_path.read_text().splitlines()
            assert len([line for line in lines if "unreachable (" in line]) == 1, lines[-20:]
            assert len([line for line in lines if "answers again" in line]) == 1, lines[-20:]
        finally:
            restarted.close()


def test_a_running_stream_is_counted_again_after_redis_restarts_empty(
    stack: Stack, own_redis: RedisServer
) -> None:
    rig = Rig(stack, own_redis.url)
    node = rig.node("n1", cap=CAP, speed=1)
    router = rig.router("--lease-seconds", "1.5")  # renewed every 0.5 s
    rig.wait_ready(router, nodes=1)
    body = chat(rig.model(router), 3000)
    with (
        httpx.Client(base_url=router.url, timeout=60) as client,
        client.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        assert response.status_code == 200
        chunks = response.iter_raw()  # kept: a dropped iterator closes the stream
        next(chunks)
        assert rig.reservations(node.node_id) == 1
        own_redis.close()
        restarted = RedisServer(port=own_redis.port).start()  # empty, on the same port
        try:
            # the stream still runs on the node: its lease is written again at the next renewal (it used
            # to stay gone until the stream ended, and the pool read idle meanwhile)
            wait_until(lambda: rig.reservations(node.node_id) == 1, 10, "the stream counted again")
            wait_until(lambda: client.get("/api/pool").json()["pool"]["busy"] == 1, 10, "busy 1 again")
            response.close()
            # ended: released, not left behind by the renewal
            wait_until(lambda: rig.reservations(node.node_id) == 0, 10, "the lease released at the end")
        finally:
            restarted.close()
