"""``macpool bench sweep``: step concurrency up against one server and record the curve.

Per level: aggregate generated tokens/s, p50 latency (and its ratio to the first level), TTFT p50, the peak
pinned memory and worst memory state (from ``/sim/memory``/``/sim/stats`` when the target is a simulator,
else null), and counts of 503s and other errors. Against a simulator every figure is in simulated time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from macpool import plotting
from macpool.bench.load import ClosedLoop, RequestRecord, SimClock, chat_body
from macpool.sim.machine import STATE_ORDER

ROW_KEYS = [
    "concurrency", "throughput_tok_s", "p50_latency_s", "p50_ratio", "ttft_p50_s", "peak_pinned_gb", "state",
    "rejected", "errors",
]


@dataclass
class Row:
    concurrency: int
    throughput_tok_s: float
    p50_latency_s: float | None
    p50_ratio: float | None
    ttft_p50_s: float | None
    peak_pinned_gb: float | None
    state: str | None
    rejected: int
    errors: int


@dataclass
class SweepConfig:
    target: str
    concurrency: list[int]
    prompt_tokens: int = 4096
    max_tokens: int = 256
    requests_per_client: int = 1
    duration_s: float | None = None  # per level, in the target's time (simulated for a simulator)
    model: str | None = None


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


async def run_level(
    config: SweepConfig, concurrency: int, clock: SimClock, on_record: Callable[[RequestRecord], None]
) -> Row:
    """One closed-loop level; times are converted to simulated seconds against a simulator."""
    peak: dict[str, Any] = {"pinned": None, "state": None}

    async def watch_memory() -> None:
        while True:
            memory = await clock.memory()
            if memory is not None:
                pinned = float(memory["pinned_gb"])
                peak["pinned"] = max(pinned, peak["pinned"] or 0.0)
                state = str(memory["state"])
                if peak["state"] is None or STATE_ORDER[state] > STATE_ORDER[peak["state"]]:
                    peak["state"] = state
            await asyncio.sleep(0.1)

    start_busy = float((await clock.reset())["busy_time_s"]) if clock.is_sim else 0.0
    duration = config.duration_s / clock.speed if config.duration_s is not None else None
    loop = ClosedLoop(
        config.target, concurrency, chat_body(config.prompt_tokens, config.max_tokens, config.model),
        requests_per_client=None if duration is not None else config.requests_per_client,
        duration_s=duration, on_record=on_record,
    )
    watcher = asyncio.create_task(watch_memory()) if clock.is_sim else None
    try:
        records = await loop.run()
    finally:
        if watcher is not None:
            watcher.cancel()
    busy = 0.0
    if clock.is_sim:
        stats = await clock.stats()
        busy = float(stats["busy_time_s"]) - start_busy
        peak["pinned"] = max(float(stats["peak_pinned_gb"]), peak["pinned"] or 0.0)
        worst = str(stats["worst_state"])
        if peak["state"] is None or STATE_ORDER[worst] > STATE_ORDER[peak["state"]]:
            peak["state"] = worst
    ok = [r for r in records if r.ok]
    produced = sum(r.tokens for r in records)
    # from the first request sent to the last one finished (not the bookkeeping around the level)
    window = max((r.started + r.latency_s for r in records), default=0.0) - min(
        (r.started for r in records), default=0.0
    )
    elapsed, scale = window, 1.0
    if clock.is_sim and busy > 0 and window > 0:
        # the machine's own clock while it worked: client overhead (idle gaps, which a fast simulator
        # would multiply by its speed) does not count, and a simulator lagging behind its nominal speed
        # is measured at the rate it really ran
        elapsed, scale = busy, busy / window
    p50 = median([r.latency_s * scale for r in ok])
    ttft = median([r.ttft_s * scale for r in ok if r.ttft_s is not None])
    return Row(
        concurrency=concurrency,
        throughput_tok_s=round(produced / elapsed, 2) if elapsed > 0 else 0.0,
        p50_latency_s=None if p50 is None else round(p50, 3),
        p50_ratio=None,
        ttft_p50_s=None if ttft is None else round(ttft, 3),
        peak_pinned_gb=None if peak["pinned"] is None else round(peak["pinned"], 2),
        state=peak["state"],
        rejected=sum(1 for r in records if r.status in (429, 503)),
        errors=sum(1 for r in records if not r.ok and r.status not in (429, 503)),
    )


async def run_sweep(config: SweepConfig, console: Console | None = None) -> list[Row]:
    console = console or Console(stderr=True)
    rows: list[Row] = []
    async with httpx.AsyncClient(base_url=config.target, timeout=30) as client:
        clock = SimClock(client)
        await clock.probe()
        total = sum(n * config.requests_per_client for n in config.concurrency)
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=console, transient=True) as progress:
            bar = progress.add_task("sweep", total=total if config.duration_s is None else None)
            for n in config.concurrency:
                progress.update(bar, description=f"concurrency {n}")
                rows.append(await run_level(config, n, clock, lambda _r: progress.advance(bar)))
    base = rows[0].p50_latency_s if rows else None
    for row in rows:
        if base and row.p50_latency_s is not None:
            row.p50_ratio = round(row.p50_latency_s / base, 2)
    return rows


def fmt(value: float | int | str | None, spec: str = "") -> str:
    if value is None:
        return "-"
    return format(value, spec) if spec else str(value)


def table(rows: list[Row], title: str) -> Table:
    t = Table(title=title)
    for name in ("conc", "tok/s", "p50 s", "p50 x", "TTFT p50 s", "peak GB", "state", "503", "errors"):
        t.add_column(name, justify="right")
    for r in rows:
        t.add_row(
            str(r.concurrency), fmt(r.throughput_tok_s, ".0f"), fmt(r.p50_latency_s, ".2f"),
            fmt(r.p50_ratio, ".1f"), fmt(r.ttft_p50_s, ".2f"), fmt(r.peak_pinned_gb, ".1f"), fmt(r.state),
            str(r.rejected), str(r.errors),
        )
    return t


def rows_json(rows: list[Row]) -> list[dict[str, Any]]:
    return [{key: asdict(r)[key] for key in ROW_KEYS} for r in rows]


def plot(rows: list[Row], path: Path, title: str, seed: list[tuple[int, float]] | None = None,
         wired_limit_gb: float | None = None) -> None:
    plt = plotting.pyplot()

    xs = [r.concurrency for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax1.plot(xs, [r.throughput_tok_s for r in rows], "o-", label="measured")
    if seed:
        ax1.plot([s[0] for s in seed], [s[1] for s in seed], "s--", color="grey", label="seed")
    ax1.set_xlabel("concurrent requests")
    ax1.set_ylabel("aggregate tokens/s")
    ax1.set_title("throughput")
    ax1.legend()
    ax1.grid(alpha=0.3)
    pinned = [(r.concurrency, r.peak_pinned_gb) for r in rows if r.peak_pinned_gb is not None]
    if pinned:
        xs_p, ys_p = [p[0] for p in pinned], [p[1] for p in pinned]
        ax2.plot(xs_p, ys_p, "o-", color="tab:red", label="peak pinned GB")
        if wired_limit_gb:
            ax2.axhline(wired_limit_gb, color="tab:red", ls=":", label="wired limit")
        ax2.set_ylabel("GB")
    ratio = ax2.twinx()
    ratio.plot(xs, [r.p50_ratio for r in rows], "^-", color="tab:green", label="p50 latency ratio")
    ratio.set_ylabel("p50 latency / first level")
    ax2.set_xlabel("concurrent requests")
    ax2.set_title("memory and latency")
    lines = ax2.get_legend_handles_labels()
    more = ratio.get_legend_handles_labels()
    ax2.legend(lines[0] + more[0], lines[1] + more[1], loc="upper left")
    ax2.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from exc
    if not levels or any(n <= 0 for n in levels):
        raise argparse.ArgumentTypeError(f"concurrency levels must be positive: {text!r}")
    return levels


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="macpool bench sweep", description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True, help="base URL of a llama-server, simulator, agent or router")
    p.add_argument("--concurrency", type=parse_levels, default=[1, 4, 8, 12, 16])
    p.add_argument("--prompt-tokens", type=int, default=4096)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--requests", type=int, default=1, help="requests per client per level (default 1)")
    p.add_argument("--duration", type=float,
                   help="seconds per level instead of --requests (simulated for a sim)")
    p.add_argument("--model", help="model field to send")
    p.add_argument("--json", type=Path, help="write the rows as JSON")
    p.add_argument("--plot", type=Path, help="write a PNG plot")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.plot:
        plotting.check()
    config = SweepConfig(
        target=args.target.rstrip("/"), concurrency=args.concurrency, prompt_tokens=args.prompt_tokens,
        max_tokens=args.max_tokens, requests_per_client=args.requests, duration_s=args.duration,
        model=args.model,
    )
    console = Console(width=None if sys.stdout.isatty() else 120)
    try:
        rows = asyncio.run(run_sweep(config, Console(stderr=True)))
    except httpx.HTTPError as exc:
        print(f"macpool bench sweep: cannot reach {config.target}: {exc}", file=sys.stderr)
        return 1
    console.print(table(rows, f"sweep {config.target} ({config.prompt_tokens}-token prompts)"))
    if args.json:
        args.json.write_text(json.dumps(rows_json(rows), indent=2) + "\n")
    if args.plot:
        plot(rows, args.plot, f"sweep {config.target}")
    return 0
