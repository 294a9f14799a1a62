"""Where requests go: least utilisation on a heterogeneous pool, and never over capacity with two replicas."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest
import redis

from macpool.contract import NodeDoc, now_ms
from macpool.store import Keys, ReserveRequest
from router.placement import BATCH_COST, STRATEGIES, Placement
from tests.blocking_store import BlockingStore
from tests.router.conftest import Pool, wait_until

pytestmark = pytest.mark.in_process  # none of these tests is about a process


def _long_stream(model: str) -> dict[str, object]:
    return {
        "model": model,
        "stream": True,
        "max_tokens": 4000,
        "messages": [{"role": "user", "content": "tell me a long story"}],
    }


def test_least_utilisation_fills_in_proportion_to_capacity(pool: Pool) -> None:
    pool.node("big", cap=4, speed=1)
    pool.node("small", cap=2, speed=1)
    router = pool.router("--queue-size", "0")
    pool.wait_ready(router, nodes=2)
    model = pool.model(router)
    placed: list[str] = []
    with httpx.Client(base_url=router.url, timeout=30) as client, contextlib.ExitStack() as streams:
        for _ in range(6):
            request = client.build_request("POST", "/v1/chat/completions", json=_long_stream(model))
            response = streams.enter_context(contextlib.closing(client.send(request, stream=True)))
            assert response.status_code == 200
            placed.append(response.headers["x-macpool-node"])
        # after 3 requests the 4-slot node holds 2 and the 2-slot node 1, whatever the tie-break said
        assert Counter(placed[:3]) == {"big": 2, "small": 1}
        assert Counter(placed) == {"big": 4, "small": 2}
        full = client.post("/v1/chat/completions", json=_long_stream(model))
        assert full.status_code == 503
        assert full.json()["error"]["code"] == "pool_full"
        assert full.headers["x-macpool-reason"] == "pool_full"
        assert 1 <= int(full.headers["retry-after"]) <= 30
    # every stream closed: every slot comes back
    wait_until(lambda: httpx.get(router.url + "/api/pool").json()["pool"]["busy"] == 0, timeout=10)


def test_retry_after_follows_how_long_slots_are_held(pool: Pool) -> None:
    """After a quiet spell the 30 s window of releases holds one or two: Retry-After still says about how
    soon a slot frees (busy slots / the time recent requests held theirs), not the window's 30 s."""
    pool.node("a", cap=2, speed=1)
    router = pool.router("--queue-size", "0")
    pool.wait_ready(router, nodes=1)
    model = pool.model(router)
    with httpx.Client(base_url=router.url, timeout=30) as client, contextlib.ExitStack() as streams:
        short = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        assert client.post("/v1/chat/completions", json=short).status_code == 200  # held ~0.1 s
        time.sleep(4)  # quiet: one release in the window, seconds ago
        for _ in range(2):
            request = client.build_request("POST", "/v1/chat/completions", json=_long_stream(model))
            response = streams.enter_context(contextlib.closing(client.send(request, stream=True)))
            assert response.status_code == 200
        full = client.post("/v1/chat/completions", json=_long_stream(model))
        assert full.status_code == 503 and full.headers["x-macpool-reason"] == "pool_full"
        # two busy slots, held ~0.1 s each lately: a slot is likely free within the second (it said 5 here,
        # one release over the 5 s the router had been up)
        assert int(full.headers["retry-after"]) <= 2


def test_two_replicas_never_exceed_node_capacity(pool: Pool, redis_url: str) -> None:
    nodes = [pool.node(name, cap=4, parallel=8, speed=1) for name in ("a", "b")]
    routers = [pool.router("--queue-size", "8", "--queue-timeout", "2") for _ in range(2)]
    for router in routers:
        pool.wait_ready(router, nodes=2)
    model = pool.model(routers[0])
    for node in nodes:
        httpx.post(node.sim.url + "/sim/reset", timeout=5)

    async def one(client: httpx.AsyncClient, url: str) -> tuple[int, str | None]:
        body = {
            "model": model,
            "stream": True,
            "max_tokens": 16,
            "messages": [{"role": "user", "content": "hello"}],
        }
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
            async for _ in response.aiter_raw():
                pass
            return response.status_code, response.headers.get("retry-after")

    async def burst() -> list[tuple[int, str | None]]:
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            return await asyncio.gather(*(one(client, routers[i % 2].url) for i in range(40)))

    results = asyncio.run(burst())
    statuses = Counter(status for status, _ in results)
    assert set(statuses) <= {200, 503}, statuses
    assert statuses[200] >= 8
    assert all(retry_after is not None for status, retry_after in results if status == 503)
    for node in nodes:
        assert node.stats()["max_concurrent"] <= 4
    keys = Keys()
    store = redis.Redis.from_url(redis_url)
    wait_until(lambda: all(store.zcount(keys.reservations(n.node_id), now_ms(), "+inf") == 0 for n in nodes))
    assert store.zcard(keys.queue) == 0
    store.close()


