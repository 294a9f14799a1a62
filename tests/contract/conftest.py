"""One llama-server contract suite, two targets: the simulator and the real llama-server.

Every test in this folder takes the ``target`` fixture, parametrised over ``sim`` (served in this process)
and ``llama-server`` (a process). Both are started the same way (2 slots, 1,024 tokens of context each,
metrics on), as in ../shared/reference/llama-server/README.md.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from macpool.dev import tiny_model
from macpool.dev.redis_server import free_port
from macpool.dev.stack import Stack
from tests.conftest import Server, SpawnFactory, spawner
from tests.inprocess import LocalStack

PARALLEL = 2
CTX_SIZE = 2048  # total; 1,024 per slot
SLOW_REQUEST_S = 5.0  # how long target.slow_request keeps a slot busy when alone on the server


@dataclass
class Target:
    """A running llama-server-compatible server under test."""

    kind: str  # "sim" or "llama-server"
    url: str
    server: Server
    parallel: int = PARALLEL
    n_ctx_per_slot: int = CTX_SIZE // PARALLEL
    model: str = ""
    # extra fields for a request that keeps a slot busy for a few seconds
    slow_request: dict[str, Any] = field(default_factory=dict)


def _llama_server_binary() -> str | None:
    path = os.environ.get("MACPOOL_LLAMA_SERVER_BIN")
    if path and os.path.isfile(path):
        return path
    from macpool.dev.llama_build import find_llama_server

    found = find_llama_server()
    return str(found) if found else None


def _start_sim(servers: LocalStack) -> Target:
    """The simulator in this process: the contract is its HTTP surface, not its process."""
    server = servers.sim(
        "sim", "--preset", "m5max-128g-14b-q4", "--parallel", str(PARALLEL), "--ctx-size", str(CTX_SIZE),
        "--speed", "5", "--metrics", "--model", "tiny.gguf",
    )
    return Target("sim", server.url, server, model="tiny.gguf", slow_request={"max_tokens": 900})


def _required_binary() -> str:
    binary = _llama_server_binary()
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("llama-server binary missing in CI (macpool dev build-llama-server)")
        pytest.skip("llama-server not built: run `macpool dev build-llama-server`")
    return binary


def _start_llama_server(spawn: SpawnFactory) -> Target:
    binary = _required_binary()
    # "small": ~5 ms a token on one idle thread (tiny: ~0.3 ms), so a long request keeps a slot busy
    model = tiny_model.ensure("small")
    port = free_port()
    argv = [
        binary, "-m", str(model), "--alias", model.name, "--host", "127.0.0.1", "--port", str(port),
        "--parallel", str(PARALLEL), "-c", str(CTX_SIZE), "--metrics", "--no-webui", "-t", "1",
    ]
    server = spawn(argv=argv, port=port, name="llama-server", timeout=60)
    return Target(
        "llama-server", server.url, server, model=model.name,
        slow_request={"max_tokens": _max_tokens_for(server.url, SLOW_REQUEST_S), "ignore_eos": True},
    )


def _max_tokens_for(url: str, seconds: float) -> int:
    """Tokens one request generates in about ``seconds`` on this machine now (decode speed varies 10x
    between an idle and a loaded two-core box), within what fits a slot next to a short prompt."""
    speed = 0.0
    for n_predict in (4, 24):  # the first request pays for warm-up
        body = {"prompt": "warm up", "n_predict": n_predict, "ignore_eos": True}
        timings = httpx.post(url + "/completion", json=body, timeout=120).json()["timings"]
        speed = float(timings["predicted_per_second"])
    return max(64, min(900, int(speed * seconds)))


@pytest.fixture(params=["sim", "llama-server"])
def target(request: pytest.FixtureRequest, spawn: SpawnFactory) -> Iterator[Target]:
    if request.param == "sim":
        yield _start_sim(request.getfixturevalue("local_stack"))
    else:
        yield _start_llama_server(spawn)


# every API of macpool/apis.py from one server: the FIM model answers /infill, --reranking adds rerank and
# the embeddings (llama-server still generates with it)
API_FLAGS = ("--parallel", str(PARALLEL), "--ctx-size", str(CTX_SIZE), "--reranking")


@pytest.fixture(scope="module", params=["sim", "llama-server"])
def api_target(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    """One server per test module, for tests that read answers and leave nothing another test reads."""
    if request.param == "sim":
        with LocalStack() as servers:
            served = servers.sim(
                "sim", "--preset", "m5max-128g-14b-q4", *API_FLAGS, "--speed", "20", "--model", "fim.gguf",
            )
            yield Target("sim", served.url, served, model="fim.gguf")
        return
    binary = _required_binary()
    model = tiny_model.ensure("fim")
    with Stack(logs=tmp_path_factory.mktemp("llama-server"), keep_logs=True) as stack:
        port = free_port()
        argv = [
            binary, "-m", str(model), "--alias", model.name, "--host", "127.0.0.1", "--port", str(port),
            *API_FLAGS, "--no-webui", "-t", "1",
        ]
        server = spawner(stack)(argv=argv, port=port, name="llama-server", timeout=60)
        yield Target("llama-server", server.url, server, model=model.name)
