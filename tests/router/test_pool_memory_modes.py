"""A pool mixing both memory models: KV allocated at start (llama-server's real memory) and the growing
working set. A Mac whose start does not fit pages from its first request: it advertises nothing, and the
router serves every request on the others."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx

from macpool.dev.stack import Stack
from tests.conftest import Node, chat
from tests.router.conftest import AGENT_TOKEN, START_TIMEOUT_S, Pool, wait_until


def _node(stack: Stack, redis_url: str, node_id: str, preset: str, *sim_args: str) -> Node:
    sim = stack.sim(f"sim-{node_id}", "--preset", preset, "--alias", "m", "--speed", "50", *sim_args,
                    timeout=START_TIMEOUT_S)
    agent = stack.agent(f"agent-{node_id}", sim.url, redis_url, node_id, "--token", AGENT_TOKEN,
                        timeout=START_TIMEOUT_S)
    return Node(node_id, sim, agent)


def test_the_router_serves_both_memory_models_and_skips_a_start_that_pages(
    pool: Pool, stack: Stack, redis_url: str
) -> None:
    flat = _node(stack, redis_url, "flat", "m4pro-48g-14b-q4", "--parallel", "4", "-c", "32768")
    growing = _node(stack, redis_url, "growing", "m5max-128g-14b-q4", "--parallel", "4")
    # 16 slots x 32K context x 0.3125 MB = 160 GB of KV cache at start, past the 144 GB wired limit
    over = _node(stack, redis_url, "over", "m3ultra-192g-70b-q4", "--parallel", "16", "-c", "524288")
    router = pool.router()
    pool.wait_ready(router, 2)
    status = wait_until(lambda: (over.status().get("node") or {}).get("state") == "paging" and over.status(),
                        what="the overcommitted node to say it pages")
    assert status["node"]["capacity"] == 0
    assert flat.status()["node"]["capacity"] == 4  # 4 slots; the memory term (1.5 GB a slot) allows 16

    def one(i: int) -> int:
        body = chat(model="m", max_tokens=8, content=f"request {i}")
        return httpx.post(router.url + "/v1/chat/completions", json=body, timeout=60).status_code

    with ThreadPoolExecutor(8) as workers:
        codes = list(workers.map(one, range(16)))
    assert codes == [200] * 16
    assert over.stats()["completed"] == 0
    assert flat.stats()["completed"] > 0 and growing.stats()["completed"] > 0
    assert flat.stats()["completed"] + growing.stats()["completed"] == 16
    assert flat.stats()["peak_pinned_gb"] == httpx.get(flat.sim.url + "/sim/memory").json()["pinned_gb"]
