"""What the router's /metrics tells an operator when Redis goes away and comes back."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx

from macpool.dev.redis_server import RedisServer, free_port
from tests.conftest import metric
from tests.operator.helpers import wait_until


def test_the_router_exports_whether_it_reaches_redis(spawn: Callable[..., Any]) -> None:
    # the router serves from its last view while Redis is down, so every pool gauge keeps its last value:
    # macpool_redis_up is what says those figures are frozen
    port = free_port()
    with RedisServer(port=port) as redis:
        router = spawn("router", "--redis-url", redis.url, name="router")
        wait_until(lambda: metric(router.url, "macpool_redis_up") == 1, 10, "redis up")
    wait_until(lambda: metric(router.url, "macpool_redis_up") == 0, 10, "redis down")
    with RedisServer(port=port):
        wait_until(lambda: metric(router.url, "macpool_redis_up") == 1, 10, "redis up again")


def test_a_drain_while_redis_is_down_is_a_503_that_says_so(spawn: Callable[..., Any]) -> None:
    with RedisServer() as redis:
        router = spawn("router", "--redis-url", redis.url, "--admin-key", "admin-key-of-16-chars",
                       name="router")
    wait_until(lambda: metric(router.url, "macpool_redis_up") == 0, 10, "redis down")
    admin = {"Authorization": "Bearer admin-key-of-16-chars"}
    answer = httpx.post(f"{router.url}/admin/nodes/mac-1/undrain", headers=admin)
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["code"] == "pool_unavailable"
    assert "mac-1" in answer.json()["error"]["message"] and answer.headers["retry-after"] == "1"
    log = router.child.log_path.read_text()
    assert "Traceback" not in log and "undrain of node mac-1 failed: redis unreachable" in log
