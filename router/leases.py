"""This router's leases: each held until released exactly once, renewed while its request runs, and given
back until Redis answers when a call's outcome is not known."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

import anyio

from macpool.contract import NodeDoc
from macpool.loops import every
from macpool.store import ANONYMOUS, AffinityOutcome, Release, Store
from macpool.store import Lease as StoredLease
from router.placement import prompt_seconds
from router.pool import PoolView
from router.retry_after import RetryAfter
from router.settings import Settings

log = logging.getLogger("macpool.router")

# how often a reservation that may have been made after its call timed out is given back, until Redis answers
UNDO_RETRY_S = 1.0


@dataclass(eq=False)
class Lease:
    """The slots one request reserved on one node, held until released exactly once."""

    request_id: str
    node: NodeDoc
    tenant: str = ANONYMOUS
    slots: int = 1  # one per generation it runs at once (0: not known - however many it holds)
    tokens: int = 0  # of the node's KV cache, as its reservation said (0: none counted)
    acquired_at: float = field(default_factory=time.monotonic)
    released: bool = False
    queued_s: float = 0.0
    affinity: AffinityOutcome = ""
    local: bool = False  # taken while Redis was unreachable: counted by this router only
    # the prompt tokens the node is expected to process for it (what its cache does not hold), from
    # ``prefill_from`` tokens into the prompt (what it holds), until the answer's first event says it has:
    # they weigh on where the next requests go (backlog_s)
    prefill_tokens: int = 0
    prefill_from: int = 0

    def stored(self, router: str) -> StoredLease:
        """What this lease holds in Redis, for ``router``."""
        return StoredLease(self.request_id, self.node.node_id, self.tenant, self.slots, router, self.tokens)


class Leases:
    """The leases this router holds (``active``), and the releases on their way to Redis."""

    def __init__(self, settings: Settings, store: Store, pool: PoolView, retry_after: RetryAfter) -> None:
        self.settings = settings
        self.store = store
        self.pool = pool
        self.retry_after = retry_after
        self.lease_ms = max(int(settings.lease_seconds * 1000), 1)
        self.active: dict[str, Lease] = {}
        self._releasing = 0  # releases on their way to Redis (waited for at shutdown: Admission.settle)
        self._undoing: set[asyncio.Future[None]] = set()  # give-backs retried until Redis answers
        self._renewer: asyncio.Task[None] | None = None

    def start(self) -> None:
        interval = self.settings.lease_seconds / 3
        self._renewer = asyncio.create_task(every(interval, self.renew_all, "lease renewal", log))

    def busy(self) -> bool:
        """Whether a lease is held or a release is on its way to Redis."""
        return bool(self.active or self._releasing)

    async def stop(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewer
            self._renewer = None
        for task in list(self._undoing):  # (give-backs still waiting for Redis: their leases expire)
            task.cancel()
        await asyncio.gather(*self._undoing, return_exceptions=True)

    def backlog_s(self, node: NodeDoc) -> float:
        """How long ``node`` should still take to process the prompts this router sent it that it has not
        answered yet, at its measured prompt speed (router/placement.py ``prompt_seconds``): their time,
        less the time since the first of them was sent (the node has been at it since)."""
        rate = node.prefill_tokens_per_s or 0.0
        if rate <= 0:
            return 0.0
        seconds, since = 0.0, time.monotonic()
        for lease in self.active.values():
            if lease.prefill_tokens and lease.node.node_id == node.node_id:
                seconds += prompt_seconds(lease.prefill_tokens, rate, node.prefill_depth, lease.prefill_from)
                since = min(since, lease.acquired_at)
        return max(0.0, seconds - (time.monotonic() - since)) if seconds else 0.0

    def hold(self, lease: Lease) -> Lease:
        """A lease just taken: renewed from now on, until released."""
        self.active[lease.request_id] = lease
        return lease

    async def release(self, lease: Lease, failed: bool = False) -> None:
        """Give the slot back (exactly once; safe to call again, and from a cancelled task). A slot the
        node ``failed`` on is not handed to a queued request, who would only meet the same failure."""
        if lease.released:
            return
        lease.released = True
        self.active.pop(lease.request_id, None)
        if not failed:
            self.retry_after.held(lease.acquired_at)
        if lease.local:
            self.pool.freed.mark()
            return
        node_id = lease.node.node_id
        self._releasing += 1
        try:
            if not await self._release_in_redis(lease, node_id, failed):
                # Redis did not answer: the release may never have reached it (its connection was dropped)
                self.give_back(lease.request_id, [node_id], lease.tenant, dropped=True, warn=False,
                               failed=failed)
        finally:
            self._releasing -= 1

    async def _release_in_redis(self, lease: Lease, node_id: str, failed: bool, warn: bool = True) -> bool:
        """Release in Redis; False when Redis did not answer."""
        failure = "TimeoutError"
        with anyio.move_on_after(5, shield=True):
            try:
                release = Release(lease.request_id, node_id, lease.tenant, lease.slots, failed,
                                  router=self.settings.router_id)
                await self.store.release(release)
                return True
            except Exception as exc:
                failure = type(exc).__name__
        if warn:
            ids = {"node": node_id, "lease": lease.request_id}
            log.warning("release of %s on %s failed (%s); retried until Redis answers, or the lease expires",
                        lease.request_id, node_id, failure, extra=ids)
        return False

    def give_back(
        self, request_id: str, node_ids: list[str], tenant: str, dropped: bool = False, warn: bool = True,
        failed: bool = False,
    ) -> None:
        """Release whatever ``request_id`` holds on ``node_ids`` (a release of nothing changes nothing).

        ``dropped``: the call being undone went on a connection given up for lost (a timeout), so its script
        may reach Redis after this release, on another connection: the release is tried every second until
        Redis answers, then once more a second later, and no longer than the lease it would undo. ``warn``:
        its first failure is logged (not when the caller's own release has just been). ``failed``: the node
        failed the request (its slots are not handed to a waiter, as in ``release``).
        """
        passes = 2 if dropped else 1
        deadline = time.monotonic() + self.lease_ms / 1000

        async def undo() -> None:
            try:
                left, done, warned = list(node_ids), 0, not warn
                while True:
                    for node_id in list(left):
                        lease = Lease(request_id, NodeDoc(node_id=node_id, url=""), tenant, slots=0)
                        if await self._release_in_redis(lease, node_id, failed, warn=not warned):
                            left.remove(node_id)
                    warned = True  # (one line per give-back, not one per retry)
                    if not left:
                        done += 1
                        left = list(node_ids)
                    if done == passes or not dropped or time.monotonic() >= deadline:
                        return
                    await asyncio.sleep(UNDO_RETRY_S)
            finally:
                self._releasing -= 1
                self._undoing.discard(task)

        self._releasing += 1
        task = asyncio.ensure_future(undo())
        self._undoing.add(task)  # (a reference, or the task may be collected before it runs)

    async def renew_all(self) -> None:
        """Renew every live lease held in Redis, in one round trip."""
        leases = [lease for lease in self.active.values() if not lease.local]
        if not leases:
            return
        stored = [lease.stored(self.settings.router_id) for lease in leases]
        recreated = await self.store.renew(stored, self.lease_ms)
        for lease, kept, again in zip(leases, stored, recreated, strict=True):
            if not again:
                continue
            if lease.released:
                # released while the renewal was on its way: if the release ran first, the renewal
                # brought the lease back - take it out again (a no-op if the release ran after it)
                await self.store.forget(kept)
                continue
            log.warning("lease %s on %s was gone from Redis (restarted empty, or the lease had expired); "
                        "counted again", lease.request_id, lease.node.node_id,
                        extra={"node": lease.node.node_id, "lease": lease.request_id})
