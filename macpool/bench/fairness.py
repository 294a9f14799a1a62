"""``macpool bench fairness``: a flooding tenant and a light one through a router; the light one's queue wait.

The pool: a real Redis-protocol server, ``--nodes`` simulated Macs (``m5max-128g-14b-q4``, ``--parallel``
slots each), an agent per Mac capped at its slot count, and one router with an API keys file of two tenants,
``flood`` and ``light``, and a generous queue (``--queue-size 128 --queue-timeout 120``). Requests are short
non-streaming chats (unique prompts, so no cache hits) of ~0.35 wall seconds at the default ``--speed``.

Phases, one after another on the same pool:

- ``unloaded``: the light tenant's clients alone - the service time, and the floor of the wait estimate.
- ``flood_alone``: the flood tenant with ``--flood-clients`` closed-loop clients (default 4x the pool's
  slots), so about three quarters of them are always queued.
- ``fair``: the flood goes on; the light tenant runs ``--light-clients`` sequential clients with a pause
  between requests (well under its fair share of half the pool).
- ``fifo``: the same, but the light clients send the flood's API key, so the router cannot tell them apart:
  within one tenant and class the queue is first come, first served. This is the wait a light tenant would
  see without fair queueing.
- ``batch``: the light clients send ``X-Macpool-Priority: batch`` while the flood is interactive. Interactive
  always goes first, so a light batch request waits until the flood stops (after ``--batch-phase`` seconds).

Queue wait is measured client-side, per request: latency minus the node's own service time for that request
(the simulator's ``timings.prompt_ms + predicted_ms``, converted to wall seconds at the speed the simulators
achieved in that phase). It includes the router's and agent's overhead, which the ``unloaded`` phase shows.
The router's own figure is reported beside it as a check: the ``macpool_queue_wait_seconds`` histogram's
sum over the phase divided by the tenant's requests (a request admitted at once waited 0), and how many of
them were queued at all. Every time is wall seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import re
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from macpool.bench.affinity import samples
from macpool.bench.report import run_and_report
from macpool.bench.stack import Stack
from macpool.bench.stats import pct
from macpool.dev.procs import macpool_argv
from macpool.dev.redis_server import free_port
from macpool.dev.stack import wait_nodes
from macpool.sim import tokens

PRESET = "m5max-128g-14b-q4"
KEYS = {"flood": "sk-flood", "light": "sk-light"}
# a light request waits for the first running request to end: under the longest service time (1.5x the
# mean length), plus the relay's overhead on a busy box. FIFO behind the flood is ~4 service times.
BOUND_SERVICE_TIMES = 2.0
ERROR_PAUSE_S = 0.2
SEED = 9
_LABELS = re.compile(r'(\w+)="([^"]*)"')


@dataclass
class Conditions:
    nodes: int = 2
    parallel: int = 2  # slots per simulated Mac, and its agent's cap
    flood_clients: int = 0  # 0: 4x the pool's slots
    light_clients: int = 2
    light_think_s: float = 0.5  # mean wall seconds between a light client's requests
    prompt_tokens: int = 256
    max_tokens: int = 48  # mean; each request draws 0.5x..1.5x
    speed: float = 2.0  # simulated seconds per wall second
    unloaded_s: float = 4.0
    warmup_s: float = 3.0  # the flood fills the queue before flood_alone starts
    phase_s: float = 25.0  # flood_alone, fair and fifo each
    batch_phase_s: float = 10.0  # 0: no batch phase
    queue_size: int = 128
    queue_timeout: float = 120.0
    preset: str = PRESET

    @property
    def slots(self) -> int:
        return self.nodes * self.parallel

    @property
    def flood(self) -> int:
        return self.flood_clients or 4 * self.slots


@dataclass
class Record:
    """One request as its client saw it (wall seconds)."""

    tenant: str  # who sent it; in the fifo phase the light clients use the flood's key
    phase: str  # the phase it was sent in
    started: float
    ended: float
    status: int  # 0 when the connection failed
    service_sim_s: float | None  # the simulator's prompt_ms + predicted_ms
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.service_sim_s is not None

    @property
    def latency_s(self) -> float:
        return self.ended - self.started


@dataclass
class Mark:
    """The pool at a phase boundary."""

    wall: float
    sim_s: float  # mean of the simulators' clocks
    router_metrics: str


@dataclass
class Clients:
    """Every client of one run against the router; ``phase`` tags what they send."""

    conditions: Conditions
    http: httpx.AsyncClient
    phase: str = "unloaded"
    records: list[Record] = field(default_factory=list)
    salt: str = field(default_factory=lambda: secrets.token_hex(4))
    serial: itertools.count[int] = field(default_factory=itertools.count)
    # lengths and pauses vary: identical requests started together finish together, and slots freed in
    # lockstep would make every wait a whole service time, whatever the queue order
    rng: random.Random = field(default_factory=lambda: random.Random(SEED))

    def body(self) -> dict[str, Any]:
        c = self.conditions
        return {
            "messages": tokens.chat_messages(c.prompt_tokens, salt=f"{self.salt}-{next(self.serial)}"),
            "max_tokens": max(1, round(self.around(c.max_tokens))), "ignore_eos": True, "stream": False,
        }

    def around(self, mean: float) -> float:
        return mean * self.rng.uniform(0.5, 1.5)

    async def send(self, tenant: str, headers: dict[str, str]) -> Record:
        phase, started = self.phase, time.monotonic()
        try:
            response = await self.http.post("/v1/chat/completions", json=self.body(), headers=headers)
        except httpx.HTTPError as exc:
            return Record(tenant, phase, started, time.monotonic(), 0, None, type(exc).__name__)
        ended = time.monotonic()
        if response.status_code != 200:
            return Record(tenant, phase, started, ended, response.status_code, None, response.text[:200])
        timings = response.json().get("timings") or {}
        service = (float(timings.get("prompt_ms", 0)) + float(timings.get("predicted_ms", 0))) / 1000
        return Record(tenant, phase, started, ended, 200, service or None)

    async def loop(
        self, tenant: str, headers: dict[str, str], done: Callable[[], bool], think_s: float
    ) -> None:
        """Send, wait for the answer, pause ``think_s``; until ``done()``."""
        while not done():
            record = await self.send(tenant, headers)
            self.records.append(record)
            pause = self.around(think_s)
            await asyncio.sleep(pause if record.ok else max(pause, ERROR_PAUSE_S))

    async def light(self, key: str, priority: str, duration_s: float) -> None:
        """The light tenant's clients, sending until ``duration_s`` from now, and their last answers."""
        c = self.conditions
        deadline = time.monotonic() + duration_s
        headers = {"Authorization": f"Bearer {key}", "X-Macpool-Priority": priority}
        await asyncio.gather(*(
            self.loop("light", headers, lambda: time.monotonic() >= deadline, c.light_think_s)
            for _ in range(c.light_clients)
        ))


