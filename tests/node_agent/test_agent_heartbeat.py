"""What the heartbeat tells the operator: a line for each change of llama-server's health."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from macpool.redis_server import free_port
from tests.conftest import Server
from tests.node_agent.helpers import SIM_COMMAND, AgentFactory, read_node, status, wait_until

SimFactory = Callable[..., Server]


def logged(server: Server, needle: str) -> list[tuple[str, str]]:
    """(level, message) of each line of the process's log that contains ``needle``."""
    assert server.child.log_path is not None
    found = []
    for line in server.child.log_path.read_text().splitlines():
        if needle in line:
            _date, _time, level, _logger, message = line.split(" ", 4)
            found.append((level, message))
    return found


def state_is(redis_url: str, state: str) -> Callable[[], bool]:
    return lambda: (doc := read_node(redis_url, "n1")) is not None and doc.state == state


def test_attach_mode_logs_each_change_of_the_upstream_once(
    sim: SimFactory, agent: AgentFactory, redis_url: str
) -> None:
    port = free_port()
    upstream = sim("--parallel", "2", "--speed", "20", port=port)
    gateway = agent("--upstream", upstream.url)
    wait_until(state_is(redis_url, "ready"), what="ready")
    upstream.child.kill()
    wait_until(state_is(redis_url, "unhealthy"), what="unhealthy")
    time.sleep(1.0)  # three more polls that find it down: still one line
    sim("--parallel", "2", "--speed", "20", "--load-seconds", "1", port=port)
    wait_until(state_is(redis_url, "ready"), what="ready again")
    assert logged(gateway, f"llama-server at {upstream.url}") == [
        ("INFO", f"llama-server at {upstream.url} is healthy"),
        (
            "WARNING",
            f"llama-server at {upstream.url} is not answering /health (ConnectError); "
            "admitting nothing until it is healthy again",
        ),
        ("INFO", f"waiting for llama-server at {upstream.url}: answering /health with HTTP 503"),
        ("INFO", f"llama-server at {upstream.url} is healthy"),
    ]


def test_supervise_mode_logs_a_llama_server_that_stops_answering(
    agent: AgentFactory, redis_url: str, tmp_path: Path
) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"x")
    gateway = agent("--llama-server", SIM_COMMAND, "--model", str(model), "--parallel", "2")
    wait_until(state_is(redis_url, "ready"), what="ready")
    llama = status(gateway.url)["llama_server"]
    os.kill(llama["pid"], signal.SIGSTOP)  # alive but silent: the supervisor sees no exit
    try:
        wait_until(state_is(redis_url, "unhealthy"), what="unhealthy")
    finally:
        os.kill(llama["pid"], signal.SIGCONT)
    wait_until(state_is(redis_url, "ready"), what="ready again")
    # the supervisor's own line says it came up; the heartbeat adds only what the supervisor cannot see
    assert logged(gateway, "llama-server is healthy") == [("INFO", "llama-server is healthy")]
    assert logged(gateway, f"llama-server at {llama['url']}") == [
        (
            "WARNING",
            f"llama-server at {llama['url']} is not answering /health (ReadTimeout); "
            "admitting nothing until it is healthy again",
        ),
        ("INFO", f"llama-server at {llama['url']} is healthy"),
    ]
