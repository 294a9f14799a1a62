"""``macpool demo``: one command starts a pool that streams; Ctrl-C or SIGTERM leaves no process behind."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from macpool.demo import DemoSettings, Pool
from macpool.dev.procs import macpool_argv
from macpool.dev.redis_server import free_port
from tests.conftest import SpawnFactory


@pytest.mark.slow
@pytest.mark.parametrize("stop", ["sigterm", "ctrl-c"])
def test_demo_serves_a_stream_and_stopping_it_stops_every_child(stop: str) -> None:
    port = free_port()
    demo = subprocess.Popen(
        macpool_argv("demo", "--nodes", "2", "--port", str(port)),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    lines: list[str] = []
    descendants: list[psutil.Process] = []
    try:
        assert demo.stdout is not None
        deadline = time.monotonic() + 180
        for line in demo.stdout:
            lines.append(line)
            if line.strip() == "macpool demo: ready" or time.monotonic() > deadline:
                break
        output = "".join(lines)
        assert "macpool demo: ready" in output, output
        assert f"http://127.0.0.1:{port}/dashboard" in output
        assert "curl -N" in output and "from openai import OpenAI" in output
        python = Path(macpool_argv()[0])
        assert f"{python} -m pip install -q openai" in output  # pasted outside the venv, it still works
        logs = Path(next(line.split()[1] for line in lines if line.strip().startswith("logs ")))

        body = {"stream": True, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            text = "".join(r.iter_text())
        assert "data: [DONE]" in text
        assert httpx.get(f"http://127.0.0.1:{port}/dashboard", timeout=10).status_code == 200

        # a long stream still in flight when the demo is stopped: the agents have something to drain
        started = threading.Event()

        def stream_until_cut() -> None:
            long = {**body, "max_tokens": 4000}
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            with contextlib.suppress(httpx.HTTPError), httpx.stream("POST", url, json=long, timeout=60) as r:
                for _ in r.iter_raw():
                    started.set()
            started.set()

        streaming = threading.Thread(target=stream_until_cut, daemon=True)
        streaming.start()
        assert started.wait(30)
        descendants = psutil.Process(demo.pid).children(recursive=True)
        assert len(descendants) >= 5  # redis, 2 sims, 2 agents, router
        if stop == "sigterm":
            demo.send_signal(signal.SIGTERM)
        else:  # a terminal's Ctrl-C: SIGINT to the demo's whole process group
            os.killpg(demo.pid, signal.SIGINT)
        assert demo.wait(60) == 0
        streaming.join(30)
        _gone, alive = psutil.wait_procs(descendants, timeout=30)
        assert not alive, [p.pid for p in alive]
        # every agent left the pool its graceful way: one signal each, Redis still there to leave through
        agent_logs = [path.read_text() for path in logs.glob("agent-*.log")]
        assert len(agent_logs) == 2
        for text in agent_logs:
            assert "second signal" not in text, text
            assert "redis unreachable" not in text and "could not remove" not in text, text
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
            demo.wait(10)
        if demo.stdout is not None:
            demo.stdout.close()
        for p in descendants:
            if p.is_running():
                p.kill()


def test_the_demo_is_what_its_flags_say_whatever_macpool_settings_the_shell_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = tmp_path / "keys"
    keys.write_text("sk-from-the-shell\n")
    monkeypatch.setenv("MACPOOL_API_KEYS_FILE", str(keys))  # the router's
    monkeypatch.setenv("MACPOOL_CAP", "1")  # the agent's
    monkeypatch.setenv("MACPOOL_SIM_PARALLEL", "1")  # the simulator's
    pool = Pool(DemoSettings(nodes=1, port=free_port()), tmp_path)
    try:
        pool.start(lambda line: None)
        body = {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        answer = httpx.post(pool.router_url + "/v1/chat/completions", json=body, timeout=30)
        assert answer.status_code == 200, answer.text  # no key: the snippets the demo prints work
        assert httpx.get(pool.router_url + "/api/pool", timeout=10).json()["pool"]["capacity"] > 1
    finally:
        pool.stop()


def test_a_demo_on_a_pools_redis_stays_apart_from_the_pool(
    tmp_path: Path, redis_url: str, spawn: SpawnFactory
) -> None:
    """`--redis-url` of a Redis a real pool uses: the demo's mac-1 must not take a real mac-1's node id (nor
    the demo's Macs the pool's traffic)."""
    sim = spawn("sim", "--preset", "m2pro-32g-8b-q4", name="sim")
    real = spawn("agent", "run", "--upstream", sim.url, "--redis-url", redis_url, "--node-id", "mac-1",
                 "--heartbeat-interval", "0.2", name="agent")
    settings = DemoSettings(nodes=1, port=free_port(), redis_url=redis_url, heartbeat_interval=0.2)
    pool = Pool(settings, tmp_path)
    try:
        pool.start(lambda line: None)
        time.sleep(1.0)  # heartbeats of both mac-1s
        assert httpx.get(real.url + "/status", timeout=10).json()["superseded_by"] is None
        nodes = httpx.get(pool.router_url + "/api/pool", timeout=10).json()["nodes"]
        assert [node["url"] for node in nodes] != [real.url] and len(nodes) == 1
    finally:
        pool.stop()