async def mark(probe: httpx.AsyncClient, router: str, sims: list[str]) -> Mark:
    clocks = [float((await probe.get(url + "/sim/stats")).json()["sim_time_s"]) for url in sims]
    metrics = (await probe.get(router + "/metrics")).text
    return Mark(time.monotonic(), sum(clocks) / len(clocks), metrics)


async def drive(c: Conditions, router: str, sims: list[str], log: Callable[[str], None]) -> dict[str, Any]:
    """Every phase against ``router``, one after another, summarised."""
    connections = c.flood + c.light_clients + 4
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    timeout = httpx.Timeout(c.queue_timeout + 60, connect=10)
    marks: dict[str, tuple[Mark, Mark]] = {}
    async with httpx.AsyncClient(base_url=router, limits=limits, timeout=timeout) as http, \
            httpx.AsyncClient(timeout=10) as probe:
        clients = Clients(c, http)

        async def phase(name: str, work: Awaitable[Any]) -> None:
            clients.phase = name
            log(f"{name} ...")
            start = await mark(probe, router, sims)
            await work
            marks[name] = (start, await mark(probe, router, sims))

        await phase("unloaded", clients.light(KEYS["light"], "interactive", c.unloaded_s))
        stop = asyncio.Event()
        flood_headers = {"Authorization": f"Bearer {KEYS['flood']}", "X-Macpool-Priority": "interactive"}
        clients.phase = "warmup"
        flood = asyncio.gather(*(
            clients.loop("flood", flood_headers, stop.is_set, 0.0) for _ in range(c.flood)
        ))
        await asyncio.sleep(c.warmup_s)
        await phase("flood_alone", asyncio.sleep(c.phase_s))
        await phase("fair", clients.light(KEYS["light"], "interactive", c.phase_s))
        await phase("fifo", clients.light(KEYS["flood"], "interactive", c.phase_s))
        flood_stopped: list[float] = []

        async def batch_until_flood_stops() -> None:
            light = asyncio.ensure_future(clients.light(KEYS["light"], "batch", c.batch_phase_s))
            await asyncio.sleep(c.batch_phase_s)
            stop.set()
            flood_stopped.append(time.monotonic())
            await flood
            await light

        if c.batch_phase_s > 0:
            await phase("batch", batch_until_flood_stops())
        else:
            stop.set()
            flood_stopped.append(time.monotonic())
            await flood
    return summarise(c, clients.records, marks, flood_stopped[0])


