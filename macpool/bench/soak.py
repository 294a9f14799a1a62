"""``macpool bench soak``: a pool held at 1.5x its capacity for minutes while its nodes churn.

Starts a real Redis-protocol server, ``--nodes`` simulators each behind an agent (cap ``--cap``), and one
router.
Closed-loop streaming clients (1.5 x the pool's capacity) run for ``--duration`` seconds while a churn loop
restarts agents (SIGTERM, then a fresh process on the same port) and drains and undrains nodes through the
admin API. At the end it checks what must hold after any amount of churn:

- no client saw an error other than 503 (a 503 must carry Retry-After);
- the router's RSS grew less than 10% from the end of the warm-up to the end;
- every reservation, the queue, the router's busy count, every agent's in-flight count and every simulator's
  processing count are back to zero.

Prints the figures and writes them as JSON (``--json``); exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import secrets
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import redis

from macpool.bench.sse import Events, delta_text
from macpool.dev.stack import Proc, Stack, free_port
from macpool.sim import tokens
from macpool.store import Keys

AGENT_TOKEN = "soak-agent-token-of-the-pool"
ADMIN_KEY = "soak-admin-key-of-the-pool"
PRESET = "m5max-128g-14b-q4"


@dataclass
class SoakOptions:
    duration_s: float = 600.0
    nodes: int = 3
    cap: int = 4
    overload: float = 1.5
    speed: float = 6.0
    prompt_tokens: int = 256
    max_tokens: int = 48
    churn_every_s: float = 20.0
    warmup_s: float = 30.0
    log_dir: Path | None = None


@dataclass
class SoakResult:
    duration_s: float
    clients: int
    capacity: int
    requests: int = 0
    ok: int = 0
    rejected_503: int = 0
    retry_after_missing: int = 0
    errors_non_503: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)
    tokens: int = 0
    churn: dict[str, int] = field(default_factory=dict)
    rss_warm_mb: float = 0.0
    rss_end_mb: float = 0.0
    rss_max_mb: float = 0.0
    rss_growth: float = 0.0
    leftover: dict[str, Any] = field(default_factory=dict)
    checks: dict[str, bool] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(self.checks.values())


@dataclass
class SoakNode:
    node_id: str
    sim: Proc
    agent_port: int  # the same across restarts: the router knows the node by its URL
    agent: Proc | None = None

    @property
    def sim_url(self) -> str:
        return self.sim.url

    @property
    def agent_url(self) -> str:
        return f"http://127.0.0.1:{self.agent_port}"


class SoakPool:
    """Every process of one soak, on the process harness; ``close()`` stops them all."""

    def __init__(self, options: SoakOptions, log_dir: Path) -> None:
        self.options = options
        self.stack = Stack(logs=log_dir, keep_logs=True)
        self.redis_url = ""
        self.nodes: list[SoakNode] = []
        self.router: Proc | None = None

    @property
    def router_url(self) -> str:
        return self.router.url if self.router is not None else ""

    def start(self) -> None:
        opts = self.options
        self.redis_url = self.stack.redis()
        for i in range(opts.nodes):
            node_id = f"soak-{i}"
            sim = self.stack.sim(
                f"sim-{node_id}", "--preset", PRESET, "--parallel", str(opts.cap * 2),
                "--speed", str(opts.speed),
            )
            node = SoakNode(node_id, sim, free_port())
            self.start_agent(node, wait=False)
            self.nodes.append(node)
        self.router = self.stack.router(
            "router", self.redis_url, "--agent-token", AGENT_TOKEN, "--admin-key", ADMIN_KEY,
            "--queue-size", str(opts.cap), "--queue-timeout", "1", "--lease-seconds", "15",
            "--circuit-cooldown", "1", wait=False,
        )
        self.stack.wait_serving(timeout=60)
        self.stack.wait_nodes(self.router_url, len(self.nodes), timeout=60)

    def pool_doc(self) -> dict[str, Any]:
        data: dict[str, Any] = httpx.get(self.router_url + "/api/pool", timeout=10).json()
        return data

    def start_agent(self, node: SoakNode, wait: bool = True) -> None:
        node.agent = self.stack.agent(
            f"agent-{node.node_id}", node.sim_url, self.redis_url, node.node_id, "--token", AGENT_TOKEN,
            "--heartbeat-interval", "0.5", "--drain-timeout", "10", port=node.agent_port, wait=wait,
        )

    def restart_agent(self, node: SoakNode) -> None:
        if node.agent is not None:
            node.agent.child.stop(timeout=20)
        self.start_agent(node)

    def admin(self, node: SoakNode, action: str) -> int:
        response = httpx.post(
            f"{self.router_url}/admin/nodes/{node.node_id}/{action}",
            headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=10,
        )
        return response.status_code

    def router_rss(self) -> float:
        assert self.router is not None
        return psutil.Process(self.router.pid).memory_info().rss / 1e6

    def close(self) -> None:
        self.stack.stop()


async def one_request(client: httpx.AsyncClient, body: dict[str, Any]) -> tuple[str, int, str | None]:
    """(outcome, tokens, retry_after): outcome is "ok", "503" or an error kind."""
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                kind = "503" if response.status_code == 503 else f"http_{response.status_code}"
                return kind, 0, response.headers.get("retry-after")
            count = 0
            events = Events(response)
            async for payload in events:
                if "error" in payload:
                    return "sse_error", count, None
                if delta_text(payload):
                    count += 1
            return ("ok" if events.done else "truncated"), count, None
    except httpx.HTTPError as exc:
        return type(exc).__name__, 0, None
    except ValueError:
        return "bad_json", 0, None


class Load:
    """Closed-loop streaming clients until ``stop`` is set."""

    def __init__(self, url: str, clients: int, options: SoakOptions, result: SoakResult) -> None:
        self.url = url
        self.clients = clients
        self.options = options
        self.result = result
        self.stop = asyncio.Event()
        self.run_id = secrets.token_hex(4)
        self.serial = 0
        self.kinds: Counter[str] = Counter()

    def body(self, client_id: int) -> dict[str, Any]:
        self.serial += 1
        salt = f"{self.run_id}-{client_id}-{self.serial}"
        return {
            "messages": tokens.chat_messages(self.options.prompt_tokens, salt=salt),
            "max_tokens": self.options.max_tokens, "ignore_eos": True, "stream": True,
        }

    async def run(self) -> None:
        # idle keep-alive connections expire well before the router's (uvicorn: 5 s), or a request may be
        # sent on a connection the router is closing at that moment (a client-side ReadError)
        limits = httpx.Limits(
            max_connections=self.clients + 4, max_keepalive_connections=self.clients, keepalive_expiry=2.0
        )
        timeout = httpx.Timeout(120.0, connect=10.0)
        async with httpx.AsyncClient(base_url=self.url, limits=limits, timeout=timeout) as client:
            await asyncio.gather(*(self.client(client, i) for i in range(self.clients)))

    async def client(self, client: httpx.AsyncClient, client_id: int) -> None:
        result = self.result
        while not self.stop.is_set():
            outcome, count, retry_after = await one_request(client, self.body(client_id))
            result.requests += 1
            result.tokens += count
            self.kinds[outcome] += 1
            if outcome == "ok":
                result.ok += 1
            elif outcome == "503":
                result.rejected_503 += 1
                if not retry_after:
                    result.retry_after_missing += 1
                await asyncio.sleep(min(float(retry_after or 1), 0.5) * (0.5 + 0.5 * (client_id % 2)))
            else:
                result.errors_non_503 += 1


async def churn(pool: SoakPool, options: SoakOptions, stop: asyncio.Event, counts: Counter[str],
                log: Callable[[str], None]) -> None:
    """Round robin: restart node k's agent, drain node k+1, undrain it - one step every ``churn_every_s``."""
    step = 0
    while True:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), options.churn_every_s)
            return
        action = ("restart", "drain", "undrain")[step % 3]
        node = pool.nodes[(step // 3 + (0 if action == "restart" else 1)) % len(pool.nodes)]
        if action == "restart":
            await asyncio.to_thread(pool.restart_agent, node)
        else:
            status = await asyncio.to_thread(pool.admin, node, action)
            if status != 200:
                counts[f"{action}_failed"] += 1
        counts[action] += 1
        log(f"churn: {action} {node.node_id}")
        step += 1


async def sample_rss(pool: SoakPool, samples: list[tuple[float, float]], stop: asyncio.Event) -> None:
    started = time.monotonic()
    while not stop.is_set():
        samples.append((time.monotonic() - started, pool.router_rss()))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 2.0)
    samples.append((time.monotonic() - started, pool.router_rss()))


def leftovers(pool: SoakPool) -> dict[str, Any]:
    """Every counter that must be back at zero once the load has stopped."""
    keys = Keys()
    store = redis.Redis.from_url(pool.redis_url)
    try:
        reservations = {n.node_id: int(store.zcard(keys.reservations(n.node_id))) for n in pool.nodes}
        queue = int(store.zcard(keys.queue))
    finally:
        store.close()
    in_flight = {}
    processing = {}
    for node in pool.nodes:
        in_flight[node.node_id] = httpx.get(node.agent_url + "/status", timeout=10).json()["in_flight"]
        processing[node.node_id] = httpx.get(node.sim_url + "/sim/stats", timeout=10).json()["processing"]
    totals = pool.pool_doc()["pool"]
    return {"reservations": reservations, "queue": queue, "router_busy": totals["busy"],
            "router_queued": totals["queued"], "agent_in_flight": in_flight, "sim_processing": processing}


def all_zero(left: dict[str, Any]) -> bool:
    values: list[int] = []
    for value in left.values():
        values += list(value.values()) if isinstance(value, dict) else [value]
    return all(v == 0 for v in values)


async def soak(options: SoakOptions, pool: SoakPool, log: Callable[[str], None]) -> SoakResult:
    capacity = options.nodes * options.cap
    clients = math.ceil(capacity * options.overload)
    result = SoakResult(duration_s=options.duration_s, clients=clients, capacity=capacity)
    load = Load(pool.router_url, clients, options, result)
    stop_side = asyncio.Event()
    churn_counts: Counter[str] = Counter()
    rss: list[tuple[float, float]] = []
    side = [
        asyncio.create_task(churn(pool, options, stop_side, churn_counts, log)),
        asyncio.create_task(sample_rss(pool, rss, stop_side)),
    ]
    load_task = asyncio.create_task(load.run())
    started = time.monotonic()
    while (remaining := options.duration_s - (time.monotonic() - started)) > 0:
        await asyncio.sleep(min(10.0, remaining))
        errors = {k: v for k, v in load.kinds.items() if k not in ("ok", "503")}
        log(f"{time.monotonic() - started:5.0f}s requests={result.requests} ok={result.ok} "
            f"503={result.rejected_503} errors={errors or 0} rss={pool.router_rss():.1f}MB")
    stop_side.set()
    await asyncio.gather(*side)
    load.stop.set()
    await load_task
    # a node left drained by the last churn step comes back, then everything must settle at zero
    for node in pool.nodes:
        await asyncio.to_thread(pool.admin, node, "undrain")
    deadline = time.monotonic() + 20
    left = await asyncio.to_thread(leftovers, pool)
    while not all_zero(left) and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        left = await asyncio.to_thread(leftovers, pool)
    warm = [mb for t, mb in rss if t >= options.warmup_s] or [mb for _, mb in rss]
    result.rss_warm_mb = round(warm[0], 1)
    result.rss_end_mb = round(rss[-1][1], 1)
    result.rss_max_mb = round(max(mb for _, mb in rss), 1)
    result.rss_growth = round(result.rss_end_mb / result.rss_warm_mb - 1, 4)
    result.error_kinds = {k: v for k, v in load.kinds.items() if k not in ("ok", "503")}
    result.churn = dict(churn_counts)
    result.leftover = left
    result.checks = {
        "errors_non_503_zero": result.errors_non_503 == 0,
        "every_503_has_retry_after": result.retry_after_missing == 0,
        "rss_growth_under_10pct": result.rss_growth < 0.10,
        "counters_back_to_zero": all_zero(left),
        "churn_happened": churn_counts["restart"] > 0
        and not any(k.endswith("_failed") for k in churn_counts),
        "served_requests": result.ok > 0,
    }
    return result


def run(options: SoakOptions, log: Callable[[str], None] = print) -> SoakResult:
    """Start the pool, soak it, stop it; the figures and the checks in a :class:`SoakResult`."""
    with contextlib.ExitStack() as stack:
        log_dir = options.log_dir or Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="macpool-soak-"))
        )
        log_dir.mkdir(parents=True, exist_ok=True)
        pool = SoakPool(options, log_dir)
        stack.callback(pool.close)
        pool.start()
        result = asyncio.run(soak(options, pool, log))
    return result


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="macpool bench soak", description="Soak the pool at 1.5x with churn.")
    defaults = SoakOptions()
    p.add_argument("--duration", type=float, default=defaults.duration_s, help="seconds of load")
    p.add_argument("--nodes", type=int, default=defaults.nodes)
    p.add_argument("--cap", type=int, default=defaults.cap, help="each agent's cap")
    p.add_argument("--overload", type=float, default=defaults.overload, help="clients / pool capacity")
    p.add_argument("--speed", type=float, default=defaults.speed, help="simulator speed-up")
    p.add_argument("--max-tokens", type=int, default=defaults.max_tokens)
    p.add_argument("--churn-every", type=float, default=defaults.churn_every_s, help="seconds per churn step")
    p.add_argument("--warmup", type=float, default=defaults.warmup_s, help="RSS baseline taken after this")
    p.add_argument("--log-dir", type=Path, help="keep the processes' logs here")
    p.add_argument("--json", type=Path, help="write the figures here")
    a = p.parse_args(argv)
    options = SoakOptions(
        duration_s=a.duration, nodes=a.nodes, cap=a.cap, overload=a.overload, speed=a.speed,
        max_tokens=a.max_tokens, churn_every_s=a.churn_every, warmup_s=a.warmup, log_dir=a.log_dir,
    )
    result = run(options, log=lambda line: print(line, flush=True))
    data = {**asdict(result), "passed": result.passed}
    print(json.dumps(data, indent=2))
    if a.json:
        a.json.write_text(json.dumps(data, indent=2) + "\n")
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
