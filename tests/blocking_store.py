"""The store's API for synchronous tests: every call runs to completion on one private event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from redis.asyncio import Redis

from macpool.store import Keys, Store

T = TypeVar("T")


class BlockingStore:
    """``run(store.reserve(...))`` and so on, where ``store`` talks to the Redis at ``url``."""

    def __init__(self, url: str, keys: Keys | None = None) -> None:
        self._runner = asyncio.Runner()
        self.store = Store(Redis.from_url(url, decode_responses=True), keys)

    def run(self, call: Coroutine[Any, Any, T]) -> T:
        return self._runner.run(call)

    def close(self) -> None:
        self._runner.run(self.store.redis.aclose())
        self._runner.close()