# --- figures -------------------------------------------------------------------------------------------


def router_waits(metrics: str) -> dict[str, tuple[float, float]]:
    """tenant -> (queued requests, seconds waited) from ``macpool_queue_wait_seconds``, every class."""
    counts = samples(metrics, "macpool_queue_wait_seconds_count")
    sums = samples(metrics, "macpool_queue_wait_seconds_sum")
    waits: dict[str, tuple[float, float]] = {}
    for labels, count in counts.items():
        tenant = dict(_LABELS.findall(labels)).get("tenant", "")
        queued, waited = waits.get(tenant, (0.0, 0.0))
        waits[tenant] = (queued + count, waited + sums.get(labels, 0.0))
    return waits


def tenant_figures(
    records: list[Record], speed: float, router: tuple[float, float] | None
) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    latency = [r.latency_s for r in ok]
    # a wait cannot be negative: a small negative figure is the timing noise of the conversion
    waits = [max(0.0, r.latency_s - (r.service_sim_s or 0.0) / speed) for r in ok]
    figures: dict[str, Any] = {
        "requests": len(ok),
        "errors": len(records) - len(ok),
        "error_sample": sorted({r.error or f"HTTP {r.status}" for r in records if not r.ok})[:3],
        "latency_p50_s": _round(pct(latency, 50)),
        "latency_p99_s": _round(pct(latency, 99)),
        "service_p50_s": _round(pct([(r.service_sim_s or 0.0) / speed for r in ok], 50)),
        "queue_wait_p50_s": _round(pct(waits, 50)),
        "queue_wait_p99_s": _round(pct(waits, 99)),
        "queue_wait_mean_s": _round(sum(waits) / len(waits) if waits else None),
        "router_queued": None,
        "router_queue_wait_mean_s": None,
    }
    if router is not None and ok:
        figures["router_queued"] = round(router[0])
        figures["router_queue_wait_mean_s"] = _round(router[1] / len(ok))
    return figures


