"""A real pool for fault, abuse and security tests: one Redis, simulators behind agents, routers.

They are real processes (``spawn`` from the root conftest stops them all at the end of each test), or
servers in this process (tests/inprocess.py) for a test marked ``in_process``.
Heartbeats are fast (0.3 s, TTL about 1 s) so nodes leave the pool quickly when they die.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis

from macpool.contract import now_ms
from macpool.dev.redis_server import RedisServer
from macpool.dev.stack import Stack
from macpool.store import Keys
from tests.conftest import Node as Node
from tests.conftest import Server, in_process, spawner
from tests.conftest import chat as chat
from tests.conftest import wait_until as wait_until
from tests.inprocess import LocalStack

AGENT_TOKEN = "reliability-agent-token-7f3a"
ADMIN_KEY = "reliability-admin-key-91c2"
PRESET = "m5max-128g-14b-q4"
HEARTBEAT = "0.3"
START_TIMEOUT_S = 30.0
# what must never appear in anything a client receives
LEAK_MARKERS = ("Traceback", 'File "', AGENT_TOKEN, "x-macpool-token")





def assert_clean(text: str | bytes, *internal: str) -> None:
    """Nothing internal in what a client received: no traceback, no token, no node URL."""
    body = text.decode(errors="replace") if isinstance(text, bytes) else text
    for marker in (*LEAK_MARKERS, *internal):
        assert marker not in body, f"{marker!r} leaked to a client: {body[:500]!r}"




def sse_events(raw: bytes) -> list[dict[str, Any]]:
    """The JSON payloads of an SSE body (``[DONE]`` skipped)."""
    events = []
    for line in raw.decode(errors="replace").splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line[6:]))
    return events




class Rig:
    """Builds the servers of one test against one Redis, on the test's process harness or (``servers``) in
    this process; ``spawn`` always starts a process."""

    def __init__(self, stack: Stack, redis_url: str, servers: Stack | LocalStack | None = None) -> None:
        self.stack = servers or stack
        self.spawn = spawner(stack)
        self.redis_url = redis_url
        self.keys = Keys()

    def sim(
        self, node_id: str, *args: str, parallel: int = 8, speed: float = 20.0, ready_path: str = "/health"
    ) -> Server:
        return self.stack.sim(
            f"sim-{node_id}", "--preset", PRESET, "--parallel", str(parallel), "--speed", str(speed), *args,
            ready=ready_path, timeout=START_TIMEOUT_S,
        )

    def agent(
        self,
        node_id: str,
        upstream: str,
        *args: str,
        cap: int = 2,
        redis_url: str | None = None,
        port: int | None = None,
        ready_path: str | None = "/health",
    ) -> Server:
        return self.stack.agent(
            f"agent-{node_id}", upstream, redis_url or self.redis_url, node_id, "--cap", str(cap),
            "--token", AGENT_TOKEN, "--heartbeat-interval", HEARTBEAT, *args,
            port=port, ready=ready_path, timeout=START_TIMEOUT_S,
        )

    def node(
        self,
        node_id: str,
        cap: int = 2,
        *,
        speed: float = 20.0,
        sim_args: tuple[str, ...] = (),
        agent_args: tuple[str, ...] = (),
        redis_url: str | None = None,
    ) -> Node:
        sim = self.sim(node_id, *sim_args, parallel=max(cap * 2, 4), speed=speed)
        agent = self.agent(node_id, sim.url, *agent_args, cap=cap, redis_url=redis_url)
        return Node(node_id, sim, agent)

    def router(
        self, *args: str, redis_url: str | None = None, port: int | None = None, name: str = "router"
    ) -> Server:
        return self.stack.router(
            name, redis_url or self.redis_url, "--agent-token", AGENT_TOKEN, "--admin-key", ADMIN_KEY,
            "--stale-after", "2", "--refresh-interval", "0.5", *args, port=port, timeout=START_TIMEOUT_S,
        )

    @staticmethod
    def pool_doc(router: Server) -> dict[str, Any]:
        data: dict[str, Any] = httpx.get(router.url + "/api/pool", timeout=5).json()
        return data

    def wait_ready(
        self, router: Server, nodes: int, timeout: float = 30.0, key: str | None = None
    ) -> dict[str, Any]:
        return self.stack.wait_nodes(router.url, nodes, timeout=timeout, exact=True, key=key)

    @staticmethod
    def model(router: Server) -> str:
        name: str = httpx.get(router.url + "/v1/models", timeout=5).json()["data"][0]["id"]
        return name

    def store(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis_url)

    def reservations(self, node_id: str, redis_url: str | None = None) -> int:
        """Reservations on ``node_id`` still in Redis (live or not yet pruned)."""
        client = redis.Redis.from_url(redis_url or self.redis_url)
        try:
            return int(client.zcard(self.keys.reservations(node_id)))
        finally:
            client.close()

    def live_reservations(self, node_id: str) -> int:
        with self.store() as client:
            return int(client.zcount(self.keys.reservations(node_id), now_ms(), "+inf"))


@pytest.fixture
def rig(request: pytest.FixtureRequest, stack: Stack, redis_url: str) -> Rig:
    return Rig(stack, redis_url, in_process(request))


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A Redis on a fixed port, so the restarted (empty) server is where everyone expects it."""
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.close()
