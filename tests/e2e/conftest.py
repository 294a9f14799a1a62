"""End to end with real servers: real Redis, agents supervising real llama-servers, the router.

The pool is started once per module (three llama-servers take a moment on two cores) and every test
leaves it as it found it. In CI (``CI=true``) a missing llama-server binary fails the tests; locally
they skip with a one-line reason.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import redis

from macpool.dev import tiny_model
from macpool.dev.llama_build import find_llama_server
from macpool.dev.procs import Child, macpool_argv
from macpool.dev.stack import Proc, Stack
from tests.conftest import wait_until as shared_wait_until

PARALLEL = 2
CTX_PER_SLOT = 1024
# node id -> --cap (None: llama-server's total_slots). Caps below the slot count make "never more
# requests processing than the agent's cap" a real check rather than llama-server's own limit.
NODE_CAPS: dict[str, int | None] = {"mac-a": None, "mac-b": 1, "mac-c": 1}
QUEUE_SIZE = 1
QUEUE_TIMEOUT = 0.5


def require_llama_server() -> Path:
    """The binary, or fail (CI) / skip (locally) with one line."""
    found = find_llama_server()
    if found is not None:
        return found
    reason = "llama-server not built: run `macpool dev build-llama-server` (or set MACPOOL_LLAMA_SERVER_BIN)"
    if os.environ.get("CI"):
        pytest.fail(f"CI: {reason}", pytrace=False)
    pytest.skip(reason)





@dataclass
class RealSetup:
    """What every real-llama-server pool starts from: the binary, the tiny model, and a folder for logs."""

    binary: Path
    model: Path
    logs: Path

    def agent_argv(self, redis_url: str, node_id: str, port: int, parallel: int, ctx_per_slot: int,
                   *extra: str, llama_args: tuple[str, ...] = ()) -> list[str]:
        """An agent supervising its own llama-server on one thread (servers share two cores with the rest);
        ``llama_args`` go to llama-server."""
        return macpool_argv(
            "agent", "run", "--redis-url", redis_url, "--node-id", node_id, "--port", str(port),
            "--llama-server", str(self.binary), "--model", str(self.model), "--parallel", str(parallel),
            "--ctx-per-slot", str(ctx_per_slot), "--llama-log", str(self.logs / f"llama-{node_id}.log"),
            *extra, "--", "-t", "1", *llama_args,
        )

    def agent(self, stack: Stack, redis_url: str, node_id: str, parallel: int, ctx_per_slot: int,
              *extra: str, llama_args: tuple[str, ...] = ()) -> Proc:
        """Start ``agent_argv``'s agent on ``stack``, once it serves ``/status`` (its fields say when its
        llama-server does)."""
        def start(port: int) -> Proc:
            argv = self.agent_argv(redis_url, node_id, port, parallel, ctx_per_slot, *extra,
                                   llama_args=llama_args)
            return stack.spawn(f"agent-{node_id}", argv, port, ready="/status")

        return stack.on_free_port(start)


def real_setup(redis_server: str, tmp_path_factory: pytest.TempPathFactory, name: str) -> RealSetup:
    """The llama-server binary (built and cached; a skip or, in CI, a failure if missing), the tiny model, an
    empty Redis, and a logs folder for one test module's pool."""
    binary = require_llama_server()
    model = tiny_model.ensure("tiny")
    client = redis.Redis.from_url(redis_server)
    client.flushall()
    client.close()
    return RealSetup(binary, model, tmp_path_factory.mktemp(f"{name}-logs"))


def wait_until(check: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
    """tests.conftest.wait_until, where a llama-server between processes also counts as "not yet"."""
    not_yet = (httpx.HTTPError, psutil.Error, KeyError, ValueError)
    return shared_wait_until(check, timeout, what, ignore=not_yet)


@dataclass
class Node:
    node_id: str
    cap: int | None
    agent: Child
    url: str

    @property
    def effective_cap(self) -> int:
        return self.cap if self.cap is not None else PARALLEL

    def status(self) -> dict[str, Any]:
        response = httpx.get(self.url + "/status", timeout=5)
        response.raise_for_status()
        data: dict[str, Any] = response.json()
        return data

    def llama_server(self) -> psutil.Process:
        """The llama-server process this agent supervises (its only llama-server child)."""
        children = psutil.Process(self.agent.pid).children(recursive=True)
        servers = [p for p in children if "llama-server" in p.name() and p.status() != psutil.STATUS_ZOMBIE]
        if len(servers) != 1:
            raise ValueError(f"{self.node_id}: expected one llama-server child, found {len(servers)}")
        return servers[0]

    def llama_url(self) -> str:
        argv = self.llama_server().cmdline()
        return f"http://127.0.0.1:{argv[argv.index('--port') + 1]}"


@dataclass
class Pool:
    redis_url: str
    router_url: str
    router: Child
    model_path: Path
    nodes: list[Node] = field(default_factory=list)

    @property
    def capacity(self) -> int:
        return sum(node.effective_cap for node in self.nodes)

    def pool_view(self) -> dict[str, Any]:
        data: dict[str, Any] = httpx.get(self.router_url + "/api/pool", timeout=5).json()
        return data

    def ready_nodes(self) -> set[str]:
        return {n["node_id"] for n in self.pool_view()["nodes"] if n["state"] == "ready"}

    def wait_all_ready(self, timeout: float = 60.0) -> None:
        want = {node.node_id for node in self.nodes}
        wait_until(lambda: self.ready_nodes() == want, timeout, f"nodes {sorted(want)} ready in the router")


@pytest.fixture(scope="module")
def pool(redis_server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    setup = real_setup(redis_server, tmp_path_factory, "e2e")
    with Stack(logs=setup.logs, keep_logs=True, stop_timeout=15) as stack:
        router = stack.router(
            "router", redis_server, "--queue-size", str(QUEUE_SIZE), "--queue-timeout", str(QUEUE_TIMEOUT),
            wait=False,
        )
        result = Pool(redis_server, router.url, router.child, setup.model)
        for node_id, cap in NODE_CAPS.items():
            extra = ("--cap", str(cap)) if cap is not None else ()
            agent = setup.agent(stack, redis_server, node_id, PARALLEL, CTX_PER_SLOT, *extra)
            result.nodes.append(Node(node_id, cap, agent.child, agent.url))
        stack.wait_serving(router, timeout=30)
        stack.wait_serving(timeout=60)
        result.wait_all_ready(timeout=90)
        yield result