def phase_figures(name: str, records: list[Record], start: Mark, end: Mark) -> dict[str, Any]:
    wall = end.wall - start.wall
    speed = (end.sim_s - start.sim_s) / wall if wall > 0 else 0.0
    before, after = router_waits(start.router_metrics), router_waits(end.router_metrics)
    figures: dict[str, Any] = {"wall_s": round(wall, 1), "speed_achieved": round(speed, 3)}
    for tenant in ("flood", "light"):
        mine = [r for r in records if r.phase == name and r.tenant == tenant]
        if not mine:
            continue
        a, b = before.get(tenant, (0.0, 0.0)), after.get(tenant, (0.0, 0.0))
        # in the fifo phase the light clients are the flood tenant to the router: its figures mix both
        router = None if name == "fifo" else (b[0] - a[0], b[1] - a[1])
        figures[tenant] = tenant_figures(mine, speed, router)
    if "flood" in figures and "light" in figures:
        light, flood = figures["light"], figures["flood"]
        figures["ratio_light_flood"] = {
            key: _ratio(light[key], flood[key])
            for key in ("queue_wait_p50_s", "queue_wait_p99_s", "latency_p50_s", "latency_p99_s")
        }
    return figures


def summarise(
    c: Conditions, records: list[Record], marks: dict[str, tuple[Mark, Mark]], flood_stopped: float
) -> dict[str, Any]:
    phases = {name: phase_figures(name, records, *pair) for name, pair in marks.items()}
    service = phases["unloaded"]["light"]["latency_p50_s"]
    bound = round(BOUND_SERVICE_TIMES * service, 3) if service else None
    fair, fifo = phases["fair"].get("light", {}), phases["fifo"].get("light", {})
    flood, ratios = phases["fair"].get("flood", {}), phases["fair"].get("ratio_light_flood", {})
    light_p99 = fair.get("queue_wait_p99_s")
    result: dict[str, Any] = {
        "bench": "fairness",
        "wait_measure": "client-side: latency - the simulator's service time (timings), in wall seconds",
        "service_s": service,
        "light_wait_bound_s": bound,
        "light_wait_bounded": bool(bound is not None and light_p99 is not None and light_p99 <= bound),
        "fair_light_wait_p50_s": fair.get("queue_wait_p50_s"),
        "fair_light_wait_p99_s": light_p99,
        "fair_flood_wait_p50_s": flood.get("queue_wait_p50_s"),
        "fair_ratio_light_flood_wait_p50": ratios.get("queue_wait_p50_s"),
        "fifo_light_wait_p50_s": fifo.get("queue_wait_p50_s"),
        "fifo_light_wait_p99_s": fifo.get("queue_wait_p99_s"),
        "fifo_over_fair_light_wait_p50": _ratio(fifo.get("queue_wait_p50_s"), fair.get("queue_wait_p50_s")),
    }
    if "batch" in phases:
        batch = [r for r in records if r.phase == "batch" and r.tenant == "light"]
        served = [r for r in batch if r.ok and r.ended < flood_stopped]
        result["batch_light_served_while_flood_ran"] = len(served)
        result["batch_light_requests"] = len(batch)
        result["batch_light_wait_p50_s"] = phases["batch"].get("light", {}).get("queue_wait_p50_s")
    result["conditions"] = {**asdict(c), "slots": c.slots, "flood_clients": c.flood}
    result["phases"] = phases
    return result


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


# --- the pool ------------------------------------------------------------------------------------------


def start_pool(c: Conditions, stack: Stack) -> tuple[str, list[str]]:
    """Redis, the simulated Macs and their agents, and the router; its URL and the simulators' URLs."""
    redis_url = stack.start_redis()
    sims = []
    for i in range(c.nodes):
        port = free_port()
        argv = macpool_argv(
            "sim", "--preset", c.preset, "--parallel", str(c.parallel), "--speed", str(c.speed),
            "--port", str(port),
        )
        sim = stack.spawn(f"sim-{i}", argv, port)
        stack.agent(f"agent-{i}", sim.url, redis_url, f"mac-{i}", cap=c.parallel)
        sims.append(sim.url)
    keys = stack.logs / "api-keys"
    keys.write_text("".join(f"{key} name={tenant}\n" for tenant, key in KEYS.items()))
    router = stack.router(
        "router", redis_url, "--api-keys-file", str(keys), "--queue-size", str(c.queue_size),
        "--queue-timeout", str(c.queue_timeout),
    )
    wait_nodes(router.url, c.nodes)
    return router.url, sims


