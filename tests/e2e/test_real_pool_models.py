"""The pool's desired state end to end, with the real llama-server: ``macpool models add`` declares a model on
a (fake, loopback) Hugging Face hub; a router answers a request for it, while no Mac has it, with 503
model_loading past its cold-start timeout; an agent started with ``--from-pool`` (a process with its own HOME
and HF_HOME) takes it - downloading, then in standby - and a request through the router is served by it;
``macpool models rm`` drains it off the Mac and the pool forgets it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx
import pytest

from macpool.dev import tiny_model
from macpool.dev.procs import macpool_argv
from macpool.dev.stack import Stack, free_port
from tests.e2e.conftest import require_llama_server, wait_until
from tests.inprocess import LocalStack
from tests.node_agent.fake_hub import FakeHub
from tests.node_agent.helpers import read_node

REPO = "macpool/tiny-GGUF"


def models_cli(redis_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(macpool_argv("models", *args, "--redis-url", redis_url), capture_output=True,
                          text=True, timeout=120)


def ask(url: str, model: str) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})


@pytest.mark.timeout(300)
def test_an_agent_takes_a_declared_model_from_the_hub_and_serves_it(
        stack: Stack, local_stack: LocalStack, redis_url: str, tmp_path: Path) -> None:
    binary = require_llama_server()
    tiny = tiny_model.ensure("tiny").read_bytes()
    # cut once: huggingface_hub waits a second before it resumes, so the download lasts that long at least
    hub = FakeHub({REPO: {"tiny-Q8_0.gguf": tiny, "tiny-Q4_K_M.gguf": tiny}}, cut={"tiny-Q4_K_M.gguf"})
    hub_url = local_stack.serve("hub", hub.app(), ready=None).url

    added = models_cli(redis_url, "add", "tiny", f"{REPO}:Q4_K_M")
    assert added.returncode == 0, added.stderr
    impatient = stack.router("impatient", redis_url, "--cold-start-timeout", "0.5",
                             "--refresh-interval", "0.2")
    wait_until(lambda: httpx.get(impatient.url + "/v1/models", timeout=5).json()["data"], what="declared")
    listed = httpx.get(impatient.url + "/v1/models", timeout=5).json()["data"]
    states = [(m["id"], m["macpool"]["state"], m["macpool"]["replicas"]) for m in listed]
    assert states == [("tiny", "declared", 1)]
    early = ask(impatient.url, "tiny")
    assert early.status_code == 503, early.text
    assert early.json()["error"]["code"] == "model_loading" and early.headers.get("retry-after")

    home = tmp_path / "mac"
    port = free_port()
    argv = macpool_argv(
        "agent", "run", "--redis-url", redis_url, "--node-id", "mac", "--port", str(port),
        "--llama-server", str(binary), "--from-pool", "--parallel", "2", "--ctx-per-slot", "512",
        "--wired-limit-gb", "4", "--headroom-gb", "0", "--heartbeat-interval", "0.3",
        "--llama-log", str(tmp_path / "llama.log"), "--", "-t", "1",
    )
    env = {"HOME": str(home), "HF_HOME": str(home / "hf"), "HF_ENDPOINT": hub_url,
           "HF_HUB_DISABLE_TELEMETRY": "1"}
    stack.spawn("agent", argv, port, ready="/status", env=env)
    downloading = wait_until(
        lambda: (d := read_node(redis_url, "mac/tiny")) and d.state == "downloading" and d,
        what="mac/tiny downloading")
    assert downloading.model_states[0].download is not None
    assert downloading.model_states[0].download.total_bytes == len(tiny)
    standby = wait_until(lambda: (d := read_node(redis_url, "mac/tiny")) and d.state == "standby" and d,
                         what="mac/tiny downloaded, in standby")
    assert standby.models == ["tiny"] and standby.model_states[0].memory_gb
    assert list((home / "hf" / "hub").rglob("tiny-Q4_K_M.gguf"))  # in the Mac's own cache
    assert "mac" in models_cli(redis_url, "ls").stdout

    router = stack.router("router", redis_url, "--cold-start-timeout", "60", "--refresh-interval", "0.2")
    served = ask(router.url, "tiny")
    assert served.status_code == 200, served.text
    assert served.json()["model"] == "tiny"

    removed = models_cli(redis_url, "rm", "tiny", "--timeout", "60")
    assert removed.returncode == 0, removed.stderr
    assert "drained, unloaded and removed" in removed.stdout, removed.stdout
    wait_until(lambda: read_node(redis_url, "mac/tiny") is None, what="mac/tiny gone")
    wait_until(lambda: httpx.get(router.url + "/v1/models", timeout=5).json()["data"] == [],
               what="tiny out of /v1/models")
    gone = ask(router.url, "tiny")  # (no wait for it: the Mac serves nothing else, the pool is empty)
    assert gone.status_code == 503 and gone.json()["error"]["code"] == "no_nodes", gone.text
