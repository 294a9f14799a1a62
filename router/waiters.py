"""This router's queued requests, waiting to be woken when a slot may be theirs."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from dataclasses import dataclass, field


@dataclass(eq=False)
class Waiter:
    request_id: str
    nodes: set[str]  # the nodes it may run on (those its last attempt offered)
    woken: asyncio.Event = field(default_factory=asyncio.Event)


class Waiters:
    """In arrival order; a freed slot wakes the first one that could take it, a message about one request
    (its slots were handed over, or its place was taken) wakes that one."""

    def __init__(self) -> None:
        self._queue: deque[Waiter] = deque()
        self._by_id: dict[str, Waiter] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def add(self, request_id: str, nodes: set[str]) -> Waiter:
        waiter = Waiter(request_id, nodes)
        self._queue.append(waiter)
        self._by_id[request_id] = waiter
        return waiter

    def remove(self, waiter: Waiter) -> None:
        with contextlib.suppress(ValueError):
            self._queue.remove(waiter)
        self._by_id.pop(waiter.request_id, None)

    def wake(self, node_id: str) -> None:
        """A slot was freed on ``node_id`` (and no queued request was handed it): wake one waiter to look."""
        for waiter in self._queue:
            if not waiter.woken.is_set() and (node_id in waiter.nodes or not waiter.nodes):
                waiter.woken.set()
                return

    def wake_request(self, request_id: str) -> None:
        """A release handed ``request_id`` a slot, or an interactive request took its place."""
        waiter = self._by_id.get(request_id)
        if waiter is not None:
            waiter.woken.set()
