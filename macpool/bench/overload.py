"""``macpool bench overload``: the pool over its capacity, with the router's admission control and without.

Starts a real Redis-protocol server, two simulated ``m5max-128g-14b-q4`` Macs with ``--parallel 16`` (so
llama-server alone would accept the overload), an agent per Mac capped at 8 (the calibrated knee), and the
router; drives closed-loop streaming clients with ~4K-token prompts: ``--levels`` times the pool's capacity
(2 x ``--cap`` slots; default 2x, 32 clients), each level on a fresh pool, or exactly ``--clients``. At each
level the same load then goes straight at two fresh simulators with no admission control (unless
``--no-direct``); and, for reference, ``--cap`` clients at one fresh simulator (the single-node knee).
Throughput, TTFT and latency are in simulated time; how long a refusal took is in wall-clock ms (the router's
own time, queue wait included).

Prints every run and writes JSON: ``levels``, one entry per level with ``goodput_tok_s``, ``goodput_ratio``
(goodput / ``knee_tok_s``, 2 x the single-node knee), ``direct_tok_s``, the admitted requests' TTFT and
latency p50/p99, the refusals' latency p50/p99 (also per ``X-Macpool-Reason``), ``rejected_503``,
``retry_after_present`` (fraction of 503s carrying the header) and ``errors_non_503``; the top-level keys of
the same names are the highest level's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from macpool import plotting
from macpool.bench.load import ClosedLoop, RequestRecord, SimClock, chat_body
from macpool.bench.stats import ms, pct, shares
from macpool.dev.stack import Stack

PRESET = "m5max-128g-14b-q4"
NODES = 2
WARMUP = 0.2  # share of each run left out of the throughput figure (the start-up burst)
# clients per load process: an event loop driving many more (a 503 every few ms, each retried 50 ms later)
# spends a whole core and falls behind, and its own lag then shows in every latency it records
CLIENTS_PER_PROCESS = 32
READY_TIMEOUT_S = 120.0  # the most a load process may take to start (imports on a busy machine)


@dataclass
class Conditions:
    levels: tuple[float, ...] = (2.0,)  # clients as multiples of the pool's capacity (NODES x cap)
    clients: int | None = None  # instead of levels: one run of exactly this many clients
    direct: bool = True  # also each level straight at the Macs
    prompt_tokens: int = 4096
    max_tokens: int = 256
    spread: float = 0.0  # answer lengths vary within max_tokens x (1 +/- spread) (bench.load.chat_body)
    from_first_try: bool = False  # an answer after refusals is timed from its first try (bench.load)
    duration_s: float = 90.0  # simulated seconds of load per run
    speed: float = 1.0  # faster needs spare cores: the Python relay chain must keep up with the sims
    parallel: int = 16
    ctx_per_slot: int = 8192
    cap: int = 8
    queue_size: int = 64
    queue_timeout: float = 2.0

    @property
    def capacity(self) -> int:
        return NODES * self.cap

    def client_counts(self) -> list[int]:
        if self.clients is not None:
            return [self.clients]
        return [max(1, round(level * self.capacity)) for level in self.levels]


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
    ttft_p50_s: float | None  # of the requests that completed
    ttft_p99_s: float | None
    latency_p50_s: float | None
    latency_p99_s: float | None
    reject_p50_ms: float | None  # wall-clock, from sending the request to its 503 (queue wait included)
    reject_p99_ms: float | None
    reasons: dict[str, dict[str, float | None]]  # per X-Macpool-Reason: count, p50_ms, p99_ms
    worst_state: str | None
    # clients none of whose requests was answered: a router that refuses at once can serve the same clients
    # over and over (the one that just finished takes the slot it freed) while the others only retry
    unserved_clients: int = 0


def start_sim(processes: Stack, c: Conditions, name: str) -> str:
    """A simulated Mac under the run's conditions; its URL."""
    return processes.sim(
        name, "--preset", PRESET, "--parallel", str(c.parallel),
        "--ctx-size", str(c.parallel * c.ctx_per_slot), "--speed", str(c.speed),
    ).url


