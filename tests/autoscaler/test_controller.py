"""The autoscaler against a real Redis, with heartbeats written as agents write them and the time passed
to each tick: up on load, down after it, scale from zero, Wake-on-LAN, exactly one leader."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

from redis.asyncio import Redis
from redis.asyncio.client import PubSub

from macpool.autoscale.controller import Controller, ControllerConfig
from macpool.contract import NodeDoc, NodeState, now_ms
from macpool.scaling import ScalePolicy
from macpool.store import Candidate, Keys, Release, ReserveRequest, Store
from macpool.store.elastic import ElasticStore

LEASE = 60_000
POLICY = ScalePolicy(up_delay=10, down_delay=30, min_nodes=1, max_nodes=4)


def node(node_id: str, state: NodeState, capacity: int = 2, **extra: object) -> NodeDoc:
    return NodeDoc(node_id=node_id, url=f"http://{node_id}", models=["m"], state=state, elastic=True,
                   capacity=capacity if state == "ready" else 0, standby_capacity=capacity,
                   updated_at_ms=now_ms(), **extra)  # type: ignore[arg-type]


def scenario(redis_url: str, body: Callable[[Store, ElasticStore, Redis], Awaitable[None]]) -> None:
    async def run() -> None:
        redis = Redis.from_url(redis_url)
        try:
            await body(Store(redis), ElasticStore(redis), redis)
        finally:
            await redis.aclose()

    asyncio.run(run())


def controller(redis: Redis, name: str = "c1", **config: object) -> Controller:
    settings = ControllerConfig(policy=POLICY, cooldown_s=5, controller_id=name, **config)  # type: ignore[arg-type]
    return Controller(redis, Keys(), settings)


async def load(store: Store, running: int, waiting: int, on: str = "n1") -> None:
    """``running`` requests on ``on`` and ``waiting`` more in the queue."""
    for i in range(running + waiting):
        ask = ReserveRequest(f"r{i}", [Candidate(on)], LEASE, queue_size=16, enqueue=True, model="m")
        await store.reserve(ask)


async def unload(store: Store, running: int, waiting: int, on: str = "n1") -> None:
    for i in range(running + waiting):
        if i < running:
            await store.release(Release(f"r{i}", on))
        else:
            await store.leave_queue(f"r{i}")


async def decisions(pubsub: PubSub) -> AsyncIterator[dict[str, object]]:
    while (message := await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.5)) is not None:
        kind, _, rest = message["data"].decode().partition(" ")
        if kind == "autoscale":
            yield json.loads(rest)


def test_up_on_load_then_down_after_it(redis_url: str) -> None:
    async def body(store: Store, elastic: ElasticStore, redis: Redis) -> None:
        await store.heartbeat(node("n1", "ready"), LEASE)
        await store.heartbeat(node("n2", "standby"), LEASE)
        pubsub = redis.pubsub()
        await pubsub.subscribe(Keys().events)
        assert (await pubsub.get_message(timeout=5))["type"] == "subscribe"  # type: ignore[index]
        scaler = controller(redis)
        assert await scaler.tick(0) == []
        await load(store, running=2, waiting=2)  # demand 4 on 2 ready slots
        assert await scaler.tick(1) == []  # not for a blip: it must last --up-delay
        assert await scaler.tick(10) == []
        [up] = await scaler.tick(11)
        assert (up.kind, up.node_id) == ("activate", "n2")
        assert await elastic.desired("n2") == "active"
        await store.heartbeat(node("n2", "loading"), LEASE)
        assert await scaler.tick(12) == []  # n2's capacity is on its way: nothing more is activated
        await store.heartbeat(node("n2", "ready"), LEASE)

        await unload(store, running=2, waiting=2)
        assert await scaler.tick(13) == []  # the cool-down
        assert await scaler.tick(20) == []  # low since 20: --down-delay runs from there
        assert await scaler.tick(49) == []
        [down] = await scaler.tick(50)
        assert (down.kind, down.node_id) == ("standby", "n1")
        assert await elastic.desired("n1") == "standby"
        await store.heartbeat(node("n1", "standby"), LEASE)
        assert await scaler.tick(200) == []  # --min-nodes 1 keeps n2

        published = [(d["action"], d["node"]) async for d in decisions(pubsub)]
        assert published == [("leader", ""), ("activate", "n2"), ("standby", "n1")]
        await pubsub.aclose()

    scenario(redis_url, body)


def test_a_pool_all_in_standby_scales_from_zero_at_once(redis_url: str) -> None:
    async def body(store: Store, elastic: ElasticStore, redis: Redis) -> None:
        await store.heartbeat(node("n1", "standby", capacity=4), LEASE)
        await store.heartbeat(node("n2", "standby", capacity=2), LEASE)
        scaler = Controller(redis, Keys(), ControllerConfig(policy=ScalePolicy(up_delay=10),
                                                            controller_id="c1"))
        assert await scaler.tick(0) == []  # no demand, no node: nothing to pay for
        await load(store, running=0, waiting=1)
        [up] = await scaler.tick(1)  # no --up-delay with nothing serving: the request waits meanwhile
        assert (up.kind, up.node_id) == ("activate", "n1")  # the bigger one

    scenario(redis_url, body)


def test_a_known_mac_whose_heartbeat_is_gone_is_woken(redis_url: str) -> None:
    listener = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    listener.bind(("127.0.0.1", 0))
    listener.settimeout(5)

    async def body(store: Store, elastic: ElasticStore, redis: Redis) -> None:
        await store.heartbeat(node("n1", "ready"), LEASE)
        mac = {"wol_mac": "a0:ce:c8:01:02:0f", "wol_broadcast": "127.0.0.1"}
        await store.heartbeat(node("n3", "standby", **mac), LEASE)
        scaler = controller(redis, wol_port=listener.getsockname()[1])
        assert await scaler.tick(0) == []  # seen once: its MAC is kept
        await store.deregister("n3")  # the Mac went to sleep
        assert await scaler.tick(0.5) == []
        shown = (await store.read_pool()).nodes["n3"]  # routers see it: a request for its model waits
        assert (shown.state, shown.models, shown.capacity, shown.elastic) == ("asleep", ["m"], 0, True)
        await load(store, running=2, waiting=2)
        assert await scaler.tick(1) == []
        [wake] = await scaler.tick(11)
        assert (wake.kind, wake.node_id) == ("wake", "n3")
        assert await elastic.desired("n3") == "active"  # its agent loads the model as soon as it is back
        shown = (await store.read_pool()).nodes["n3"]  # on the dashboard meanwhile
        assert (shown.state, shown.models, shown.capacity) == ("waking", ["m"], 0)
        assert await scaler.tick(12) == []  # woken once: its capacity counts as coming until it is back
        back = node("n3", "standby", **mac).model_copy(update={"instance": "a", "started_at_ms": now_ms()})
        assert await store.heartbeat(back, LEASE) is None  # the agent's record wins over the placeholder
        assert await scaler.tick(13) == []
        assert (await store.read_pool()).nodes["n3"].instance == "a"

    try:
        scenario(redis_url, body)
        packet, _ = listener.recvfrom(1024)
    finally:
        listener.close()
    assert packet == b"\xff" * 6 + bytes.fromhex("a0cec801020f") * 16


def test_exactly_one_of_two_controllers_acts(redis_url: str) -> None:
    async def body(store: Store, elastic: ElasticStore, redis: Redis) -> None:
        await store.heartbeat(node("n1", "ready"), LEASE)
        for i in (2, 3, 4):
            await store.heartbeat(node(f"n{i}", "standby"), LEASE)
        other = Redis.from_url(redis_url)
        try:
            first, second = controller(redis, "c1"), controller(other, "c2")
            await load(store, running=2, waiting=2)
            acted: dict[str, list[str]] = {"c1": [], "c2": []}
            for t in (0, 11, 12, 30, 31):
                for scaler in (first, second):
                    acted[scaler.id] += [a.node_id for a in await scaler.tick(t)]
            assert (first.leading, second.leading) == (True, False)
            assert acted == {"c1": ["n2", "n3"], "c2": []}  # demand 4 at 80%: 3 more slots, two nodes
            assert await elastic.leader() == "c1"

            await first.resign()  # a clean stop: the other takes over at its next tick
            await second.tick(40)
            assert second.leading and await elastic.leader() == "c2"
            await first.tick(41)
            assert not first.leading
        finally:
            await other.aclose()

    scenario(redis_url, body)
