"""The store's API for synchronous tests: every call runs to completion on one private event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import redis
from redis.cluster import ClusterNode

from macpool.store import Keys, Store
from macpool.store.connect import connect, parse

T = TypeVar("T")


class BlockingStore:
    """``run(store.reserve(...))`` and so on, where ``store`` talks to the Redis at ``url``."""

    def __init__(self, url: str, keys: Keys | None = None) -> None:
        self._runner = asyncio.Runner()
        self.connection = connect(url, decode_responses=True)
        self.store = Store(self.connection.client, keys)

    def run(self, call: Coroutine[Any, Any, T]) -> T:
        return self._runner.run(call)

    def close(self) -> None:
        self._runner.run(self.connection.aclose())
        self._runner.close()


def sync_redis(url: str) -> redis.Redis | redis.RedisCluster:
    """A synchronous client (decoding replies) for any URL macpool/store/connect.py takes but Sentinel's."""
    target = parse(url)
    if target.kind == "cluster":
        nodes = [ClusterNode(host, port) for host, port in target.hosts]
        return redis.RedisCluster(startup_nodes=nodes, decode_responses=True)
    return redis.Redis.from_url(url, decode_responses=True)
