"""A real pool for the operator tests: Redis, simulators, one agent per simulator, the router."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from macpool.dev.stack import Stack
from macpool.sim.machine import preset_names
from tests.conftest import in_process
from tests.operator.helpers import ADMIN_KEY, AGENT_TOKEN, HEARTBEAT_S, Pool

START_TIMEOUT_S = 60.0


@pytest.fixture
def pool(request: pytest.FixtureRequest, redis_url: str, stack: Stack) -> Callable[..., Pool]:
    """``pool(nodes=3)``: a running pool whose router knows every node as ready (its servers in this
    process for a test marked ``in_process``)."""
    servers = in_process(request) or stack

    def _pool(nodes: int = 3, speed: float = 1.0, router_args: tuple[str, ...] = ()) -> Pool:
        presets = sorted(preset_names())
        sims = {
            f"mac-{i + 1}": servers.sim(
                f"sim-{i + 1}", "--preset", presets[i % len(presets)], "--alias", "op-model", "--metrics",
                "--speed", str(speed), timeout=START_TIMEOUT_S,
            )
            for i in range(nodes)
        }
        agents = {
            node_id: servers.agent(
                f"agent-{node_id}", sim.url, redis_url, node_id, "--token", AGENT_TOKEN,
                "--heartbeat-interval", str(HEARTBEAT_S), timeout=START_TIMEOUT_S,
            )
            for node_id, sim in sims.items()
        }
        router = servers.router(
            "router", redis_url, "--admin-key", ADMIN_KEY, "--agent-token", AGENT_TOKEN, *router_args,
            timeout=START_TIMEOUT_S,
        )
        servers.wait_nodes(router.url, nodes, timeout=60, exact=True)
        return Pool(router=router, agents=agents, sims=sims)

    return _pool
