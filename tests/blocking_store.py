"""The store's API for synchronous tests: every call runs to completion on one private event loop."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import redis
from redis.cluster import ClusterNode
from redis.sentinel import Sentinel

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


@contextlib.contextmanager
def sync_redis(url: str, decode_responses: bool = True) -> Iterator[redis.Redis | redis.RedisCluster]:
    """A synchronous client for any URL macpool/store/connect.py takes (Sentinel: the primary now), closed
    on leaving - with a Sentinel's clients of the sentinels, which the primary's client does not own."""
    target = parse(url)
    if target.kind == "sentinel":
        sentinels = {"socket_timeout": 2, **target.sentinel_options()}
        sentinel = Sentinel(list(target.hosts), sentinel_kwargs=sentinels, socket_timeout=2, db=target.db,
                            decode_responses=decode_responses, **target.data_options())
        try:
            with sentinel.master_for(target.service) as primary:
                yield primary
        finally:
            sentinel.close()
        return
    if target.kind == "cluster":
        nodes = [ClusterNode(host, port) for host, port in target.hosts]
        with redis.RedisCluster(startup_nodes=nodes, decode_responses=decode_responses,
                                **target.data_options()) as cluster:
            yield cluster
        return
    with redis.Redis.from_url(target.server_url, decode_responses=decode_responses,
                              **target.tls_options()) as client:
        yield client
