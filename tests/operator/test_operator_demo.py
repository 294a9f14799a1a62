"""``macpool demo``: one command starts a pool that streams; SIGTERM leaves no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import httpx
import psutil
import pytest

from macpool.procs import macpool_argv
from macpool.redis_server import free_port


@pytest.mark.slow
def test_demo_serves_a_stream_and_sigterm_stops_every_child() -> None:
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

        body = {"stream": True, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            text = "".join(r.iter_text())
        assert "data: [DONE]" in text
        assert httpx.get(f"http://127.0.0.1:{port}/dashboard", timeout=10).status_code == 200

        descendants = psutil.Process(demo.pid).children(recursive=True)
        assert len(descendants) >= 5  # redis, 2 sims, 2 agents, router
        demo.send_signal(signal.SIGTERM)
        assert demo.wait(60) == 0
        _gone, alive = psutil.wait_procs(descendants, timeout=30)
        assert not alive, [p.pid for p in alive]
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
            demo.wait(10)
        if demo.stdout is not None:
            demo.stdout.close()
        for p in descendants:
            if p.is_running():
                p.kill()
