"""Supervision with a real llama-server: kill -9 it, the agent restarts it and the node is ready again."""

from __future__ import annotations

import json
import os
import re
import signal
import time

import httpx
import pytest

from macpool.dev.stack import Stack

from .conftest import Pool, real_setup, wait_until

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


def test_a_stream_past_the_drain_timeout_is_cut_by_the_gateway_at_once(
    redis_server: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """SIGTERM with a long stream open and --drain-timeout 1: the stream ends about then, with the gateway's
    error event - not seconds later, when llama-server (told to stop first, before) is finally killed."""
    setup = real_setup(redis_server, tmp_path_factory, "drain")
    with Stack(logs=setup.logs, keep_logs=True, stop_timeout=15) as stack:
        proc = setup.agent(stack, redis_server, "drain-node", 1, 4096, "--drain-timeout", "1")
        agent, url = proc.child, proc.url
        wait_until(lambda: httpx.get(url + "/status", timeout=5).json()["state"] == "ready", 90, "ready")
        body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 3900, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as response:
            chunks = response.iter_raw()
            first = next(chunks)
            agent.signal(signal.SIGTERM)
            signalled = time.monotonic()
            rest = b"".join(chunks)
            took = time.monotonic() - signalled
        events = [e for e in (first + rest).split(b"\n\n") if e.startswith(b"data: ")]
        last = json.loads(events[-1][len(b"data: "):])
        assert last["error"]["message"] == "the node shut down mid-stream", last
        assert took < 4.0, took  # the drain timeout (1 s), the gateway's own (1 s), and the event
