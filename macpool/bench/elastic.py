"""``macpool bench elastic``: a step load 0.3x -> 3x -> 0.3x on four simulated Macs, two of them starting
in standby under ``macpool autoscale``, against a static pool of four.

Each pool: a Redis-protocol server, four simulators each behind an agent (cap ``--cap``), one router
(``--cold-start-timeout``), and - for the elastic pool - the autoscaler, with two agents ``--elastic`` and
two ``--standby``. Closed-loop clients (the load factor x the capacity of four nodes) send non-streamed
chat completions; a 503 is counted by its reason, and its client waits ``--retry-pause`` before the next.
Reported, for each pool:

- the time from the step up until the added capacity serves (the router's ready capacity first above its
  level before the step);
- requests lost (anything but a 200 or a 503: must be 0) and 503s by reason;
- goodput (completed requests per second) during the 3x step;
- node-seconds: the integral of the nodes not in standby over the run.

The agents front simulators that are already up, so "loading" takes one heartbeat: the time to serve is the
control loop's reaction (up-delay, heartbeats, the router's refresh), not a model load.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from macpool.bench.stack import Stack

AGENT_TOKEN = "elastic-agent-token"
PRESET = "m5max-128g-14b-q4"
NODES = 4
STANDBY_STATES = ("standby",)


@dataclass
class ElasticOptions:
    cap: int = 2
    speed: float = 2.0
    max_tokens: int = 24
    low: float = 0.3
    high: float = 3.0
    low_s: float = 8.0
    high_s: float = 20.0
    tail_s: float = 20.0
    up_delay: float = 1.0
    down_delay: float = 5.0
    cooldown: float = 3.0
    cold_start_timeout: float = 30.0
    queue_timeout: float = 2.0
    retry_pause: float = 0.2
    sample_s: float = 0.25
    plot: Path | None = None


@dataclass
class Outcome:
    t: float  # seconds from the start of the load, at its end
    phase: str
    status: int
    reason: str = ""


@dataclass
class PoolRun:
    label: str
    requests: int = 0
    ok: int = 0
    lost: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    goodput_high_rps: float = 0.0
    time_to_added_capacity_s: float | None = None
    node_seconds: float = 0.0
    timeline: list[dict[str, float]] = field(default_factory=list)


def phases(opts: ElasticOptions) -> list[tuple[str, float, float]]:
    """(name, load factor, seconds) of each step."""
    return [("low", opts.low, opts.low_s), ("high", opts.high, opts.high_s), ("tail", opts.low, opts.tail_s)]


def start_pool(stack: Stack, opts: ElasticOptions, elastic: bool) -> str:
    """Start one pool; returns its router's URL."""
    procs = stack.procs
    redis_url = procs.redis()
    for i in range(NODES):
        sim = procs.sim(
            f"sim-{i}", "--preset", PRESET, "--parallel", str(opts.cap), "--speed", str(opts.speed)
        )
        mode = () if not elastic else ("--standby",) if i >= NODES // 2 else ("--elastic",)
        procs.agent(
            f"agent-{i}",
            sim.url,
            redis_url,
            f"mac-{i}",
            "--cap",
            str(opts.cap),
            "--token",
            AGENT_TOKEN,
            "--heartbeat-interval",
            "0.25",
            "--log-level",
            "warning",
            *mode,
        )
    router = procs.router(
        "router",
        redis_url,
        "--agent-token",
        AGENT_TOKEN,
        "--refresh-interval",
        "0.25",
        "--log-level",
        "warning",
        "--cold-start-timeout",
        str(opts.cold_start_timeout),
        "--queue-timeout",
        str(opts.queue_timeout),
    )
    if elastic:
        procs.autoscale(
            "autoscale",
            redis_url,
            "--interval",
            "0.25",
            "--lease",
            "2",
            "--up-delay",
            str(opts.up_delay),
            "--down-delay",
            str(opts.down_delay),
            "--cooldown",
            str(opts.cooldown),
            "--min-nodes",
            "2",
            "--max-nodes",
            str(NODES),
        )
    procs.wait_nodes(router.url, NODES // 2 if elastic else NODES, exact=True, timeout=60)
    return router.url


async def drive(url: str, model: str, opts: ElasticOptions, run: PoolRun) -> list[Outcome]:
    """The step load, closed loop; samples the router's pool view meanwhile."""
    outcomes: list[Outcome] = []
    plan = phases(opts)
    total = sum(seconds for _, _, seconds in plan)
    per_node = opts.cap
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": opts.max_tokens}
    start = time.monotonic()

    def phase_at(t: float) -> tuple[str, int]:
        edge = 0.0
        for name, factor, seconds in plan:
            edge += seconds
            if t < edge:
                return name, round(factor * per_node * NODES)
        return "", 0

    async def client(index: int, http: httpx.AsyncClient) -> None:
        while (t := time.monotonic() - start) < total:
            name, clients = phase_at(t)
            if index >= clients:
                await asyncio.sleep(0.05)
                continue
            try:
                response = await http.post(url + "/v1/chat/completions", json=body)
                status, reason = response.status_code, response.headers.get("X-Macpool-Reason", "")
            except httpx.HTTPError as exc:
                status, reason = 0, type(exc).__name__
            outcomes.append(Outcome(time.monotonic() - start, name, status, reason))
            if status != 200:
                await asyncio.sleep(opts.retry_pause)

    async def sample(http: httpx.AsyncClient) -> None:
        while (t := time.monotonic() - start) < total + 1:
            try:
                view = (await http.get(url + "/api/pool")).json()
            except (httpx.HTTPError, ValueError):
                await asyncio.sleep(opts.sample_s)
                continue
            nodes = view.get("nodes") or []
            pool = view.get("pool") or {}
            run.timeline.append(
                {
                    "t": round(t, 2),
                    "demand": float(pool.get("busy", 0)) + float(pool.get("queued", 0)),
                    "ready_capacity": float(pool.get("capacity", 0)),
                    "nodes_ready": float(pool.get("nodes_ready", 0)),
                    "nodes_on": float(sum(1 for n in nodes if n.get("state") not in STANDBY_STATES)),
                    "clients": float(phase_at(t)[1]),
                }
            )
            await asyncio.sleep(opts.sample_s)

    most = round(max(f for _, f, _ in plan) * per_node * NODES)
    limits = httpx.Limits(max_connections=most + 8, max_keepalive_connections=most + 8)
    async with httpx.AsyncClient(timeout=60, limits=limits) as http:
        await asyncio.gather(sample(http), *(client(i, http) for i in range(most)))
    return outcomes


def summarize(run: PoolRun, outcomes: list[Outcome], opts: ElasticOptions) -> None:
    run.requests = len(outcomes)
    run.ok = sum(1 for o in outcomes if o.status == 200)
    run.lost = sum(1 for o in outcomes if o.status not in (200, 503))
    run.rejected = dict(Counter(o.reason or "?" for o in outcomes if o.status == 503))
    run.goodput_high_rps = round(
        sum(1 for o in outcomes if o.phase == "high" and o.status == 200) / opts.high_s, 2
    )
    step = opts.low_s
    before = max((p["ready_capacity"] for p in run.timeline if p["t"] < step), default=0.0)
    above = [p["t"] for p in run.timeline if p["t"] >= step and p["ready_capacity"] > before]
    run.time_to_added_capacity_s = round(above[0] - step, 2) if above else None
    seconds = 0.0
    for a, b in zip(run.timeline, run.timeline[1:], strict=False):
        seconds += a["nodes_on"] * (b["t"] - a["t"])
    run.node_seconds = round(seconds, 1)


def run_pool(stack: Stack, opts: ElasticOptions, elastic: bool) -> PoolRun:
    url = start_pool(stack, opts, elastic)
    model = httpx.get(url + "/v1/models", timeout=5).json()["data"][0]["id"]
    run = PoolRun("elastic" if elastic else "static")
    outcomes = asyncio.run(drive(url, model, opts, run))
    summarize(run, outcomes, opts)
    return run


def run(opts: ElasticOptions, logs: Path | None) -> dict[str, Any]:
    results: dict[str, Any] = {
        "options": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(opts).items()}
    }
    for elastic in (True, False):
        with (
            Stack(logs=logs / ("elastic" if elastic else "static"), keep_logs=True)
            if logs
            else Stack() as stack
        ):
            result = run_pool(stack, opts, elastic)
        results[result.label] = asdict(result)
    e, s = results["elastic"], results["static"]
    results["goodput_high_ratio"] = (
        round(e["goodput_high_rps"] / s["goodput_high_rps"], 3) if s["goodput_high_rps"] else None
    )
    results["node_seconds_ratio"] = (
        round(e["node_seconds"] / s["node_seconds"], 3) if s["node_seconds"] else None
    )
    if opts.plot is not None:
        plot(results, opts.plot)
    return results


