"""Supervise mode, the simulator as llama-server: ready once healthy, restart on crash, no orphans."""

from __future__ import annotations

import asyncio
import os
import shlex
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from macpool.contract import heartbeat_ttl_ms
from macpool.dev.procs import macpool_argv
from macpool.dev.redis_server import free_port
from node_agent import cli as agent_cli
from node_agent.agent import bind_socket
from node_agent.supervisor import Supervisor, redacted
from tests.conftest import SpawnFactory
from tests.node_agent.helpers import LOOPS, SIM_COMMAND, AgentFactory, read_node, status, wait_until

Inode = tuple[int, int]  # (st_dev, st_ino)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split()[2] == "Z")


def test_supervised_restart_and_ttl_expiry_after_kill_9(
    agent: AgentFactory, redis_url: str, tmp_path: Path
) -> None:
    model = tmp_path / "model-14b-q4.gguf"
    model.write_bytes(b"not really a gguf")  # the simulator only reports the name
    gateway = agent(
        "--llama-server",
        SIM_COMMAND + " --load-seconds 0.5",
        "--model",
        str(model),
        "--parallel",
        "4",
        "--ctx-per-slot",
        "2048",
    )
    doc = wait_until(lambda: (d := read_node(redis_url, "n1")) and d.state == "ready" and d, what="ready")
    assert (doc.total_slots, doc.ctx_per_slot, doc.models) == (4, 2048, ["model-14b-q4"])  # --alias
    llama = status(gateway.url)["llama_server"]
    assert "--ctx-size" in llama["argv"] and "8192" in llama["argv"] and "--metrics" in llama["argv"]
    pid = llama["pid"]
    ok = httpx.post(gateway.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4})
    assert ok.status_code == 200

    os.kill(pid, signal.SIGKILL)  # llama-server crashes
    wait_until(lambda: (d := read_node(redis_url, "n1")) and d.state == "unhealthy", what="unhealthy")
    refused = httpx.post(gateway.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "node_unavailable"
    wait_until(lambda: (d := read_node(redis_url, "n1")) and d.state == "ready", what="ready again")
    llama = status(gateway.url)["llama_server"]
    assert llama["restarts"] == 1 and llama["pid"] != pid
    assert (
        httpx.post(gateway.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}).status_code == 200
    )

    # the agent itself is killed -9: its llama-server dies with it, and its key expires with the TTL
    assert gateway.child.process is not None
    os.kill(gateway.child.process.pid, signal.SIGKILL)
    gateway.child.process.wait(5)
    killed_at = time.monotonic()
    wait_until(lambda: not alive(llama["pid"]), timeout=5, what="no orphan llama-server")
    wait_until(lambda: read_node(redis_url, "n1") is None, timeout=5, what="key expired")
    assert time.monotonic() - killed_at <= heartbeat_ttl_ms(0.3) / 1000 + 1.5


def test_sigterm_stops_the_supervised_server(agent: AgentFactory, redis_url: str, tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"x")
    gateway = agent("--llama-server", SIM_COMMAND, "--model", str(model), "--parallel", "2")
    wait_until(lambda: (d := read_node(redis_url, "n1")) and d.state == "ready", what="ready")
    pid = status(gateway.url)["llama_server"]["pid"]
    gateway.child.signal(signal.SIGTERM)
    assert gateway.child.process is not None and gateway.child.process.wait(15) == 0
    wait_until(lambda: not alive(pid), timeout=5, what="llama-server stopped")
    assert read_node(redis_url, "n1") is None


def test_a_second_sigterm_ends_open_streams_as_a_shutdown_then_stops_at_once(
    agent: AgentFactory, redis_url: str, tmp_path: Path
) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"x")
    slow = SIM_COMMAND.replace("--speed 20", "--speed 1")  # a stream that lasts well past the test
    gateway = agent("--llama-server", slow, "--model", str(model), "--parallel", "2", "--drain-timeout", "30")
    wait_until(lambda: (d := read_node(redis_url, "n1")) and d.state == "ready", what="ready")
    pid = status(gateway.url)["llama_server"]["pid"]
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000, "stream": True}
    with httpx.stream("POST", gateway.url + "/v1/chat/completions", json=body, timeout=30) as response:
        chunks = response.iter_raw()
        first = next(chunks)
        gateway.child.signal(signal.SIGTERM)
        wait_until(lambda: (d := read_node(redis_url, "n1")) and d.state == "draining", what="draining")
        gateway.child.signal(signal.SIGTERM)  # the operator does not want to wait the 30 s
        forced = time.monotonic()
        rest = b"".join(chunks)
    assert gateway.child.process is not None and gateway.child.process.wait(15) == 0
    assert time.monotonic() - forced < 5
    # the stream ended as the node's shutdown, not as a llama-server failure (which counts toward alerts)
    last = [line for line in (first + rest).decode().splitlines() if line.startswith("data: ")][-1]
    assert "shut down" in last, last
    wait_until(lambda: not alive(pid), timeout=5, what="llama-server stopped")


