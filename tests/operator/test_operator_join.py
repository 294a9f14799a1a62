"""Joining a Mac in one command: `macpool pool invite` on the pool's side, `macpool agent join LINE` on the
Mac, a request served. The "Mac" is a second agent process with its own home directory."""

from __future__ import annotations

import os
import stat
import subprocess
import tomllib
from pathlib import Path

import httpx
import pytest

from macpool.dev.procs import macpool_argv
from macpool.dev.redis_server import RedisServer, free_port
from macpool.dev.stack import Stack
from macpool.identity import PoolSecret, write_private
from macpool.invite import Invitation, InvitationError

TOKEN = "a-long-agent-token-for-the-pool"


def _invite(redis_url: str, node_id: str, *extra: str) -> str:
    done = subprocess.run(
        macpool_argv("pool", "invite", "--node-id", node_id, *extra),
        capture_output=True, text=True, timeout=60, check=False,
        env={**os.environ, "MACPOOL_REDIS_URL": redis_url, "MACPOOL_AGENT_TOKEN": TOKEN},
    )
    assert done.returncode == 0, done.stderr
    command = done.stdout.strip()
    assert command.startswith("macpool agent join macpool-join-1.")
    assert TOKEN not in command and "password" not in command  # not readable at a glance; still a secret
    return command.split()[-1]


def _home(tmp_path: Path, name: str) -> dict[str, str]:
    home = tmp_path / name
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MACPOOL_") and k != "XDG_CONFIG_HOME"}
    return {**env, "HOME": str(home)}


@pytest.mark.slow
def test_a_mac_joins_with_the_invited_line_and_serves(tmp_path: Path, stack: Stack) -> None:
    redis_url = stack.redis(password="a-long-redis-password-1234")
    router = stack.router("router", redis_url, "--agent-token", TOKEN)
    sim = stack.sim("sim", "--preset", "m2pro-32g-8b-q4", "--speed", "50")
    line = _invite(redis_url, "mac-2")

    env = _home(tmp_path, "mac-2")
    port = free_port()
    argv = macpool_argv("agent", "join", line, "--upstream", sim.url, "--port", str(port))
    agent = stack.spawn("joined-agent", argv, port, ready="/status", env=env, timeout=60)
    stack.wait_nodes(router.url, 1)

    config = Path(env["HOME"]) / ".config" / "macpool" / "agent.toml"
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    written = tomllib.loads(config.read_text())
    assert written["node_id"] == "mac-2" and written["token"] == TOKEN
    assert "a-long-redis-password-1234" in written["redis_url"]
    # the secrets are in the file, not on the command line `ps` shows
    assert TOKEN not in " ".join(agent.child.argv) and "a-long-redis-password" not in " ".join(argv[4:])

    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    answer = httpx.post(router.url + "/v1/chat/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-macpool-node"] == "mac-2"
    # the agent holds the pool's token: a request that did not come through a router is refused
    direct = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=30)
    assert direct.status_code == 401


@pytest.mark.slow
def test_with_node_identity_the_line_carries_the_macs_own_credential(tmp_path: Path, stack: Stack) -> None:
    secret = tmp_path / "pool-secret"
    write_private(secret, PoolSecret.generate().encode())
    redis_url = stack.redis()
    router = stack.router("router", redis_url, "--pool-secret-file", str(secret))
    sim = stack.sim("sim", "--preset", "m2pro-32g-8b-q4", "--speed", "50")
    line = _invite(redis_url, "mac-6", "--pool-secret-file", str(secret))
    invitation = Invitation.decode(line)
    assert invitation.token is None and invitation.credential is not None

    env = _home(tmp_path, "mac-6")
    port = free_port()
    argv = macpool_argv("agent", "join", line, "--upstream", sim.url, "--port", str(port))
    stack.spawn("joined-agent", argv, port, ready="/status", env=env, timeout=60)
    stack.wait_nodes(router.url, 1)  # the router trusts it: its heartbeats are signed for mac-6
    folder = Path(env["HOME"]) / ".config" / "macpool"
    assert stat.S_IMODE((folder / "node.credential").stat().st_mode) == 0o600
    assert "token" not in tomllib.loads((folder / "agent.toml").read_text())
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    answer = httpx.post(router.url + "/v1/chat/completions", json=body, timeout=60)
    assert answer.status_code == 200 and answer.headers["x-macpool-node"] == "mac-6", answer.text


def test_a_pool_out_of_reach_is_said_in_one_line(tmp_path: Path) -> None:
    port = free_port()  # nothing listens there
    line = Invitation(redis_url=f"redis://127.0.0.1:{port}/0", node_id="mac-3").encode()
    done = subprocess.run(macpool_argv("agent", "join", line, "--check-timeout", "2"), capture_output=True,
                          text=True, timeout=60, env=_home(tmp_path, "mac-3"), check=False)
    assert done.returncode == 1
    assert "cannot reach the pool's Redis" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("line", ["", "hello", "macpool-join-1.", "macpool-join-1.!!!", "macpool-join-1.e30"])
def test_a_bad_line_is_refused_without_a_traceback(tmp_path: Path, line: str) -> None:
    with pytest.raises(InvitationError):
        Invitation.decode(line)
    done = subprocess.run(macpool_argv("agent", "join", line, "--no-start"), capture_output=True, text=True,
                          timeout=60, env=_home(tmp_path, "mac-4"), check=False)
    assert done.returncode == 2 and "join line" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "mac-4" / ".config" / "macpool" / "agent.toml").exists()


def test_service_installs_a_user_unit_that_runs_the_agent_on_the_written_file(tmp_path: Path) -> None:
    """systemd cannot run here: a `systemctl` on PATH stands in and records what it is asked."""
    with RedisServer() as server:
        line = Invitation(redis_url=server.url, node_id="mac-5", token=TOKEN).encode()
        env = _home(tmp_path, "mac-5")
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        calls = tmp_path / "systemctl-calls"
        fake = bin_dir / "systemctl"
        fake.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
        fake.chmod(0o755)
        env["PATH"] = f"{bin_dir}:{env['PATH']}"
        done = subprocess.run(macpool_argv("agent", "join", line, "--service", "--model", "/models/m.gguf"),
                              capture_output=True, text=True, timeout=60, env=env, check=False)
    assert done.returncode == 0, done.stderr
    unit = Path(env["HOME"]) / ".config" / "systemd" / "user" / "macpool-agent.service"
    exec_start = next(line for line in unit.read_text().splitlines() if line.startswith("ExecStart="))
    config = Path(env["HOME"]) / ".config" / "macpool" / "agent.toml"
    assert f"agent run --config {config} --model /models/m.gguf" in exec_start
    assert TOKEN not in unit.read_text()
    asked = calls.read_text().splitlines()
    assert asked == ["--user daemon-reload", "--user enable --now macpool-agent.service"]
