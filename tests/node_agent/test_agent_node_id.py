"""Two agents under one node id: the one started last holds the id. A restart's new agent is not overwritten
by the old one draining (its ``draining`` beats, its deregistration); two Macs given one id (the default id is
the host name) settle on one, and the other says so, instead of the record taking turns between them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from redis.asyncio import Redis

from macpool.contract import NodeDoc, now_ms
from macpool.store import Keys, Store
from tests.conftest import Server, metric
from tests.node_agent.helpers import AgentFactory, read_node, status, wait_until
from tests.node_agent.test_agent_heartbeat import logged

SimFactory = Callable[..., Server]


def doc(instance: str, started: int, state: str = "ready", url: str = "") -> NodeDoc:
    return NodeDoc.model_validate({
        "node_id": "n1", "url": url or f"http://{instance}", "capacity": 2, "state": state,
        "instance": instance, "started_at_ms": started, "updated_at_ms": now_ms(),
    })


def test_the_agent_started_last_holds_the_id_in_the_contract(redis_url: str) -> None:
    async def scenario() -> None:
        redis = Redis.from_url(redis_url)
        keys = Keys()
        store = Store(redis, keys)
        pubsub = redis.pubsub()
        await pubsub.subscribe(keys.events)
        assert (await pubsub.get_message(timeout=5))["type"] == "subscribe"  # type: ignore[index]
        try:
            old, new = doc("old", 1_000), doc("new", 2_000)
            assert await store.heartbeat(old, 5_000) is None
            assert await store.heartbeat(new, 5_000) is None  # a later start takes the id over
            # the old one, draining: refused, told who holds the id; the record is the new one's
            assert await store.heartbeat(doc("old", 1_000, "draining"), 5_000) == "http://new"
            raw = await redis.hget(keys.node("n1"), "doc")
            assert raw is not None and NodeDoc.decode(raw).instance == "new"
            assert NodeDoc.decode(raw).state == "ready"
            # nor can it deregister the new one
            assert await store.deregister("n1", "old") is False
            assert await redis.exists(keys.node("n1")) == 1
            assert await redis.zscore(keys.nodes, "n1") is not None
            # the holder can; then the id is free for the old one again
            assert await store.deregister("n1", "new") is True
            assert await redis.exists(keys.node("n1")) == 0
            assert await store.heartbeat(doc("old", 1_000), 5_000) is None
            # a tie on the start time is settled by the instance, the same way by both
            assert await store.heartbeat(doc("zzz", 1_000), 5_000) is None
            assert await store.heartbeat(doc("old", 1_000), 5_000) == "http://zzz"
            messages = []
            while (message := await pubsub.get_message(timeout=0.2)) is not None:
                kind, body = message["data"].decode().split(" ", 1)
                messages.append(f"{kind} {NodeDoc.decode(body).instance if kind == 'node' else body}")
            # a refused beat or deregistration announces nothing
            assert messages == ["node old", "node new", "gone n1", "node old", "node zzz"]
        finally:
            await pubsub.aclose()
            await redis.delete(keys.node("n1"), keys.nodes)
            await redis.aclose()

    asyncio.run(scenario())


def test_two_agents_given_one_id_settle_on_the_later_and_the_other_says_so(
    sim: SimFactory, agent: AgentFactory, redis_url: str
) -> None:
    upstream = sim("--parallel", "2", "--speed", "20")
    first = agent("--upstream", upstream.url)
    wait_until(lambda: (d := read_node(redis_url, "n1")) is not None and d.url == first.url, what="first")
    wait_until(lambda: "superseded_by" in status(first.url), what="superseded_by in /status from the start")
    assert status(first.url)["superseded_by"] is None
    assert metric(first.url, "macpool_agent_superseded") == 0
    time.sleep(0.05)  # a later start time, whatever the clock's resolution
    second = agent("--upstream", upstream.url)
    wait_until(lambda: (d := read_node(redis_url, "n1")) is not None and d.url == second.url, what="second")
    wait_until(lambda: status(first.url).get("superseded_by") == second.url, what="first told")
    # its own state is still "ready" (it serves what reaches it): the gauge is what says it is out of the pool
    assert metric(first.url, "macpool_agent_superseded") == 1
    seen = set()
    for _ in range(10):  # three beats of each: the record no longer takes turns
        node = read_node(redis_url, "n1")
        assert node is not None
        seen.add(node.url)
        time.sleep(0.1)
    assert seen == {second.url}
    assert [level for level, _ in logged(first, "is held by an agent started later")] == ["ERROR"]
    assert logged(second, "held by") == []
    # the later one stops and takes its record out; the first one's next beat brings it back
    assert second.child.stop(timeout=15) == 0
    wait_until(lambda: (d := read_node(redis_url, "n1")) is not None and d.url == first.url, what="back")
    wait_until(lambda: status(first.url).get("superseded_by") is None, what="first in again")
    assert metric(first.url, "macpool_agent_superseded") == 0
    assert len(logged(first, "is this agent's again")) == 1
