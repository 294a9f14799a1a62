"""A real pool for the operator tests: Redis, simulators, one agent per simulator, the router."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from simulator.machine import preset_names
from tests.operator.helpers import ADMIN_KEY, AGENT_TOKEN, HEARTBEAT_S, Pool, wait_until

SpawnFactory = Callable[..., Any]


@pytest.fixture
def pool(redis_url: str, spawn: SpawnFactory) -> Callable[..., Pool]:
    """``pool(nodes=3)``: a running pool whose router knows every node as ready."""

    def _pool(nodes: int = 3, speed: float = 1.0, router_args: tuple[str, ...] = ()) -> Pool:
        presets = sorted(preset_names())
        sims = {
            f"mac-{i + 1}": spawn(
                "sim", "--preset", presets[i % len(presets)], "--alias", "op-model", "--metrics",
                "--speed", str(speed),
                name=f"sim-{i + 1}", timeout=60,
            )
            for i in range(nodes)
        }
        agents = {
            node_id: spawn(
                "agent", "run", "--upstream", sim.url, "--redis-url", redis_url, "--node-id", node_id,
                "--token", AGENT_TOKEN, "--heartbeat-interval", str(HEARTBEAT_S), name=f"agent-{node_id}",
                timeout=60,
            )
            for node_id, sim in sims.items()
        }
        router = spawn(
            "router", "--redis-url", redis_url, "--admin-key", ADMIN_KEY, "--agent-token", AGENT_TOKEN,
            *router_args, name="router", timeout=60,
        )
        result = Pool(router=router, agents=agents, sims=sims)

        def all_ready() -> bool:
            pool_doc = result.view()["pool"]
            assert isinstance(pool_doc, dict)
            return int(pool_doc["nodes_ready"]) == nodes

        wait_until(all_ready, 60, f"{nodes} ready nodes in /api/pool")
        return result

    return _pool
