"""What the heartbeat tells the operator: a line for each change of llama-server's health or of the memory
probe's, the probe's error in /status, and a capacity never above llama-server's slots."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from macpool.dev.redis_server import free_port
from node_agent.heartbeat import decoded_so_far
from tests.conftest import Server
from tests.node_agent.helpers import SIM_COMMAND, AgentFactory, read_node, status, wait_until

SimFactory = Callable[..., Server]
FIXTURES = Path(__file__).parent / "fixtures"


def logged(server: Server, needle: str) -> list[tuple[str, str]]:
    """(level, message) of each line of the process's log that contains ``needle``."""
    assert server.child.log_path is not None
    found = []
    for line in server.child.log_path.read_text().splitlines():
        if needle in line:
            _date, _time, level, _logger, message = line.split(" ", 4)
            found.append((level, message))
    return found


def logged_here(caplog: pytest.LogCaptureFixture, needle: str) -> list[tuple[str, str]]:
    """``logged`` for servers in this process: (level, message) of each record that contains ``needle``."""
    return [(r.levelname, r.getMessage()) for r in caplog.records if needle in r.getMessage()]


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
    ((level, line),) = logged(gateway, "llama-server is healthy")
    assert level == "INFO" and re.fullmatch(r"llama-server is healthy \(loaded in \d+\.\ds\)", line), line
    assert logged(gateway, f"llama-server at {llama['url']}") == [
        (
            "WARNING",
            f"llama-server at {llama['url']} is not answering /health (ReadTimeout); "
            "admitting nothing until it is healthy again",
        ),
        ("INFO", f"llama-server at {llama['url']} is healthy"),
    ]


def fake_command(directory: Path, name: str, output: Path) -> None:
    """An executable ``name`` in ``directory`` that prints a recorded output, whatever it is asked."""
    script = directory / name
    script.write_text(f"#!/bin/sh\nexec cat {output}\n")
    script.chmod(0o755)


def test_a_failing_memory_probe_is_logged_once_per_failure_and_shown_in_status(
    sim: SimFactory, agent: AgentFactory, redis_url: str, tmp_path: Path
) -> None:
    # the macos probe runs `sysctl` and `vm_stat` from PATH: none (Linux), then recorded ones, then none again
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    upstream = sim("--parallel", "3", "--speed", "20")
    gateway = agent(
        "--upstream", upstream.url, "--memory-probe", "macos", env={"PATH": f"{bin_dir}:{os.environ['PATH']}"}
    )
    wait_until(state_is(redis_url, "ready"), what="ready")
    time.sleep(1.0)  # three more failed samples: still one line
    failing = status(gateway.url)
    assert failing["memory_probe_error"], failing
    # nothing else changes: no memory term, the slots decide
    assert failing["capacity"] == 3 and failing["node"]["capacity_breakdown"]["memory"] is None
    warning = "memory probe macos failed: "
    assert [level for level, _ in logged(gateway, warning)] == ["WARNING"]

    fake_command(bin_dir, "sysctl", FIXTURES / "sysctl-m5max-128g-sonoma-default.txt")
    fake_command(bin_dir, "vm_stat", FIXTURES / "vm_stat-m5max-idle.txt")
    wait_until(lambda: status(gateway.url)["memory_probe_error"] is None, what="the probe answers")
    assert wait_until(lambda: (d := read_node(redis_url, "n1")) and d.memory.total_gb, what="figures") > 100
    answers = "memory probe macos answers again"
    assert logged(gateway, answers) == [("INFO", answers)]

    (bin_dir / "vm_stat").unlink()
    error = wait_until(lambda: status(gateway.url)["memory_probe_error"], what="the probe fails again")
    assert "vm_stat" in error
    assert [level for level, _ in logged(gateway, warning)] == ["WARNING", "WARNING"]


