"""A real pool for router tests: simulators, one agent per simulator, routers, one Redis.

``pool`` starts them as processes, or in this process (tests.inprocess: the same servers on real sockets)
for a test marked ``in_process``, where a separate process is not the point.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from macpool.dev.stack import Stack
from tests.conftest import Node as Node
from tests.conftest import Server as Server
from tests.conftest import in_process
from tests.conftest import wait_until as wait_until
from tests.inprocess import LocalStack

AGENT_TOKEN = "router-test-agent-token"
PRESET = "m5max-128g-14b-q4"
START_TIMEOUT_S = 30.0


class Pool:
    """Factory for the servers of one test, on its process harness or its LocalStack (which stop them all)."""

    def __init__(self, stack: Stack | LocalStack, redis_url: str) -> None:
        self.stack = stack
        self.redis_url = redis_url

    def node(
        self, node_id: str, cap: int, *, parallel: int = 8, speed: float = 50.0, preset: str = PRESET,
        alias: str | None = None, ctx_size: int | None = None, metrics: bool = False,
    ) -> Node:
        """A simulated Mac (``alias``: the model name it serves, instead of its preset's; ``ctx_size``: its
        whole context, split across its slots; ``metrics``: it serves /metrics, which the agent measures its
        prompt speed by) and its agent."""
        named = ("--alias", alias) if alias else ()
        named += ("--ctx-size", str(ctx_size)) if ctx_size else ()
        named += ("--metrics",) if metrics else ()
        sim = self.stack.sim(
            f"sim-{node_id}", "--preset", preset, "--parallel", str(parallel), "--speed", str(speed), *named,
            timeout=START_TIMEOUT_S,
        )
        agent = self.stack.agent(
            f"agent-{node_id}", sim.url, self.redis_url, node_id, "--cap", str(cap), "--token", AGENT_TOKEN,
            timeout=START_TIMEOUT_S,
        )
        return Node(node_id, sim, agent)

    def router(self, *args: str, env: dict[str, str] | None = None) -> Server:
        return self.stack.router(
            "router", self.redis_url, "--agent-token", AGENT_TOKEN, *args, env=env, timeout=START_TIMEOUT_S
        )

    def wait_ready(self, router: Server, nodes: int, timeout: float = 30.0) -> dict[str, Any]:
        """Wait until the router sees ``nodes`` ready nodes; returns its /api/pool document."""
        return self.stack.wait_nodes(router.url, nodes, timeout=timeout, exact=True)

    @staticmethod
    def model(router: Server) -> str:
        models = httpx.get(router.url + "/v1/models", timeout=5).json()["data"]
        name: str = models[0]["id"]
        return name


def queued(router_url: str) -> int:
    """How many requests wait in the pool's queue, as the router sees it."""
    depth: int = httpx.get(router_url + "/api/pool").json()["pool"]["queued"]
    return depth


@pytest.fixture
def pool(request: pytest.FixtureRequest, stack: Stack, redis_url: str) -> Pool:
    return Pool(in_process(request) or stack, redis_url)
