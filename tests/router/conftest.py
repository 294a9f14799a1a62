"""A real pool for router tests: simulators, one agent per simulator, router processes, one Redis."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.conftest import Node as Node
from tests.conftest import wait_until as wait_until

# the root conftest's Server (child, url, port) and spawn factory
Server = Any
SpawnFactory = Callable[..., Any]

AGENT_TOKEN = "router-test-agent-token"
PRESET = "m5max-128g-14b-q4"





class Pool:
    """Factory for the processes of one test; the ``spawn`` fixture stops them all afterwards."""

    def __init__(self, spawn: SpawnFactory, redis_url: str) -> None:
        self.spawn = spawn
        self.redis_url = redis_url

    def node(self, node_id: str, cap: int, *, parallel: int = 8, speed: float = 50.0) -> Node:
        sim = self.spawn(
            "sim",
            "--preset",
            PRESET,
            "--parallel",
            str(parallel),
            "--speed",
            str(speed),
            name=f"sim-{node_id}",
        )
        agent = self.spawn(
            "agent",
            "run",
            "--upstream",
            sim.url,
            "--redis-url",
            self.redis_url,
            "--node-id",
            node_id,
            "--cap",
            str(cap),
            "--token",
            AGENT_TOKEN,
            name=f"agent-{node_id}",
        )
        return Node(node_id, sim, agent)

    def router(self, *args: str, env: dict[str, str] | None = None) -> Server:
        return self.spawn(
            "router",
            "--redis-url",
            self.redis_url,
            "--agent-token",
            AGENT_TOKEN,
            *args,
            name="router",
            env=env,
        )

    @staticmethod
    def wait_ready(router: Server, nodes: int, timeout: float = 30.0) -> dict[str, Any]:
        """Wait until the router sees ``nodes`` ready nodes; returns its /api/pool document."""

        def ready() -> dict[str, Any] | None:
            doc: dict[str, Any] = httpx.get(router.url + "/api/pool", timeout=5).json()
            return doc if doc["pool"]["nodes_ready"] == nodes else None

        result: dict[str, Any] = wait_until(ready, timeout)
        return result

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
def pool(spawn: SpawnFactory, redis_url: str) -> Pool:
    return Pool(spawn, redis_url)