@pytest.mark.in_process
def test_a_cap_above_the_slots_is_held_to_the_slots_with_one_warning(
    sim: SimFactory, agent: AgentFactory, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    upstream = sim("--parallel", "3", "--speed", "20", "--metrics")
    gateway = agent("--upstream", upstream.url, "--cap", "6")
    doc = wait_until(lambda: (d := read_node(redis_url, "n1")) and d.state == "ready" and d, what="ready")
    assert (doc.capacity, doc.total_slots, doc.capacity_breakdown.configured) == (3, 3, 3)
    assert doc.reason == "capacity 3 set by llama-server's 3 slots (--cap 6 is above them)"
    assert status(gateway.url)["capacity"] == 3
    # per model: what it holds (the weights, and the KV of its 3 slots at the figure the agent divides its
    # headroom by); attached to a running llama-server, the agent never saw it load
    (model,) = doc.model_states
    assert (model.name, model.state, model.capacity, model.in_flight, model.load_s) == (
        doc.models[0], "loaded", 3, 0, None)
    assert model.memory_gb == pytest.approx(doc.memory.weights_gb + 3 * doc.memory.per_request_gb, abs=0.01)
    time.sleep(1.0)  # three more beats: still one line
    assert logged_here(caplog, "--cap 6 is above") == [
        (
            "WARNING",
            "--cap 6 is above llama-server's 3 slots (total_slots in /props): capacity is at most 3, "
            "since requests past the slots would queue inside llama-server",
        )
    ]


def _recorded_json(name: str) -> object:
    """The body of a recorded llama-server answer (tests/node_agent/fixtures/llama-server)."""
    return json.loads((FIXTURES / "llama-server" / name).read_bytes().partition(b"\r\n\r\n")[2])


def test_tokens_still_being_generated_are_read_from_llama_servers_slots() -> None:
    # two requests in flight in the recording, 650 and 670 tokens in
    assert decoded_so_far(_recorded_json("slots-busy.txt")) == 650 + 670
    assert decoded_so_far(_recorded_json("slots-idle.txt")) == 0
    assert decoded_so_far({"error": "not a list"}) == 0


@pytest.mark.in_process
def test_tokens_per_second_count_a_long_generation_before_it_ends(
    sim: SimFactory, agent: AgentFactory, redis_url: str
) -> None:
    # llama-server adds a request's tokens to tokens_predicted_total only when it ends: a Mac busy with one
    # long generation read 0 tokens/s on the dashboard (and to the router's tie-break) until then
    upstream = sim("--parallel", "2", "--speed", "20", "--metrics")
    gateway = agent("--upstream", upstream.url)
    wait_until(state_is(redis_url, "ready"), what="ready")
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100_000, "stream": True}
    with httpx.stream("POST", gateway.url + "/v1/chat/completions", json=body, timeout=30) as response:
        chunks = response.iter_raw()  # keep the generator: dropping it closes the stream
        next(chunks)
        doc = wait_until(lambda: (d := read_node(redis_url, "n1")) and d.tokens_per_s > 0 and d,
                         what="tokens/s while the generation runs")
        assert status(gateway.url)["in_flight"] == 1
    assert doc.tokens_per_s > 0


def test_llama_servers_metrics_are_read_with_prometheus_clients_parser() -> None:
    from node_agent.heartbeat import parse_metrics

    page = ("# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.\n"
            "# TYPE llamacpp:prompt_tokens_total counter\nllamacpp:prompt_tokens_total 1234\n"
            "# HELP llamacpp:requests_processing Number of requests processing.\n"
            "# TYPE llamacpp:requests_processing gauge\nllamacpp:requests_processing 2\n"
            'other_metric{label="x"} 7\n')
    good = {"llamacpp:prompt_tokens_total": 1234.0, "llamacpp:requests_processing": 2.0}
    assert parse_metrics(page) == good
    # a page garbled after good samples: no exception, and only llama-server's own figures
    broken = parse_metrics(page.replace('other_metric{label="x"} 7', "llamacpp:x {broken"))
    assert broken.items() <= good.items() and "llamacpp:prompt_tokens_total" in broken
    assert parse_metrics("") == {}