def table(result: dict[str, Any]) -> str:
    rows = [
        f"{'pool':<8} {'requests':>8} {'ok':>6} {'lost':>5} {'goodput 3x':>10} {'to serve':>9} "
        f"{'node-s':>7}  503s by reason"
    ]
    for label in ("elastic", "static"):
        r = result[label]
        serve = "-" if r["time_to_added_capacity_s"] is None else f"{r['time_to_added_capacity_s']:.2f}s"
        rejected = ", ".join(f"{k} {v}" for k, v in sorted(r["rejected"].items())) or "-"
        rows.append(
            f"{label:<8} {r['requests']:>8} {r['ok']:>6} {r['lost']:>5} {r['goodput_high_rps']:>8.2f}/s "
            f"{serve:>9} {r['node_seconds']:>7.1f}  {rejected}"
        )
    rows.append(
        f"elastic / static: goodput during 3x {result['goodput_high_ratio']}, "
        f"node-seconds {result['node_seconds_ratio']}"
    )
    return "\n".join(rows)


def plot(result: dict[str, Any], out: Path) -> None:
    from macpool import plotting

    plt = plotting.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), sharey=True)
    for ax, label in zip(axes, ("elastic", "static"), strict=True):
        timeline = result[label]["timeline"]
        ts = [p["t"] for p in timeline]
        ax.plot(ts, [p["demand"] for p in timeline], label="demand (busy + queued)")
        ax.plot(ts, [p["ready_capacity"] for p in timeline], label="ready capacity")
        ax.plot(ts, [p["clients"] for p in timeline], ":", label="clients")
        twin = ax.twinx()
        twin.step(ts, [p["nodes_on"] for p in timeline], "k--", lw=0.8, label="nodes on", where="post")
        twin.set_ylim(0, NODES + 0.5)
        twin.set_ylabel("nodes not in standby")
        ax.set_title(f"{label} pool")
        ax.set_xlabel("seconds")
        ax.set_ylabel("slots")
        ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="macpool bench elastic", description=__doc__.split("\n\n")[0])
    defaults = ElasticOptions()
    p.add_argument("--cap", type=int, default=defaults.cap, help="slots per node (default 2)")
    p.add_argument("--speed", type=float, default=defaults.speed,
                   help="simulator speed-up (default 2: the Macs, not this machine, are the limit)")
    p.add_argument("--low-seconds", type=float, default=defaults.low_s, help="0.3x step before (8)")
    p.add_argument("--high-seconds", type=float, default=defaults.high_s, help="3x step (20)")
    p.add_argument("--tail-seconds", type=float, default=defaults.tail_s, help="0.3x step after (20)")
    p.add_argument("--up-delay", type=float, default=defaults.up_delay, help="the autoscaler's (1)")
    p.add_argument("--down-delay", type=float, default=defaults.down_delay, help="the autoscaler's (5)")
    p.add_argument("--plot", type=Path, help="PNG of demand, ready capacity and nodes over time")
    p.add_argument("--json", type=Path, help="write the whole result here")
    p.add_argument("--logs", type=Path, help="keep every process's log in this folder")
    a = p.parse_args(argv)
    if a.plot is not None:
        from macpool import plotting

        plotting.check()
    opts = ElasticOptions(
        cap=a.cap,
        speed=a.speed,
        low_s=a.low_seconds,
        high_s=a.high_seconds,
        tail_s=a.tail_seconds,
        up_delay=a.up_delay,
        down_delay=a.down_delay,
        plot=a.plot,
    )
    result = run(opts, a.logs)
    print(table(result))
    details = {"options", "elastic", "static"}
    import json

    print(json.dumps({k: v for k, v in result.items() if k not in details}))
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0
