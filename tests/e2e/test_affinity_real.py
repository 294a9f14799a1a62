"""Prefix-cache affinity on real llama-servers: a conversation stays on the node that holds its history.

Two agents, each supervising a real llama-server (tiny model, two slots), and two routers on the same pool:
one with affinity (the default), one started with ``--no-affinity`` as the control. Before every follow-up
turn the test holds one slot of the conversation's node with a reservation written straight into Redis, so
load alone would send the turn to the other, idle node; the gap (one request) is below the affinity
thresholds, so the affinity router keeps the conversation where its prompt is cached. Whether it was cached
is read from that llama-server's own ``llamacpp:prompt_tokens_cached_total`` (the agent starts it with
``--metrics``).
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import httpx
import pytest
import redis

from macpool.contract import now_ms
from macpool.dev.stack import Stack
from macpool.store import Keys
from tests.e2e.conftest import real_setup, wait_until

pytestmark = [pytest.mark.llama_server, pytest.mark.slow]

NODES = ("mac-x", "mac-y")
PARALLEL = 2
CTX_PER_SLOT = 2048  # the tiny model's vocabulary is bytes: one token per character
TURNS = 4
CACHED = re.compile(r"^llamacpp:prompt_tokens_cached_total (\S+)$", re.MULTILINE)


@dataclass
class AffinityPool:
    redis_url: str
    agents: dict[str, str]  # node id -> agent URL
    routers: dict[str, str]  # "on" / "off" -> router URL

    def llama_url(self, node_id: str) -> str:
        url: str = httpx.get(self.agents[node_id] + "/status", timeout=5).json()["llama_server"]["url"]
        return url

    def cached(self, node_id: str) -> float:
        match = CACHED.search(httpx.get(self.llama_url(node_id) + "/metrics", timeout=5).text)
        assert match, f"{node_id}: no llamacpp:prompt_tokens_cached_total in llama-server's /metrics"
        return float(match.group(1))

    def reserved(self, router: str, node_id: str) -> int:
        nodes = httpx.get(self.routers[router] + "/api/pool", timeout=5).json()["nodes"]
        return int(next(n["reserved"] for n in nodes if n["node_id"] == node_id))

    @contextmanager
    def hold_slot(self, node_id: str) -> Iterator[None]:
        """One slot of ``node_id`` reserved (as by a request in flight) until the block ends."""
        keys, holder = Keys(), f"test-hold-{secrets.token_hex(4)}"
        client = redis.Redis.from_url(self.redis_url)
        try:
            client.zadd(keys.reservations(node_id), {holder: now_ms() + 60_000})
            for router in self.routers:
                seen = f"the {router} router sees the hold on {node_id}"
                wait_until(partial(self.reserved, router, node_id), 10, seen)
            yield
        finally:
            client.zrem(keys.reservations(node_id), holder)
            client.close()


@pytest.fixture(scope="module")
def affinity_pool(redis_server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AffinityPool]:
    setup = real_setup(redis_server, tmp_path_factory, "affinity")
    with Stack(logs=setup.logs, keep_logs=True, stop_timeout=15) as stack:
        pool = AffinityPool(redis_server, {}, {})
        for name, extra in (("on", ()), ("off", ("--no-affinity",))):
            pool.routers[name] = stack.router(f"router-{name}", redis_server, *extra, wait=False).url
        for node_id in NODES:
            pool.agents[node_id] = setup.agent(stack, redis_server, node_id, PARALLEL, CTX_PER_SLOT).url
        stack.wait_serving(timeout=60)
        for router in pool.routers.values():
            wait_until(partial(_all_ready, router), 90, f"both nodes ready in {router}")
        yield pool


def _all_ready(router: str) -> bool:
    nodes = httpx.get(router + "/api/pool", timeout=5).json()["nodes"]
    return {n["node_id"] for n in nodes if n["state"] == "ready"} == set(NODES)


@dataclass
class Reply:
    node: str
    content: str
    prompt_tokens: int


def _chat(router: str, messages: list[dict[str, str]]) -> Reply:
    body: dict[str, Any] = {"messages": messages, "max_tokens": 16, "ignore_eos": True}
    response = httpx.post(router + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    data = response.json()
    return Reply(
        node=response.headers["x-macpool-node"],
        content=data["choices"][0]["message"]["content"],
        prompt_tokens=int(data["usage"]["prompt_tokens"]),
    )


def _opening(tag: str) -> list[dict[str, str]]:
    document = f"[{tag}] " + "Notes on unified memory, batching and the slots of a llama-server. " * 9
    return [{"role": "system", "content": document}, {"role": "user", "content": f"[{tag}] First question?"}]


def test_a_conversation_stays_on_its_node_and_its_prompt_is_served_from_the_cache(
    affinity_pool: AffinityPool,
) -> None:
    pool = affinity_pool
    messages = _opening(secrets.token_hex(4))
    first = _chat(pool.routers["on"], messages)
    home, previous = first.node, first
    assert home in NODES
    seen = [pool.cached(home)]
    for turn in range(1, TURNS):
        messages += [
            {"role": "assistant", "content": previous.content},
            {"role": "user", "content": f"Follow-up question number {turn}, about the slots?"},
        ]
        with pool.hold_slot(home):  # the other node is now the least loaded one
            reply = _chat(pool.routers["on"], messages)
        assert reply.node == home, f"turn {turn} went to {reply.node}, its history is cached on {home}"
        seen.append(pool.cached(home))
        reused = seen[-1] - seen[-2]
        # the previous turn's whole prompt (and most of its reply) came from the slot's cache
        assert reused >= previous.prompt_tokens, (turn, reused, previous.prompt_tokens, seen)
        previous = reply
    assert seen == sorted(set(seen)), f"cached prompt tokens did not rise turn after turn: {seen}"


def test_without_affinity_the_same_turn_goes_to_the_least_loaded_node(affinity_pool: AffinityPool) -> None:
    """The control: the setup above really does pull a follow-up away from its node when only load counts."""
    pool = affinity_pool
    messages = _opening(secrets.token_hex(4))
    first = _chat(pool.routers["off"], messages)
    other = next(node for node in NODES if node != first.node)
    messages += [{"role": "assistant", "content": first.content}, {"role": "user", "content": "And then?"}]
    before = pool.cached(other)
    with pool.hold_slot(first.node):
        reply = _chat(pool.routers["off"], messages)
    assert reply.node == other
    assert pool.cached(other) - before < first.prompt_tokens / 2  # that node had never seen this history

