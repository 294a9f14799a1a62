"""The scale hint: how many Macs the pool should have for the demand it sees, with hysteresis.

demand = busy + queued + the concurrency the pool turned away (503s per second times the mean time a
request holds a slot, by Little's law: busy / requests per second). desired = ceil(demand / (typical
per-node capacity x target utilisation)). Going up needs the higher figure to hold for ``up_delay``;
going down needs demand to fit under a lower utilisation for ``down_delay`` - so a pool at the
edge does not flap (the knobs: macpool/scaling.py).

:class:`ScaleWatch` samples the router's pool view, keeps a rolling history for the dashboard's
sparklines and the current hint, and (with a webhook URL) POSTs the hint when ``desired_nodes``
changes: debounced, retried with backoff, at most one delivery in flight and only the latest pending.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import math
import statistics
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    RetryError,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential_jitter,
)

from macpool.loops import wait_event
from macpool.scaling import ScalePolicy, demand_of, number
from router.settings import Settings

log = logging.getLogger("macpool.router.scale")

PoolSource = Callable[[], dict[str, Any] | Awaitable[dict[str, Any]]]


@dataclass(frozen=True)
class ScaleConfig:
    """How the hint is computed and delivered (defaults suit a pool of a few Macs)."""

    policy: ScalePolicy = field(default_factory=ScalePolicy)
    default_node_capacity: int = 8  # used while no node is in the pool
    webhook_url: str = ""
    webhook_debounce_s: float = 5.0
    webhook_timeout_s: float = 5.0
    webhook_attempts: int = 4
    webhook_backoff_s: float = 0.5  # the first wait between attempts; each next one doubles, up to 10 s
    sample_interval_s: float = 0.5
    history_s: float = 600.0

    @classmethod
    def from_settings(cls, settings: Settings) -> ScaleConfig:
        """The hint's policy and webhook from the router's settings (``--scale-*``); the rest keep their
        defaults."""
        return cls(policy=settings.policy(), webhook_url=settings.scale_webhook or "")


@dataclass(frozen=True)
class ScaleHint:
    current_nodes: int
    desired_nodes: int
    saturation: float
    reason: str
    demand: float = 0.0
    node_capacity: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "current_nodes": self.current_nodes,
            "desired_nodes": self.desired_nodes,
            "saturation": round(self.saturation, 4),
            "reason": self.reason,
            "demand": round(self.demand, 2),
            "node_capacity": round(self.node_capacity, 2),
        }


def typical_capacity(nodes: list[dict[str, Any]]) -> float | None:
    """Median capacity of the ready nodes (one Mac under pressure would skew a mean)."""
    caps = [
        float(n.get("capacity") or 0)
        for n in nodes
        if not n.get("drained") and n.get("state") == "ready" and (n.get("capacity") or 0) > 0
    ]
    return statistics.median(caps) if caps else None


class ScaleAdvisor:
    """Turns pool observations into a desired node count, with time-based hysteresis."""

    def __init__(self, config: ScaleConfig) -> None:
        self.config = config
        self.desired: int | None = None
        self._up_since: float | None = None
        self._down_since: float | None = None
        self._down_peak = 0
        self._per_node = float(config.default_node_capacity)

    def _clamp(self, n: int) -> int:
        return max(self.config.policy.min_nodes, min(self.config.policy.max_nodes, n))

    def observe(self, view: dict[str, Any], now: float) -> ScaleHint:
        cfg = self.config.policy
        pool = view.get("pool") or {}
        nodes = [n for n in view.get("nodes") or [] if isinstance(n, dict)]
        current = int(number(pool, "nodes_ready"))
        # with no ready node, keep the last figure seen rather than guessing afresh
        self._per_node = typical_capacity(nodes) or self._per_node
        per_node = self._per_node
        demand, rejected = demand_of(pool)
        up = self._clamp(math.ceil(demand / (per_node * cfg.target_utilisation)))
        down = self._clamp(math.ceil(demand / (per_node * cfg.low_utilisation)))
        if self.desired is None:
            self.desired = self._clamp(max(current, up))
        busy, queued = number(pool, "busy"), number(pool, "queued")
        why = (
            f"demand {demand:.1f} slots (busy {busy:.0f} + queued {queued:.0f}"
            f" + turned away {rejected:.1f}) over {per_node:.0f} slots/node"
        )
        reason = f"{why}: {self.desired} node(s) hold it"
        if up > self.desired:
            self._down_since = None
            self._up_since = now if self._up_since is None else self._up_since
            if now - self._up_since >= cfg.up_delay:
                self.desired, self._up_since = up, None
                reason = f"{why} at {cfg.target_utilisation:.0%} target: scale up to {up}"
            else:
                reason = f"{why}: above target, scale up to {up} if it lasts {cfg.up_delay:.0f}s"
        elif down < self.desired:
            self._up_since = None
            if self._down_since is None:
                self._down_since, self._down_peak = now, down
            self._down_peak = max(self._down_peak, down)
            if now - self._down_since >= cfg.down_delay:
                self.desired, self._down_since = self._down_peak, None
                reason = f"{why} fits under {cfg.low_utilisation:.0%}: scale down to {self.desired}"
            else:
                reason = (
                    f"{why}: below {cfg.low_utilisation:.0%}, scale down if it lasts {cfg.down_delay:.0f}s"
                )
        else:
            self._up_since = self._down_since = None
        return ScaleHint(current, self.desired, number(pool, "saturation"), reason, demand, per_node)


class _Refused(Exception):
    """The webhook answered, but not with a 2xx."""


class ScaleWebhook:
    """POST the scale document when desired_nodes changes: debounced, retried, bounded.

    Only the latest document is kept; one delivery runs at a time; each is tried ``attempts`` times
    with exponential backoff (with jitter, so that routers sharing a webhook do not retry in step) and a
    per-attempt timeout, then dropped with a log line.
    """

    def __init__(self, config: ScaleConfig, client: httpx.AsyncClient | None = None) -> None:
        self.config = config
        self._client = client
        self._pending: dict[str, Any] | None = None
        self._due = 0.0
        self._sent_desired: int | None = None
        self._task: asyncio.Task[None] | None = None
        self.delivered: list[dict[str, Any]] = []  # last few, for status pages and tests

    def offer(self, hint: ScaleHint, now: float) -> None:
        if hint.desired_nodes == self._sent_desired:
            self._pending = None
            return
        if self._pending is None or self._pending["desired_nodes"] != hint.desired_nodes:
            self._due = now + self.config.webhook_debounce_s
        self._pending = hint.as_dict()
        if now >= self._due and (self._task is None or self._task.done()):
            doc, self._pending = self._pending, None
            self._task = asyncio.create_task(self._deliver(doc))

    async def _deliver(self, doc: dict[str, Any]) -> None:
        cfg = self.config
        client = self._client or httpx.AsyncClient(timeout=cfg.webhook_timeout_s)
        backoff = cfg.webhook_backoff_s
        retrying = AsyncRetrying(
            stop=stop_after_attempt(cfg.webhook_attempts),
            wait=wait_exponential_jitter(multiplier=backoff, max=10.0, jitter=backoff),
            retry=retry_if_exception_type((httpx.HTTPError, _Refused)),
            after=self._attempt_failed,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    response = await client.post(cfg.webhook_url, json=doc, timeout=cfg.webhook_timeout_s)
                    if response.status_code >= 300:
                        raise _Refused(f"HTTP {response.status_code}")
            self._sent_desired = int(doc["desired_nodes"])
            self.delivered = [*self.delivered[-9:], doc]
        except RetryError:
            log.error("scale webhook gave up on desired_nodes=%s", doc["desired_nodes"])
        finally:
            if self._client is None:
                await client.aclose()

    def _attempt_failed(self, state: RetryCallState) -> None:
        assert state.outcome is not None  # called after an attempt, which failed
        exc = state.outcome.exception()
        failure = str(exc) if isinstance(exc, _Refused) else f"{type(exc).__name__}: {exc}"
        attempts = self.config.webhook_attempts
        log.warning("scale webhook attempt %d/%d failed: %s", state.attempt_number, attempts, failure)

    async def aclose(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


@dataclass
class Frame:
    """One sample: the pool view, the hint, and the history point it added (if any)."""

    view: dict[str, Any]
    hint: ScaleHint
    point: dict[str, Any] | None = None


@dataclass
class ScaleWatch:
    """Samples the pool view for the dashboard and the scale hint; shared by every viewer.

    Viewers call :meth:`sample`; samples closer than ``sample_interval_s`` reuse the last one, so ten
    open dashboards cost what one does. :meth:`running` keeps sampling without viewers (continuous
    sparklines, webhook delivery) - run it in the router's lifespan.
    """

    source: PoolSource
    config: ScaleConfig = field(default_factory=ScaleConfig)
    clock: Callable[[], float] = time.monotonic
    advisor: ScaleAdvisor = field(init=False)
    webhook: ScaleWebhook | None = field(init=False)
    history: deque[dict[str, Any]] = field(init=False)
    _last: Frame | None = field(init=False, default=None)
    _last_at: float = field(init=False, default=-math.inf)
    _lock: asyncio.Lock = field(init=False, default_factory=asyncio.Lock)

    def __post_init__(self) -> None:
        self.advisor = ScaleAdvisor(self.config)
        self.webhook = ScaleWebhook(self.config) if self.config.webhook_url else None
        self.history = deque(maxlen=max(1, int(self.config.history_s)))  # one point a second

    async def sample(self) -> Frame:
        async with self._lock:
            now = self.clock()
            if self._last is not None and now - self._last_at < self.config.sample_interval_s * 0.9:
                return Frame(self._last.view, self._last.hint)
            result = self.source()
            view = await result if inspect.isawaitable(result) else result
            hint = self.advisor.observe(view, now)
            point = self._record(view, hint)
            if self.webhook is not None:
                self.webhook.offer(hint, now)
            self._last, self._last_at = Frame(view, hint, point), now
            return self._last

    def _record(self, view: dict[str, Any], hint: ScaleHint) -> dict[str, Any] | None:
        pool = view.get("pool") or {}
        ts = int(view.get("ts_ms") or time.time() * 1000)
        if self.history and ts - self.history[-1]["ts_ms"] < 1000:
            return None
        point = {
            "ts_ms": ts,
            "saturation": round(number(pool, "saturation"), 4),
            "rejections_per_s": round(number(pool, "rejections_per_s"), 3),
            "requests_per_s": round(number(pool, "requests_per_s"), 3),
            "busy": int(number(pool, "busy")),
            "queued": int(number(pool, "queued")),
            "capacity": int(number(pool, "capacity")),
            "desired_nodes": hint.desired_nodes,
        }
        self.history.append(point)
        return point

    async def hint(self) -> dict[str, Any]:
        return (await self.sample()).hint.as_dict()

    async def run(self, stop: asyncio.Event) -> None:
        """Sample on a drift-free ticker until ``stop`` is set; one failed sample is logged, not fatal."""
        interval = self.config.sample_interval_s
        next_at = time.monotonic()
        while not stop.is_set():
            try:
                await self.sample()
            except Exception:  # the pool source is the router's; a bad sample must not end the loop
                log.exception("pool sample failed")
            next_at += interval
            delay = next_at - time.monotonic()
            if delay < 0:
                next_at, delay = time.monotonic(), 0.0
            await wait_event(stop, delay)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[ScaleWatch]:
        """``async with watch.running():`` in a lifespan: sample in the background, stop on exit."""
        stop = asyncio.Event()
        task = asyncio.create_task(self.run(stop))
        try:
            yield self
        finally:
            stop.set()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(task, 5.0)
            if self.webhook is not None:
                await self.webhook.aclose()
