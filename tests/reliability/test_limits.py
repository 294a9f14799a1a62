"""Prompts that cannot fit: refused cleanly, and never left holding a slot."""

from __future__ import annotations

import httpx
import pytest

from macpool.sim import tokens
from tests.reliability.conftest import Rig, assert_clean, chat, wait_until

pytestmark = pytest.mark.slow


@pytest.mark.in_process
def test_over_long_prompts_are_refused_without_holding_a_slot(rig: Rig) -> None:
    # 4 slots of 512 tokens each
    node = rig.node("ctx", cap=2, sim_args=("--ctx-size", "2048"))
    router = rig.router("--max-body-bytes", "65536")
    rig.wait_ready(router, nodes=1)
    httpx.post(node.sim.url + "/sim/reset", timeout=5)
    with httpx.Client(base_url=router.url, timeout=30) as client:
        # too big for the router's body limit: 413 before admission (no slot, nothing sent to the node)
        huge = chat("", 4)
        huge["messages"] = tokens.chat_messages(40_000)
        reply = client.post("/v1/chat/completions", json=huge)
        assert reply.status_code == 413 and reply.json()["error"]["code"] == "request_too_large"
        assert "x-macpool-node" not in reply.headers
        # fits the body limit but not a slot's context: a node counts it (a light request, no slot) and the
        # router refuses it, naming the largest context in the pool; nothing is reserved
        long = chat("", 4, stream=True)
        long["messages"] = tokens.chat_messages(3000)
        for _ in range(3):
            reply = client.post("/v1/chat/completions", json=long)
            assert reply.status_code == 400, reply.text
            assert reply.json()["error"]["code"] == "context_length_exceeded"
            assert "tokens > 512 maximum" in reply.json()["error"]["message"]
            assert_clean(reply.text, node.agent.url, node.sim.url)
            wait_until(lambda: rig.reservations(node.node_id) == 0, 5, "the slot released")
        stats = node.stats()
        assert stats["completed"] == 0 and stats["processing"] == 0 and stats["max_concurrent"] == 0
        assert node.status()["in_flight"] == 0
        assert client.post("/v1/chat/completions", json=chat("", 2, False)).status_code == 200