def test_a_mixed_pool_sends_requests_to_the_fast_mac_while_it_answers_sooner(pool: Pool) -> None:
    # an M5 Max and an M4 Max (a 32B model: ~4x slower per slot), one model name, 4 slots each
    pool.node("fast", cap=4, parallel=4, speed=10, alias="m")
    pool.node("slow", cap=4, parallel=4, speed=10, preset="m4max-64g-32b-q4", alias="m")
    fastest = pool.router()
    least = pool.router("--placement", "least-utilised")
    pool.wait_ready(fastest, nodes=2)
    # warm-up: unmeasured, least utilisation puts the second answer on the other Mac (the first still runs)
    warm = {"model": "m", "stream": True, "max_tokens": 200, "messages": [{"role": "user", "content": "hi"}]}
    with httpx.Client(base_url=fastest.url, timeout=60) as client, contextlib.ExitStack() as streams:
        answers = []
        for _ in range(2):
            request = client.build_request("POST", "/v1/chat/completions", json=warm)
            answers.append(streams.enter_context(contextlib.closing(client.send(request, stream=True))))
        assert sorted(answer.headers["x-macpool-node"] for answer in answers) == ["fast", "slow"]
        for answer in answers:
            answer.read()

    def measured() -> bool:
        nodes = httpx.get(fastest.url + "/api/pool").json()["nodes"]
        return all(node["slot_tokens_per_s"] for node in nodes)

    wait_until(measured, timeout=20, what="both Macs measured")
    with httpx.Client(timeout=30) as client, contextlib.ExitStack() as streams:
        placed = []
        for url in (fastest.url, fastest.url, fastest.url, least.url):
            request = client.build_request("POST", url + "/v1/chat/completions", json=_long_stream("m"))
            response = streams.enter_context(contextlib.closing(client.send(request, stream=True)))
            assert response.status_code == 200
            placed.append(response.headers["x-macpool-node"])
    # the fast Mac, busier, is still the sooner answer; by utilisation alone the 4th would go to the idle one
    assert placed == ["fast", "fast", "fast", "slow"]


# --- the choice itself, in the admission script (in-process, real Redis) ------------------------------------

def _doc(node_id: str, cap: int, speed: float | None = None, running: float | None = None,
         ttft_ms: float | None = None, depth: float | None = None) -> NodeDoc:
    return NodeDoc(node_id=node_id, url="http://unused", models=["m"], capacity=cap, state="ready",
                   slot_tokens_per_s=speed, slot_concurrency=running, ttft_p50_ms=ttft_ms,
                   prefill_depth=depth)


class Script:
    """Nodes as the heartbeat writes them, reservations through the store's API."""

    def __init__(self, url: str) -> None:
        self.api = BlockingStore(url, Keys())
        self.r = redis.Redis.from_url(url, decode_responses=True)
        self.docs: dict[str, NodeDoc] = {}

    def node(self, doc: NodeDoc, busy: int = 0) -> None:
        self.docs[doc.node_id] = doc
        fields = {"capacity": doc.capacity, "state": "ready", "models": "m", "slots": doc.capacity}
        self.r.hset(Keys().node(doc.node_id), mapping=fields)
        for i in range(busy):
            assert self.ask(f"busy-{doc.node_id}-{i}", "least-utilised", only=doc.node_id) == doc.node_id

    def ask(self, rid: str, placement: Placement, prefixes: tuple[str, ...] = (), only: str = "") -> str:
        docs = [d for d in self.docs.values() if not only or d.node_id == only]
        request = ReserveRequest(rid, [STRATEGIES[placement](d, 256) for d in docs], 60_000, model="m",
                                 prefixes=prefixes, batch_cost=BATCH_COST)
        answer = self.api.run(self.api.store.reserve(request, now_ms()))
        assert answer.status == "reserved"
        return answer.node_id

    def close(self) -> None:
        self.r.close()
        self.api.close()


@pytest.fixture
def script(redis_url: str) -> Iterator[Script]:
    script = Script(redis_url)
    yield script
    script.close()


def test_the_fast_busier_mac_answers_sooner_and_gets_the_request(script: Script) -> None:
    # the M5 Max and M2 Pro presets: 45 tok/s per slot with 8 running vs 35 alone; prefill 3000 vs 650 tok/s
    script.node(_doc("fast", 8, speed=45.0, running=8, ttft_ms=150), busy=6)
    script.node(_doc("slow", 4, speed=35.5, running=1, ttft_ms=700))
    assert script.ask("r1", "fastest") == "fast"  # 75 % used, still the quicker answer
    assert script.ask("r2", "least-utilised") == "slow"  # the same pool weighed by utilisation alone


