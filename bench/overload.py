"""``macpool bench overload``: the pool under 2x overload, with the router's admission control and without.

Starts a real Redis-protocol server, two simulated ``m5max-128g-14b-q4`` Macs with ``--parallel 16`` (so
llama-server alone would accept the overload), an agent per Mac capped at 8 (the calibrated knee), and the
router; drives 32 closed-loop streaming clients (``--clients``) with ~4K-token prompts. Then the same load
straight at two fresh simulators with no admission control; and, for reference, 8 clients at one fresh
simulator (the single-node knee). Every figure is in simulated time.

Prints both runs side by side and writes JSON with ``goodput_tok_s``, ``knee_tok_s`` (2 x the single-node
knee), ``goodput_ratio``, ``direct_tok_s``, ``rejected_503``, ``retry_after_present`` (fraction of 503s
carrying the header) and ``errors_non_503``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from bench.load import ClosedLoop, RequestRecord, SimClock, chat_body
from macpool.procs import Child, macpool_argv
from macpool.redis_server import RedisServer, free_port

PRESET = "m5max-128g-14b-q4"
WARMUP = 0.2  # share of each run left out of the throughput figure (the start-up burst)


@dataclass
class Conditions:
    clients: int = 32
    prompt_tokens: int = 4096
    max_tokens: int = 256
    duration_s: float = 90.0  # simulated seconds of load per run
    speed: float = 1.0  # faster needs spare cores: the Python relay chain must keep up with the sims
    parallel: int = 16
    ctx_per_slot: int = 8192
    cap: int = 8
    queue_size: int = 64
    queue_timeout: float = 2.0


@dataclass
class Run:
    """One phase, as the clients saw it (simulated time)."""

    name: str
    clients: int
    throughput_tok_s: float  # tokens of requests that completed, per simulated second
    completed: int
    rejected_503: int
    retry_after_present: float | None
    errors_non_503: int
    ttft_p50_s: float | None
    latency_p50_s: float | None
    worst_state: str | None


class Stack:
    """The processes of one benchmark, stopped together."""

    def __init__(self, conditions: Conditions, log_dir: Path) -> None:
        self.conditions = conditions
        self.log_dir = log_dir
        self.children: list[Child] = []

    def start(self, name: str, *args: str, ready: str = "/health") -> str:
        port = free_port()
        log = self.log_dir / f"{name}.log"
        child = Child(macpool_argv(*args, "--port", str(port)), name=name, log_path=log)
        self.children.append(child.start())
        url = f"http://127.0.0.1:{port}"
        child.wait_http(url + ready, timeout=60)
        return url

    def sim(self, name: str) -> str:
        c = self.conditions
        return self.start(
            name, "sim", "--preset", PRESET, "--parallel", str(c.parallel),
            "--ctx-size", str(c.parallel * c.ctx_per_slot), "--speed", str(c.speed),
        )

    def stop(self) -> None:
        for child in reversed(self.children):
            child.stop(timeout=10)
        self.children = []


@contextlib.contextmanager
def stack(conditions: Conditions, log_dir: Path) -> Iterator[Stack]:
    processes = Stack(conditions, log_dir)
    try:
        yield processes
    finally:
        processes.stop()


async def drive(name: str, targets: list[str], sims: list[str], conditions: Conditions, clients: int) -> Run:
    """``clients`` closed-loop clients spread over ``targets``; throughput read from the simulators ``sims``.

    Throughput is the tokens the simulators generated per simulated second over the steady part of the run
    (after the first ``WARMUP`` of it, until clients stop sending), so the start-up burst and the tail of the
    last requests do not distort it. Every generated token belongs to a request that completes unless
    ``errors_non_503`` says otherwise.
    """
    c = conditions
    async with contextlib.AsyncExitStack() as exits:
        clocks = []
        for url in sims:
            http = await exits.enter_async_context(httpx.AsyncClient(base_url=url, timeout=10))
            clock = SimClock(http)
            await clock.probe()
            clocks.append(clock)
        for clock in clocks:
            await clock.reset()
        n = len(targets)
        share = [clients // n + (1 if i < clients % n else 0) for i in range(n)]
        duration = c.duration_s / c.speed
        loops = [
            ClosedLoop(url, k, chat_body(c.prompt_tokens, c.max_tokens), requests_per_client=None,
                       duration_s=duration)
            for url, k in zip(targets, share, strict=True)
        ]
        started = time.monotonic()
        running = asyncio.gather(*(loop.run() for loop in loops))
        await asyncio.sleep(duration * WARMUP)
        first = [await clock.stats() for clock in clocks]
        await asyncio.sleep(max(0.0, started + duration - time.monotonic()))
        last = [await clock.stats() for clock in clocks]
        results = await running
        final = [await clock.stats() for clock in clocks]
    records = [record for batch in results for record in batch]
    pairs = list(zip(first, last, strict=True))
    tokens = sum(int(b["tokens_predicted_total"]) - int(a["tokens_predicted_total"]) for a, b in pairs)
    sim_s = sum(float(b["sim_time_s"]) - float(a["sim_time_s"]) for a, b in pairs) / len(pairs)
    scale = sim_s / (duration * (1 - WARMUP))  # simulated seconds per wall second, as measured
    return summarise(name, clients, records, tokens / sim_s if sim_s > 0 else 0.0, scale, final)


def summarise(name: str, clients: int, records: list[RequestRecord], throughput: float, scale: float,
              stats: list[dict[str, Any]]) -> Run:
    ok = [r for r in records if r.ok]
    rejected = [r for r in records if r.status == 503]
    order = ["healthy", "near_ceiling", "paging", "collapsed"]
    worst = max((str(s.get("worst_state", "healthy")) for s in stats), key=order.index, default=None)
    return Run(
        name=name,
        clients=clients,
        throughput_tok_s=round(throughput, 1),
        completed=len(ok),
        rejected_503=len(rejected),
        retry_after_present=(
            round(sum(1 for r in rejected if r.retry_after) / len(rejected), 4) if rejected else None
        ),
        errors_non_503=sum(1 for r in records if not r.ok and r.status != 503),
        ttft_p50_s=_median([r.ttft_s * scale for r in ok if r.ttft_s is not None]),
        latency_p50_s=_median([r.latency_s * scale for r in ok]),
        worst_state=worst,
    )


def _median(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[len(ordered) // 2], 3)


def run(conditions: Conditions, log_dir: Path, console: Console) -> dict[str, Any]:
    c = conditions
    with RedisServer() as redis, stack(c, log_dir) as processes:
        console.print(f"pool: 2 x {PRESET} (--parallel {c.parallel}), agents capped at {c.cap}, router")
        sims = [processes.sim(f"sim-{i}") for i in range(2)]
        for i, sim in enumerate(sims):
            processes.start(
                f"agent-{i}", "agent", "run", "--upstream", sim, "--redis-url", redis.url,
                "--node-id", f"mac-{i}", "--cap", str(c.cap),
            )
        router = processes.start(
            "router", "router", "--redis-url", redis.url, "--queue-size", str(c.queue_size),
            "--queue-timeout", str(c.queue_timeout),
        )
        _wait_nodes(router, 2)
        console.print(f"router run: {c.clients} clients for {c.duration_s:g} simulated s ...")
        routed = asyncio.run(drive("router", [router], sims, c, c.clients))
    with stack(c, log_dir) as processes:
        sims = [processes.sim(f"direct-sim-{i}") for i in range(2)]
        console.print(f"direct run: {c.clients} clients straight at 2 fresh simulators ...")
        direct = asyncio.run(drive("direct", sims, sims, c, c.clients))
    with stack(c, log_dir) as processes:
        sim = processes.sim("knee-sim")
        console.print(f"knee: {c.cap} clients at one fresh simulator ...")
        knee = asyncio.run(drive("knee (1 node)", [sim], [sim], c, c.cap))
    knee_tok_s = round(2 * knee.throughput_tok_s, 1)
    return {
        "goodput_tok_s": routed.throughput_tok_s,
        "knee_tok_s": knee_tok_s,
        "goodput_ratio": round(routed.throughput_tok_s / knee_tok_s, 4) if knee_tok_s else None,
        "direct_tok_s": direct.throughput_tok_s,
        "rejected_503": routed.rejected_503,
        "retry_after_present": routed.retry_after_present,
        "errors_non_503": routed.errors_non_503,
        "conditions": asdict(c),
        "runs": [asdict(routed), asdict(direct), asdict(knee)],
    }


def _wait_nodes(router: str, count: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(router + "/api/pool", timeout=2).json()["pool"]["nodes_ready"] >= count:
                return
        time.sleep(0.1)
    raise RuntimeError(f"the router did not see {count} ready nodes within {timeout}s")


def table(result: dict[str, Any]) -> Table:
    c = result["conditions"]
    t = Table(title=f"overload: {c['clients']} streaming clients, {c['prompt_tokens']}-token prompts, "
                    "2 simulated M5 Max (simulated time)")
    for column in ("run", "clients", "tok/s", "completed", "503", "with Retry-After", "other errors",
                   "TTFT p50 s", "latency p50 s", "worst memory"):
        t.add_column(column, justify="left" if column == "run" else "right")
    for r in result["runs"]:
        t.add_row(
            r["name"], str(r["clients"]), f"{r['throughput_tok_s']:.1f}", str(r["completed"]),
            str(r["rejected_503"]),
            "-" if r["retry_after_present"] is None else f"{100 * r['retry_after_present']:.0f}%",
            str(r["errors_non_503"]), _fmt(r["ttft_p50_s"]), _fmt(r["latency_p50_s"]),
            r["worst_state"] or "-",
        )
    return t


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def build_parser() -> argparse.ArgumentParser:
    d = Conditions()
    p = argparse.ArgumentParser(prog="macpool bench overload", description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=d.clients)
    p.add_argument("--prompt-tokens", type=int, default=d.prompt_tokens)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--duration", type=float, default=d.duration_s, help="simulated seconds of load per run")
    p.add_argument("--speed", type=float, default=d.speed, help="simulated seconds per wall second")
    p.add_argument("--cap", type=int, default=d.cap, help="each agent's cap (the single-node knee)")
    p.add_argument("--queue-size", type=int, default=d.queue_size)
    p.add_argument("--queue-timeout", type=float, default=d.queue_timeout)
    p.add_argument("--json", type=Path, help="write the result as JSON here")
    p.add_argument("--logs", type=Path, help="keep the processes' logs in this directory")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    conditions = Conditions(
        clients=args.clients, prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens,
        duration_s=args.duration, speed=args.speed, cap=args.cap, queue_size=args.queue_size,
        queue_timeout=args.queue_timeout,
    )
    console = Console(width=None if sys.stdout.isatty() else 140)
    with contextlib.ExitStack() as exits:
        scratch = exits.enter_context(tempfile.TemporaryDirectory(prefix="macpool-overload-"))
        log_dir = args.logs or Path(scratch)
        log_dir.mkdir(parents=True, exist_ok=True)
        result = run(conditions, log_dir, Console(stderr=True))
    console.print(table(result))
    summary = {k: v for k, v in result.items() if k not in ("conditions", "runs")}
    console.print_json(json.dumps(summary))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0