def run(c: Conditions, stack: Stack, log: Callable[[str], None]) -> dict[str, Any]:
    router, sims = start_pool(c, stack)
    log(f"pool: {c.nodes} x {c.preset} (--parallel {c.parallel}, speed {c.speed:g}), {c.slots} slots; "
        f"flood {c.flood} clients, light {c.light_clients} clients")
    return asyncio.run(drive(c, router, sims, log))


def table(result: dict[str, Any]) -> str:
    columns = [
        ("requests", "requests"), ("errors", "errors"), ("lat p50", "latency_p50_s"),
        ("lat p99", "latency_p99_s"), ("wait p50", "queue_wait_p50_s"), ("wait p99", "queue_wait_p99_s"),
        ("wait mean", "queue_wait_mean_s"), ("router mean", "router_queue_wait_mean_s"),
        ("queued", "router_queued"),
    ]
    lines = [f"{'phase / tenant (wall s)':<24}" + "".join(f"{label:>12}" for label, _ in columns)]
    for name, phase in result["phases"].items():
        for tenant in ("flood", "light"):
            if tenant in phase:
                row = phase[tenant]
                lines.append(f"{name + ' / ' + tenant:<24}" + "".join(f"{row[k]!s:>12}" for _, k in columns))
        if "ratio_light_flood" in phase:
            ratio = phase["ratio_light_flood"]
            lines.append(f"{'  light / flood':<24}" + f"{'':>36}" + "".join(
                f"{ratio[k]!s:>12}" for k in ("queue_wait_p50_s", "queue_wait_p99_s")
            ))
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    d = Conditions()
    p = argparse.ArgumentParser(prog="macpool bench fairness", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=d.nodes, help="simulated Macs")
    p.add_argument("--parallel", type=int, default=d.parallel, help="slots per Mac (and its agent's cap)")
    p.add_argument("--flood-clients", type=int, default=d.flood_clients, help="0: 4x the pool's slots")
    p.add_argument("--light-clients", type=int, default=d.light_clients, help="light tenant's clients")
    p.add_argument("--light-think", type=float, default=d.light_think_s, help="mean wall s between requests")
    p.add_argument("--prompt-tokens", type=int, default=d.prompt_tokens)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--speed", type=float, default=d.speed, help="simulated seconds per wall second")
    p.add_argument("--unloaded", type=float, default=d.unloaded_s, help="wall s of the unloaded phase")
    p.add_argument("--warmup", type=float, default=d.warmup_s, help="wall s of flood before flood_alone")
    p.add_argument("--phase", type=float, default=d.phase_s, help="wall s of flood_alone, fair and fifo")
    p.add_argument("--batch-phase", type=float, default=d.batch_phase_s, help="wall s; 0: no batch phase")
    p.add_argument("--queue-size", type=int, default=d.queue_size)
    p.add_argument("--queue-timeout", type=float, default=d.queue_timeout)
    p.add_argument("--preset", default=d.preset)
    p.add_argument("--json", type=Path, help="write the result as JSON here")
    p.add_argument("--logs", type=Path, help="keep the processes' logs in this directory")
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    c = Conditions(
        nodes=args.nodes, parallel=args.parallel, flood_clients=args.flood_clients,
        light_clients=args.light_clients, light_think_s=args.light_think, prompt_tokens=args.prompt_tokens,
        max_tokens=args.max_tokens, speed=args.speed, unloaded_s=args.unloaded, warmup_s=args.warmup,
        phase_s=args.phase, batch_phase_s=args.batch_phase, queue_size=args.queue_size,
        queue_timeout=args.queue_timeout, preset=args.preset,
    )
    details = ("conditions", "phases")  # left out of the printed summary line
    return run_and_report(lambda stack, say: run(c, stack, say), table, args.logs, args.json, details)