def test_a_fast_mac_yields_once_its_batch_makes_it_the_slower_answer(script: Script) -> None:
    # twice as fast alone, but every request in its batch slows its slots: with 7 running it is the slower
    script.node(_doc("fast", 16, speed=90.0, running=1), busy=7)
    script.node(_doc("slow", 16, speed=45.0, running=1))
    assert script.ask("r1", "fastest") == "slow"


@pytest.mark.parametrize(("depth", "chosen"), [(300, "busy"), (30_000, "idle")])
def test_a_mac_decoding_deep_contexts_yields_sooner(script: Script, depth: int, chosen: str) -> None:
    # the same measured speeds: on chat prompts (300 tokens deep) the busier Mac, faster a slot, still answers
    # sooner with a fourth request; where every sequence holds a coding agent's 30K tokens, each one in the
    # batch reads its KV cache at every step, and a fourth slows the busy Mac's slots past the idle one's
    script.node(_doc("busy", 8, speed=30.0, running=3, depth=depth), busy=3)
    script.node(_doc("idle", 8, speed=25.0, running=1, depth=depth))
    assert script.ask("r1", "fastest") == chosen


def test_a_batch_costs_more_the_deeper_its_sequences() -> None:
    from router.placement import DECODE_DEPTH_SCALE, batch_cost

    assert batch_cost(None) == batch_cost(0) == BATCH_COST
    assert batch_cost(DECODE_DEPTH_SCALE) == pytest.approx(BATCH_COST + 1)
    assert STRATEGIES["fastest"](_doc("n", 4, speed=30.0, running=2, depth=22_000), 100).batch_cost == (
        pytest.approx(BATCH_COST + 22_000 / DECODE_DEPTH_SCALE))
    assert STRATEGIES["least-utilised"](_doc("n", 4, speed=30.0, running=2), 100).batch_cost == 0


def test_a_mac_whose_prompts_are_slow_yields_to_an_idle_slower_one(script: Script) -> None:
    # the M2 Pro and M4 Max presets with 1,024-token prompts: 1.6 s against 3.6 s to a first token, 35
    # against 21 tok/s per slot alone. Every request running on the M2 Pro holds its streams for a prompt
    # while a new one runs there, so past a few the idle M4 Max is the sooner answer (their measured curves
    # agree: docs/benchmarks.md, placement)
    script.node(_doc("m2pro", 8, speed=35.0, running=1, ttft_ms=1600), busy=2)
    script.node(_doc("m4max", 6, speed=21.0, running=1, ttft_ms=3600))
    assert script.ask("r1", "fastest") == "m2pro"  # its third request
    assert script.ask("r2", "fastest") == "m4max"  # a fourth would wait on three prompts besides its own


def test_identical_macs_fill_evenly(script: Script) -> None:
    for name in ("a", "b"):
        script.node(_doc(name, 4, speed=50.0, running=2, ttft_ms=100))
    placed = Counter(script.ask(f"r{i}", "fastest") for i in range(6))
    assert placed == {"a": 3, "b": 3}


def test_without_measurements_the_least_utilised_mac_gets_the_request(script: Script) -> None:
    script.node(_doc("fast", 8, speed=45.0, running=8, ttft_ms=150), busy=4)
    script.node(_doc("new", 4))  # no answer measured yet (a new Mac, a restart)
    assert script.ask("r1", "fastest") == "new"  # 0 % used against 50 %
    assert script.ask("r2", "fastest") == "new"  # 25 %


def test_a_prompt_prefix_still_goes_where_it_is_cached(script: Script) -> None:
    script.node(_doc("fast", 8, speed=45.0, running=8, ttft_ms=150))
    script.node(_doc("slow", 4, speed=35.5, running=1, ttft_ms=700))
    assert script.ask("r1", "fastest", prefixes=("p1",), only="slow") == "slow"
    assert script.ask("r2", "fastest", prefixes=("p1",)) == "slow"  # affinity: its prefix is cached there
    assert script.ask("r3", "fastest", prefixes=("p2",)) == "fast"


def test_a_prompts_time_counts_how_deep_its_tokens_sit() -> None:
    from router.placement import PREFILL_HALVING_DEPTH as H
    from router.placement import prompt_seconds

    # two Macs that process 400 prompt tokens a second, one measured on a coding agent's turns 30K tokens
    # into their history, one on short prompts (its tokens 300 in): at the start the first is 6x faster
    deep, shallow = prompt_seconds(26_000, 400.0, 30_000), prompt_seconds(26_000, 400.0, 300)
    assert deep == pytest.approx(shallow * (1 + 300 / H) / (1 + 30_000 / H))
    # a new session's 26K-token prompt: slower a token than the short prompts, faster than the deep turns
    assert shallow > 26_000 / 400 > deep
    # the same tokens after 20K a cache holds cost more than from the start
    assert prompt_seconds(2_000, 400.0, 0, start=20_000) > 2.5 * prompt_seconds(2_000, 400.0, 0)