def test_status_shows_the_llama_server_command_without_its_secrets(
    spawn: SpawnFactory, redis_url: str, tmp_path: Path
) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"x")
    port = free_port()  # given here: the `agent` fixture's --port would land after `--`
    argv = macpool_argv(
        "agent", "run", "--redis-url", redis_url, "--node-id", "n1", "--port", str(port),
        "--llama-server", SIM_COMMAND + " --api-key=IN-COMMAND", "--model", str(model), "--parallel", "2",
        "--", "--api-key", "AFTER-DASHES",
    )
    gateway = spawn(argv=argv, port=port, name="agent")
    wait_until(lambda: (d := read_node(redis_url, "n1")) and d.state == "ready", what="ready")
    argv = status(gateway.url)["llama_server"]["argv"]
    assert "--api-key=<redacted>" in argv
    assert argv[argv.index("--api-key") + 1] == "<redacted>"
    assert argv[-2:] == ["--api-key", "<redacted>"]
    assert gateway.child.log_path is not None
    for secret in ("IN-COMMAND", "AFTER-DASHES"):
        assert secret not in httpx.get(gateway.url + "/status").text
        assert secret not in gateway.child.log_path.read_text()


def test_redacted_hides_the_value_of_every_credential_flag() -> None:
    argv = ["llama-server", "--api-key", "k1", "-hft", "t1", "--hf-token=t2", "--api-key-file", "/etc/keys",
            "--alias", "--api-key", "--api-key", "k2"]
    assert redacted(argv) == [
        "llama-server", "--api-key", "<redacted>", "-hft", "<redacted>", "--hf-token=<redacted>",
        "--api-key-file", "/etc/keys", "--alias", "--api-key", "<redacted>", "<redacted>",
    ]


def sockets_and_pipes(pid: int) -> set[Inode]:
    """(device, inode) of every socket and pipe the process holds past its stdio."""
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            info = os.stat(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if int(fd) > 2 and (stat.S_ISSOCK(info.st_mode) or stat.S_ISFIFO(info.st_mode)):
            found.add((info.st_dev, info.st_ino))
    return found


async def descriptors_once_healthy(supervisor: Supervisor) -> tuple[set[Inode], set[Inode]]:
    """The sockets and pipes of the supervised server once healthy, and ours at that moment."""
    healthy = asyncio.Event()
    supervisor.on_healthy = healthy.set
    async with httpx.AsyncClient() as client:
        task = asyncio.create_task(supervisor.run(client))
        waiter = asyncio.create_task(healthy.wait())
        try:
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
            assert healthy.is_set(), "the supervisor stopped"
            assert supervisor.process is not None
            return sockets_and_pipes(supervisor.process.pid), sockets_and_pipes(os.getpid())
        finally:
            waiter.cancel()
            task.cancel()
            await asyncio.gather(task, waiter, return_exceptions=True)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("loop", LOOPS)
def test_the_supervised_server_inherits_no_descriptor_of_the_agent(loop: str, tmp_path: Path) -> None:
    """On every loop: uvloop's spawn ignores close_fds and passes every inheritable descriptor on."""
    model = tmp_path / "m.gguf"
    model.write_bytes(b"x")
    gateway = bind_socket("127.0.0.1", 0)
    handed_down, other_end = socket.socketpair()
    handed_down.set_inheritable(True)  # as one the agent got from whatever started it
    supervisor = Supervisor(shlex.split(SIM_COMMAND), model, 1, 256, [], tmp_path / "llama.log")
    try:
        with asyncio.Runner(loop_factory=LOOPS[loop]) as runner:
            in_child, ours = runner.run(descriptors_once_healthy(supervisor))
        assert {inode(gateway), inode(handed_down)} <= ours
    finally:
        for sock in (gateway, handed_down, other_end):
            sock.close()
    assert not in_child & ours
    assert supervisor.process is not None and not alive(supervisor.process.pid)


def test_the_gateway_socket_is_not_inheritable() -> None:
    """uvicorn binds its own inheritable for its worker processes; the agent has none."""
    with bind_socket("127.0.0.1", 0) as gateway:
        assert not gateway.get_inheritable()


def inode(sock: socket.socket) -> Inode:
    info = os.fstat(sock.fileno())
    return info.st_dev, info.st_ino


def one_liner(*args: str) -> str:
    """What ``macpool agent run <args>`` says as a process: exit 2, one line on stderr, no traceback."""
    done = subprocess.run(macpool_argv("agent", "run", *args), capture_output=True, text=True, timeout=30)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


def said(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """The same, in this process: for settings refused before the agent starts anything."""
    assert agent_cli.main(["run", *args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_bad_configuration_fails_before_start_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert "model=" in said(capsys, "--llama-server", SIM_COMMAND, "--model", str(tmp_path / "missing.gguf"))
    assert "no such executable" in said(capsys, "--llama-server", "/nope/llama-server", "--model", __file__)
    assert "upstream=" in said(capsys, "--upstream", "not a url")
    assert "redis_url=" in said(capsys, "--upstream", "http://127.0.0.1:1", "--redis-url", "http://x")
    assert "exactly one" in one_liner()
    for after_dashes in (["--host", "0.0.0.0"], ["--port=8080"]):
        line = said(capsys, "--llama-server", SIM_COMMAND, "--model", __file__, "--", *after_dashes)
        assert "127.0.0.1" in line and after_dashes[0] in line, line
    assert "--config" in said(capsys, "--config", str(tmp_path / "none.toml"))
    with socket_taken() as port:  # found once the agent binds, after its logging is set up: a process
        assert "cannot listen" in one_liner("--upstream", "http://127.0.0.1:1", "--port", str(port))
    heartbeat = said(capsys, "--upstream", "http://127.0.0.1:1", "--heartbeat-interval", "-1")
    assert "heartbeat_interval" in heartbeat


class socket_taken:
    def __enter__(self) -> int:
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", free_port()))
        self.sock.listen()
        port: int = self.sock.getsockname()[1]
        return port

    def __exit__(self, *exc: object) -> None:
        self.sock.close()
