"""The agent's live state, shared by the gateway (which admits) and the heartbeat (which decides capacity)."""

from __future__ import annotations

import asyncio
import statistics
from collections import deque
from dataclasses import dataclass, field

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from macpool.contract import NODE_STATES, NodeDoc, NodeState

from .settings import AgentSettings
from .sizing import Sizing


class AgentMetrics:
    """The agent's own Prometheus registry (never the global default)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.in_flight = Gauge(
            "macpool_agent_in_flight_requests",
            "Requests in flight through the gateway, each generation counted (several prompts, n > 1)",
            registry=r,
        )
        self.capacity = Gauge("macpool_agent_capacity_requests", "Capacity the gateway enforces", registry=r)
        self.requests = Counter(
            "macpool_agent_requests_total",
            "Proxied requests by endpoint and status",
            ["endpoint", "status"],
            registry=r,
        )
        self.rejections = Counter(
            "macpool_agent_rejections_total",
            "Requests refused by the gateway, by reason",
            ["reason"],
            registry=r,
        )
        self.upstream_errors = Counter(
            "macpool_agent_upstream_errors_total", "Upstream connection failures", ["kind"], registry=r
        )
        self.ttft = Histogram(
            "macpool_agent_ttft_seconds",
            "Time to the first upstream byte of streamed responses",
            registry=r,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60),
        )
        self.heartbeat_failures = Counter(
            "macpool_agent_heartbeat_failures_total",
            "Heartbeats that could not be written to Redis",
            registry=r,
        )
        self.restarts = Counter(
            "macpool_agent_llama_server_restarts_total", "Restarts of the supervised llama-server", registry=r
        )
        self.pinned = Gauge("macpool_agent_pinned_memory_bytes", "Pinned (wired) memory", registry=r)
        self.wired_limit = Gauge("macpool_agent_wired_limit_bytes", "GPU wired-memory limit", registry=r)
        self.state = Gauge(
            "macpool_agent_state_info", "1 for the node's current state", ["state"], registry=r
        )
        self.superseded = Gauge(
            "macpool_agent_superseded",
            "1 while an agent started later holds this node id (this one gets no traffic), else 0",
            registry=r,
        )


@dataclass
class Runtime:
    """Mutable state of one agent process. Single event loop: plain ints are atomic between awaits."""

    settings: AgentSettings
    metrics: AgentMetrics = field(default_factory=AgentMetrics)
    http: httpx.AsyncClient | None = None
    upstream_transport: httpx.AsyncBaseTransport | None = None  # the one ``http`` uses
    upstream_url: str = ""
    state: NodeState = "starting"
    capacity: int = 0
    total_slots: int = 0  # llama-server's slots (/props), 0 until known
    admitting: bool = False  # false while starting, unhealthy, draining or under memory pressure
    in_flight: int = 0
    doc: NodeDoc | None = None
    details: dict[str, object] = field(default_factory=dict)  # extra /status figures (probe, GGUF, ...)
    sizing: Sizing | None = None  # supervise mode: llama-server's slots and why
    ttft_samples: deque[float] = field(default_factory=lambda: deque(maxlen=256))
    # set to publish a heartbeat now rather than at the next tick (llama-server found dead)
    beat_now: asyncio.Event = field(default_factory=asyncio.Event)

    def upstream_lost(self) -> None:
        """llama-server stopped answering: admit nothing more and tell the routers at once, not at the next
        heartbeat (which also decides when it is back)."""
        self.admitting = False
        self.beat_now.set()

    def client(self) -> httpx.AsyncClient:
        if self.http is None:
            raise RuntimeError("the upstream client is not open")
        return self.http

    def transport(self) -> httpx.AsyncBaseTransport:
        """The client's transport, for the gateway's relayed requests (node_agent/gateway.py ``_send``)."""
        if self.upstream_transport is None:
            raise RuntimeError("the upstream client is not open")
        return self.upstream_transport

    def ttft_p50_ms(self) -> float | None:
        return statistics.median(self.ttft_samples) * 1000 if self.ttft_samples else None

    def set_state(self, state: NodeState) -> None:
        self.state = state
        for name in NODE_STATES:
            self.metrics.state.labels(name).set(1 if name == state else 0)
