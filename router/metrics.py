"""The router's Prometheus metrics, on a registry the app owns."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

if TYPE_CHECKING:
    from router.dialects import Usage

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300)
_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "macpool_requests_total", "Requests by model, node and final status",
            ["model", "node", "status"], registry=r,
        )
        self.rejections = Counter(
            "macpool_rejections_total", "503 rejections by reason", ["reason"], registry=r
        )
        self.queue_depth = Gauge("macpool_queue_depth", "Requests waiting in the global queue", registry=r)
        self.queue_wait = Histogram(
            "macpool_queue_wait_seconds", "Time a queued request waited, by priority class and tenant",
            ["priority", "tenant"], buckets=_WAIT_BUCKETS, registry=r,
        )
        self.queued = Gauge(
            "macpool_queued", "Requests waiting in the global queue by priority class and tenant",
            ["priority", "tenant"], registry=r,
        )
        self.tenant_in_flight = Gauge(
            "macpool_tenant_in_flight", "Requests in flight per tenant (API key), across routers", ["tenant"],
            registry=r,
        )
        self.key_limited = Counter(
            "macpool_key_limited_total", "429 answers: the API key was at its concurrency limit", ["tenant"],
            registry=r,
        )
        self.affinity = Counter(
            "macpool_affinity_total",
            "Prefix-affinity lookups: hit (sent to the node holding the prompt prefix), miss (no node holds "
            "it), overridden (that node was full or too busy)", ["outcome"], registry=r,
        )
        self.ttft = Histogram(
            "macpool_ttft_seconds", "Arrival to first upstream byte", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.duration = Histogram(
            "macpool_request_duration_seconds", "Arrival to end of response",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.upstream_errors = Counter(
            "macpool_upstream_errors_total", "Upstream failures by node and kind", ["node", "kind"],
            registry=r,
        )
        self.pool_slots = Gauge(
            "macpool_pool_slots", "Pool slots (total capacity, busy)", ["state"], registry=r
        )
        self.nodes = Gauge("macpool_nodes", "Nodes by heartbeat state", ["state"], registry=r)
        self.saturation = Gauge(
            "macpool_pool_saturation", "(busy + queued) / capacity of the pool", registry=r
        )
        self.redis_up = Gauge(
            "macpool_redis_up",
            "1 when the router's last read of the pool from Redis succeeded; 0 while Redis is unreachable "
            "(the pool gauges then hold the last view)", registry=r,
        )
        self.tokens = Counter(
            "macpool_tokens_total",
            "Tokens of the answers served, from each API's own usage fields: prompt (every prompt token), "
            "cached (of those, read from a KV cache instead of processed) and completion",
            ["model", "kind"], registry=r,
        )

    def count_usage(self, model: str, usage: Usage) -> None:
        self.tokens.labels(model=model, kind="prompt").inc(usage.prompt)
        self.tokens.labels(model=model, kind="cached").inc(usage.cached)
        self.tokens.labels(model=model, kind="completion").inc(usage.completion)
