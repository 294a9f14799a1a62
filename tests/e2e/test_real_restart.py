"""Supervision with a real llama-server: kill -9 it, the agent restarts it and the node is ready again."""

from __future__ import annotations

import os
import re
import signal

import httpx
import pytest

from .conftest import Pool, wait_until

pytestmark = [pytest.mark.llama_server, pytest.mark.slow]


def test_kill_9_llama_server_is_restarted_and_node_returns_to_ready(pool: Pool) -> None:
    node = pool.nodes[-1]
    victim = node.llama_server()
    old_pid = victim.pid
    os.kill(old_pid, signal.SIGKILL)
    victim.wait(10)

    def restarted() -> bool:
        pid, state = node.llama_server().pid, node.status()["state"]
        if pid == old_pid or state != "ready":
            raise ValueError(f"llama-server pid {pid} (killed: {old_pid}), agent state {state}")
        return True

    wait_until(restarted, 60, f"{node.node_id}'s llama-server restarted and the node ready")
    pool.wait_all_ready(timeout=30)
    metrics = httpx.get(node.url + "/metrics", timeout=5).text
    match = re.search(r"^macpool_agent_llama_server_restarts_total (\S+)$", metrics, re.MULTILINE)
    assert match and float(match.group(1)) >= 1
    # and it serves again, directly through its agent
    response = httpx.post(
        node.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "back?"}], "max_tokens": 4},
        timeout=60,
    )
    assert response.status_code == 200, response.text
