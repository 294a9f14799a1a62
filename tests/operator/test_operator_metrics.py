"""What the router's /metrics tells an operator when Redis goes away and comes back."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from macpool.redis_server import RedisServer, free_port
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
