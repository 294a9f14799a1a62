"""The ``agent`` fixture: a running ``macpool agent run`` with fast heartbeats against the test Redis."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import Server, SpawnFactory, in_process
from tests.node_agent.helpers import INTERVAL, AgentFactory


@pytest.fixture
def agent(request: pytest.FixtureRequest, spawn: SpawnFactory, redis_url: str) -> AgentFactory:
    """``agent("--upstream", url, node_id="n1")``: a running agent with fast heartbeats (in this process
    for a test marked ``in_process``)."""
    local = in_process(request)

    def _agent(*args: str, node_id: str = "n1", redis: str | None = None, **kwargs: Any) -> Server:
        if local is not None:
            argv = ("--redis-url", redis or redis_url, "--node-id", node_id, "--heartbeat-interval", INTERVAL)
            return local.agent_run(f"agent-{node_id}", *argv, *args, **kwargs)  # type: ignore[return-value]
        return spawn(
            "agent",
            "run",
            "--redis-url",
            redis or redis_url,
            "--node-id",
            node_id,
            "--heartbeat-interval",
            INTERVAL,
            *args,
            name=f"agent-{node_id}",
            **kwargs,
        )

    return _agent