async def drive(
    name: str, targets: list[str], sims: list[str], conditions: Conditions, clients: int,
    model: str | None = None, pause_statuses: tuple[int, ...] = (429, 503),
) -> Run:
    """``clients`` closed-loop clients spread over ``targets``; throughput read from the simulators ``sims``.
    Requests name ``model`` (None: none); a client pauses briefly after an answer in ``pause_statuses``.

    Throughput is the tokens the simulators generated per simulated second over the steady part of the run
    (after the first ``WARMUP`` of it, until clients stop sending), so the start-up burst and the tail of the
    last requests do not distort it. Every generated token belongs to a request that completes unless
    ``errors_non_503`` says otherwise.
    """
    c = conditions
    async with contextlib.AsyncExitStack() as exits:
        clocks = []
        for url in sims:
            # (an idle connection is not reused after a second: the simulator's server closes it after 5 s
            # idle, and a request sent as it does so fails)
            limits = httpx.Limits(keepalive_expiry=1.0)
            http = await exits.enter_async_context(httpx.AsyncClient(base_url=url, timeout=10, limits=limits))
            clock = SimClock(http)
            await clock.probe()
            clocks.append(clock)
        for clock in clocks:
            await clock.reset()
        duration = c.duration_s / c.speed
        jobs = [(url, k) for url, n in zip(targets, shares(clients, len(targets)), strict=True)
                for k in shares(n, max(1, -(-n // CLIENTS_PER_PROCESS))) if k]
        loop = asyncio.get_running_loop()
        context = multiprocessing.get_context("spawn")
        # every load process and this one meet here before the clients start: the measured window begins
        # with all of them sending, however long a busy machine takes to start a process
        ready = context.Barrier(len(jobs) + 1, timeout=READY_TIMEOUT_S)
        with ProcessPoolExecutor(len(jobs), mp_context=context, initializer=_keep_barrier,
                                 initargs=(ready,)) as pool:
            running = asyncio.gather(*(
                loop.run_in_executor(pool, _load, url, k, c, duration, model, pause_statuses)
                for url, k in jobs
            ))
            await loop.run_in_executor(None, ready.wait)
            started = time.monotonic()
            await asyncio.sleep(duration * WARMUP)
            first = [await clock.stats() for clock in clocks]
            await asyncio.sleep(max(0.0, started + duration - time.monotonic()))
            last = [await clock.stats() for clock in clocks]
            results = await running
        final = [await clock.stats() for clock in clocks]
    records = [record for batch in results for record in batch]
    served = [len({r.client for r in batch if r.ok}) for batch in results]  # client ids are per process
    unserved = sum(k for _, k in jobs) - sum(served)
    pairs = list(zip(first, last, strict=True))
    tokens = sum(int(b["tokens_predicted_total"]) - int(a["tokens_predicted_total"]) for a, b in pairs)
    sim_s = sum(float(b["sim_time_s"]) - float(a["sim_time_s"]) for a, b in pairs) / len(pairs)
    scale = sim_s / (duration * (1 - WARMUP))  # simulated seconds per wall second, as measured
    return summarise(name, clients, records, tokens / sim_s if sim_s > 0 else 0.0, scale, final, unserved)


_ready: list[Barrier] = []  # in a load process: where it waits for the others (``drive``)


def _keep_barrier(ready: Barrier) -> None:
    """A load process's initializer: the barrier can only reach it this way, when the process starts."""
    _ready.append(ready)


def _load(
    url: str, clients: int, c: Conditions, duration_s: float,
    model: str | None = None, pause_statuses: tuple[int, ...] = (429, 503),
) -> list[RequestRecord]:
    """Some of the clients, in a process of their own, once every load process is ready."""
    body = chat_body(c.prompt_tokens, c.max_tokens, model, c.spread)
    loop = ClosedLoop(url, clients, body, requests_per_client=None, duration_s=duration_s,
                      pause_statuses=pause_statuses, from_first_try=c.from_first_try)
    _ready[0].wait()
    return asyncio.run(loop.run())


def summarise(name: str, clients: int, records: list[RequestRecord], throughput: float, scale: float,
              stats: list[dict[str, Any]], unserved_clients: int = 0) -> Run:
    ok = [r for r in records if r.ok]
    rejected = [r for r in records if r.status == 503]
    order = ["healthy", "near_ceiling", "paging", "collapsed"]
    worst = max((str(s.get("worst_state", "healthy")) for s in stats), key=order.index, default=None)
    ttfts = [r.ttft_s * scale for r in ok if r.ttft_s is not None]
    latencies = [r.latency_s * scale for r in ok]
    waits = [r.latency_s for r in rejected]
    by_reason: dict[str, list[float]] = {}
    for r in rejected:
        by_reason.setdefault(r.reason or "-", []).append(r.latency_s)
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
        ttft_p50_s=_round(pct(ttfts, 50)),
        ttft_p99_s=_round(pct(ttfts, 99)),
        latency_p50_s=_round(pct(latencies, 50)),
        latency_p99_s=_round(pct(latencies, 99)),
        reject_p50_ms=ms(pct(waits, 50), 2),
        reject_p99_ms=ms(pct(waits, 99), 2),
        reasons={
            reason: {"count": len(values), "p50_ms": ms(pct(values, 50), 2), "p99_ms": ms(pct(values, 99), 2)}
            for reason, values in sorted(by_reason.items())
        },
        worst_state=worst,
        unserved_clients=unserved_clients,
    )


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def run(conditions: Conditions, log_dir: Path, console: Console) -> dict[str, Any]:
    c = conditions
    console.print(f"pool: {NODES} x {PRESET} (--parallel {c.parallel}), agents capped at {c.cap} "
                  f"(capacity {c.capacity}), router")
    runs: list[Run] = []
    levels: list[dict[str, Any]] = []
    for clients in c.client_counts():
        tag = f"{clients / c.capacity:g}x"
        logs = log_dir / tag  # each level's processes keep their own logs
        logs.mkdir(exist_ok=True)
        console.print(f"router run, {tag}: {clients} clients for {c.duration_s:g} simulated s ...")
        routed = routed_run(c, logs, clients, f"router {tag}")
        direct = None
        if c.direct:
            console.print(f"direct run, {tag}: {clients} clients straight at {NODES} fresh simulators ...")
            direct = direct_run(c, logs, clients, f"direct {tag}")
        runs += [routed] if direct is None else [routed, direct]
        levels.append(level_summary(c, routed, direct))
    with Stack(logs=log_dir, keep_logs=True) as processes:
        sim = start_sim(processes, c, "knee-sim")
        console.print(f"knee: {c.cap} clients at one fresh simulator ...")
        knee = asyncio.run(drive("knee (1 node)", [sim], [sim], c, c.cap))
    runs.append(knee)
    knee_tok_s = round(NODES * knee.throughput_tok_s, 1)
    for level in levels:
        level["goodput_ratio"] = round(level["goodput_tok_s"] / knee_tok_s, 4) if knee_tok_s else None
    top = levels[-1]
    return {
        "goodput_tok_s": top["goodput_tok_s"],
        "knee_tok_s": knee_tok_s,
        "goodput_ratio": top["goodput_ratio"],
        "direct_tok_s": top["direct_tok_s"],
        "rejected_503": top["rejected_503"],
        "retry_after_present": top["retry_after_present"],
        "errors_non_503": top["errors_non_503"],
        "levels": levels,
        "conditions": asdict(c) | {"capacity": c.capacity, "clients": c.client_counts()},
        "runs": [asdict(r) for r in runs],
    }


def routed_run(c: Conditions, log_dir: Path, clients: int, name: str) -> Run:
    """``clients`` through the router to a fresh pool: Redis, the simulated Macs and their agents."""
    with Stack(logs=log_dir, keep_logs=True) as processes:
        redis_url = processes.redis()
        sims = [start_sim(processes, c, f"sim-{i}") for i in range(NODES)]
        for i, sim in enumerate(sims):
            processes.agent(f"agent-{i}", sim, redis_url, f"mac-{i}", "--cap", str(c.cap))
        router = processes.router(
            "router", redis_url, "--queue-size", str(c.queue_size), "--queue-timeout", str(c.queue_timeout),
        )
        processes.wait_nodes(router.url, NODES, timeout=30)
        return asyncio.run(drive(name, [router.url], sims, c, clients))


def direct_run(c: Conditions, log_dir: Path, clients: int, name: str) -> Run:
    """The same load straight at fresh simulators: nothing in front of them refuses anything."""
    with Stack(logs=log_dir, keep_logs=True) as processes:
        sims = [start_sim(processes, c, f"direct-sim-{i}") for i in range(NODES)]
        return asyncio.run(drive(name, sims, sims, c, clients))


def level_summary(c: Conditions, routed: Run, direct: Run | None) -> dict[str, Any]:
    """One load level's figures (``goodput_ratio`` is filled in once the knee is known)."""
    return {
        "level": round(routed.clients / c.capacity, 3),
        "clients": routed.clients,
        "goodput_tok_s": routed.throughput_tok_s,
        "goodput_ratio": None,
        "direct_tok_s": None if direct is None else direct.throughput_tok_s,
        "admitted_ttft_p50_s": routed.ttft_p50_s,
        "admitted_ttft_p99_s": routed.ttft_p99_s,
        "admitted_latency_p50_s": routed.latency_p50_s,
        "admitted_latency_p99_s": routed.latency_p99_s,
        "completed": routed.completed,
        "rejected_503": routed.rejected_503,
        "reject_p50_ms": routed.reject_p50_ms,
        "reject_p99_ms": routed.reject_p99_ms,
        "reasons": routed.reasons,
        "retry_after_present": routed.retry_after_present,
        "errors_non_503": routed.errors_non_503,
        "worst_state": routed.worst_state,
        "direct_worst_state": None if direct is None else direct.worst_state,
    }


def table(result: dict[str, Any]) -> Table:
    c = result["conditions"]
    t = Table(title=f"overload: {NODES} simulated M5 Max, capacity {c['capacity']} slots, "
                    f"{c['prompt_tokens']}-token prompts (simulated time; 503 latency wall-clock)")
    for column in ("run", "clients", "tok/s", "completed", "TTFT p50/p99 s", "latency p50/p99 s", "503",
                   "with Retry-After", "503 p50/p99 ms", "other errors", "worst memory"):
        t.add_column(column, justify="left" if column == "run" else "right")
    for r in result["runs"]:
        t.add_row(
            r["name"], str(r["clients"]), f"{r['throughput_tok_s']:.1f}", str(r["completed"]),
            _pair(r["ttft_p50_s"], r["ttft_p99_s"]), _pair(r["latency_p50_s"], r["latency_p99_s"]),
            str(r["rejected_503"]),
            "-" if r["retry_after_present"] is None else f"{100 * r['retry_after_present']:.0f}%",
            _pair(r["reject_p50_ms"], r["reject_p99_ms"], "{:.1f}"), str(r["errors_non_503"]),
            r["worst_state"] or "-",
        )
    return t


def levels_table(result: dict[str, Any]) -> Table:
    t = Table(title=f"admission control by load level (knee {result['knee_tok_s']:.1f} tok/s)")
    for column in ("load", "clients", "goodput tok/s", "/ knee", "direct tok/s", "admitted TTFT p50/p99 s",
                   "503", "503 p50/p99 ms", "other errors"):
        t.add_column(column, justify="right")
    for level in result["levels"]:
        ratio, direct = level["goodput_ratio"], level["direct_tok_s"]
        t.add_row(
            f"{level['level']:g}x", str(level["clients"]), f"{level['goodput_tok_s']:.1f}",
            "-" if ratio is None else f"{ratio:.3f}", "-" if direct is None else f"{direct:.1f}",
            _pair(level["admitted_ttft_p50_s"], level["admitted_ttft_p99_s"]), str(level["rejected_503"]),
            _pair(level["reject_p50_ms"], level["reject_p99_ms"], "{:.1f}"), str(level["errors_non_503"]),
        )
    return t


def plot(result: dict[str, Any], path: Path) -> None:
    """Goodput by load level with and without admission control; the admitted TTFT and refusal latency."""
    plt = plotting.pyplot()

    levels = result["levels"]
    xs = [level["level"] for level in levels]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 5.0))
    ax1.plot(xs, [level["goodput_tok_s"] for level in levels], "o-", label="router (admission control)")
    direct = [(level["level"], level["direct_tok_s"]) for level in levels if level["direct_tok_s"]]
    if direct:
        ax1.plot([d[0] for d in direct], [d[1] for d in direct], "s--", color="tab:red",
                 label="straight at the Macs")
    ax1.axhline(result["knee_tok_s"], color="grey", lw=0.8, ls=":", label="knee (2 x one Mac at its cap)")
    ax1.axhline(0.9 * result["knee_tok_s"], color="green", lw=0.8, ls=":", label="90 % of the knee")
    ticks = [f"{x:g}x" for x in xs]
    ax1.set_xscale("log", base=2)
    ax1.set_xticks(xs, ticks)
    ax1.set_ylim(bottom=0)
    ax1.set_xlabel("load (x the pool's capacity)")
    ax1.set_ylabel("tok/s (simulated)")
    ax1.set_title("goodput")
    ax1.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
    for key, label, style in (("admitted_ttft_p50_s", "admitted TTFT p50", "o-"),
                              ("admitted_ttft_p99_s", "admitted TTFT p99", "o--")):
        ax2.plot(xs, [level[key] for level in levels], style, color="tab:blue", label=label)
    ax2.set_xscale("log", base=2)
    ax2.set_xticks(xs, ticks)
    ax2.set_ylim(bottom=0)
    ax2.set_xlabel("load (x the pool's capacity)")
    ax2.set_ylabel("admitted TTFT, s (simulated)")
    handles, labels = ax2.get_legend_handles_labels()
    refusals = [(level["level"], level) for level in levels if level["reject_p50_ms"] is not None]
    if refusals:
        right = ax2.twinx()
        for key, label, style in (("reject_p50_ms", "503 p50", "s-"), ("reject_p99_ms", "503 p99", "s--")):
            right.plot([r[0] for r in refusals], [r[1][key] for r in refusals], style, color="tab:orange",
                       label=label)
        right.set_yscale("log")
        right.set_ylabel("503 latency, ms (wall-clock, queue wait included)")
        more = right.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    ax2.legend(handles, labels, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=4)
    ax2.set_title("admitted TTFT and refusal latency")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _pair(p50: float | None, p99: float | None, spec: str = "{:.2f}") -> str:
    return "-" if p50 is None or p99 is None else f"{spec.format(p50)} / {spec.format(p99)}"


def build_parser() -> argparse.ArgumentParser:
    d = Conditions()
    p = argparse.ArgumentParser(prog="macpool bench overload", description=__doc__.splitlines()[0])
    load = p.add_mutually_exclusive_group()
    load.add_argument("--levels", type=_levels, default=d.levels,
                      help="load levels as multiples of the pool's capacity (2 x --cap), e.g. 1,2,4,10; "
                           "each on a fresh pool (default: 2)")
    load.add_argument("--clients", type=int,
                      help="one run of exactly this many clients (instead of --levels)")
    p.add_argument("--no-direct", dest="direct", action="store_false",
                   help="skip the runs straight at the Macs (without admission control)")
    p.add_argument("--prompt-tokens", type=int, default=d.prompt_tokens)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--duration", type=float, default=d.duration_s, help="simulated seconds of load per run")
    p.add_argument("--speed", type=float, default=d.speed, help="simulated seconds per wall second")
    p.add_argument("--cap", type=int, default=d.cap, help="each agent's cap (the single-node knee)")
    p.add_argument("--queue-size", type=int, default=d.queue_size)
    p.add_argument("--queue-timeout", type=float, default=d.queue_timeout)
    p.add_argument("--json", type=Path, help="write the result as JSON here")
    p.add_argument("--plot", type=Path, help="write a PNG plot of the load levels here")
    p.add_argument("--logs", type=Path, help="keep the processes' logs in this directory")
    return p


def _levels(text: str) -> tuple[float, ...]:
    try:
        levels = tuple(float(part) for part in text.split(","))
    except ValueError:
        message = f"--levels takes numbers separated by commas, not {text!r}"
        raise argparse.ArgumentTypeError(message) from None
    if any(not level > 0 for level in levels):
        raise argparse.ArgumentTypeError(f"--levels must all be above 0, not {text!r}")
    return levels


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.plot:
        plotting.check()
    conditions = Conditions(
        levels=args.levels, clients=args.clients, direct=args.direct, prompt_tokens=args.prompt_tokens,
        max_tokens=args.max_tokens, duration_s=args.duration, speed=args.speed, cap=args.cap,
        queue_size=args.queue_size, queue_timeout=args.queue_timeout,
    )
    console = Console(width=None if sys.stdout.isatty() else 140)
    with contextlib.ExitStack() as exits:
        scratch = exits.enter_context(tempfile.TemporaryDirectory(prefix="macpool-overload-"))
        log_dir = args.logs or Path(scratch)
        log_dir.mkdir(parents=True, exist_ok=True)
        result = run(conditions, log_dir, Console(stderr=True))
    console.print(table(result))
    summary = {k: v for k, v in result.items() if k not in ("conditions", "runs", "levels")}
    console.print_json(json.dumps(summary))
    console.print(levels_table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if args.plot:
        plot(result, args.plot)
    return 0
