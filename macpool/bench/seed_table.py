"""``macpool bench seed-table``: reproduce the seed's measured table on the simulated M5 Max.

Starts ``macpool sim --preset m5max-128g-14b-q4`` as a child process (16 slots, no admission control),
runs the seed's conditions (1/4/8/12/16 concurrent closed-loop streaming clients, ~4K-token prompts) and
prints our row beside the seed's. Exits 1 if any throughput or pinned-memory figure is more than 15% off or
a memory state differs (the seed gives no number for 16's memory, only "swap": there only the state is
compared).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from macpool import plotting
from macpool.bench.sweep import Row, SweepConfig, plot, rows_json, run_sweep
from macpool.dev.stack import ProcessError, Stack
from macpool.sim.machine import load_preset

PRESET = "m5max-128g-14b-q4"
TOLERANCE = 0.15


@dataclass(frozen=True)
class SeedRow:
    concurrency: int
    throughput_tok_s: float
    p50_ratio: float
    pinned_gb: float | None  # None: the seed says "swap"
    state: str
    label: str  # the seed's wording


# ../shared/seed/: 128 GB M5 Max, 14B-class model at 4-bit, llama-server with continuous batching, ~4K prompts
SEED = [
    SeedRow(1, 82, 1.0, 11, "healthy", "Healthy"),
    SeedRow(4, 190, 1.7, 19, "healthy", "Healthy"),
    SeedRow(8, 240, 3.1, 30, "near_ceiling", "Near ceiling"),
    SeedRow(12, 210, 6.4, 41, "paging", "Paging begins"),
    SeedRow(16, 70, 18.0, None, "collapsed", "Collapsed"),
]


@dataclass(frozen=True)
class Conditions:
    prompt_tokens: int = 4096
    max_tokens: int = 1024
    parallel: int = 16
    ctx_per_slot: int = 8192
    speed: float = 20.0
    requests_per_client: int = 1


def deviation(ours: float | None, seed: float | None) -> float | None:
    if ours is None or seed is None or seed == 0:
        return None
    return ours / seed - 1.0


def compare(rows: list[Row]) -> list[dict[str, Any]]:
    by_level = {r.concurrency: r for r in rows}
    out = []
    for seed in SEED:
        ours = by_level.get(seed.concurrency)
        thr_dev = deviation(ours.throughput_tok_s if ours else None, seed.throughput_tok_s)
        mem_dev = deviation(ours.peak_pinned_gb if ours else None, seed.pinned_gb)
        state_ok = ours is not None and ours.state == seed.state
        ok = (
            ours is not None
            and thr_dev is not None and abs(thr_dev) <= TOLERANCE
            and (seed.pinned_gb is None or (mem_dev is not None and abs(mem_dev) <= TOLERANCE))
            and state_ok
        )
        out.append({
            "concurrency": seed.concurrency,
            "throughput_deviation": None if thr_dev is None else round(thr_dev, 4),
            "pinned_deviation": None if mem_dev is None else round(mem_dev, 4),
            "state_matches": state_ok,
            "ok": ok,
        })
    return out


def pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:+.0f}%"


def table(rows: list[Row], comparison: list[dict[str, Any]]) -> Table:
    t = Table(title=f"seed table: ours ({PRESET} simulator) vs the seed (M5 Max, 14B q4, ~4K prompts)")
    for name in ("conc", "tok/s", "seed", "dev", "p50 x", "seed", "pinned GB", "seed", "dev", "state",
                 "seed", "ok"):
        t.add_column(name, justify="right")
    by_level = {r.concurrency: r for r in rows}
    for seed, cmp in zip(SEED, comparison, strict=True):
        r = by_level[seed.concurrency]
        t.add_row(
            str(seed.concurrency),
            f"{r.throughput_tok_s:.0f}", f"{seed.throughput_tok_s:.0f}", pct(cmp["throughput_deviation"]),
            "-" if r.p50_ratio is None else f"{r.p50_ratio:.1f}", f"{seed.p50_ratio:g}",
            "-" if r.peak_pinned_gb is None else f"{r.peak_pinned_gb:.1f}",
            "swap" if seed.pinned_gb is None else f"~{seed.pinned_gb:g}", pct(cmp["pinned_deviation"]),
            r.state or "-", seed.label, "[green]yes[/]" if cmp["ok"] else "[red]NO[/]",
        )
    return t


def run(conditions: Conditions, console: Console, log: Path | None = None) -> list[Row]:
    with Stack() as processes:
        sim = processes.sim(
            "sim", "--preset", PRESET, "--host", "127.0.0.1", "--parallel", str(conditions.parallel),
            "--ctx-size", str(conditions.parallel * conditions.ctx_per_slot),
            "--speed", str(conditions.speed), "--metrics", timeout=30, log_path=log,
        )
        config = SweepConfig(
            target=sim.url, concurrency=[s.concurrency for s in SEED], prompt_tokens=conditions.prompt_tokens,
            max_tokens=conditions.max_tokens, requests_per_client=conditions.requests_per_client,
        )
        return asyncio.run(run_sweep(config, console))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="macpool bench seed-table", description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, help="write rows, the seed and the comparison as JSON")
    p.add_argument("--plot", type=Path, help="write a PNG plot")
    p.add_argument("--speed", type=float, default=Conditions.speed, help="simulator time compression")
    p.add_argument("--log", type=Path, help="simulator log file")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.plot:
        plotting.check()
    conditions = Conditions(speed=args.speed)
    console = Console(width=None if sys.stdout.isatty() else 132)
    started = time.monotonic()
    try:
        rows = run(conditions, Console(stderr=True), args.log)
    except ProcessError as exc:
        print(f"macpool bench seed-table: simulator failed: {exc}", file=sys.stderr)
        return 1
    wall = time.monotonic() - started
    comparison = compare(rows)
    passed = all(c["ok"] for c in comparison)
    console.print(table(rows, comparison))
    console.print(
        f"{conditions.prompt_tokens}-token prompts, {conditions.max_tokens} generated tokens per request, "
        f"{conditions.parallel} slots, simulator at {conditions.speed:g}x; {wall:.0f} s wall. "
        + ("[green]PASS[/]: within 15% and same states" if passed else "[red]FAIL[/]: see the dev/ok columns")
    )
    if args.json:
        document = {
            "command": "macpool bench seed-table",
            "preset": PRESET,
            "conditions": conditions.__dict__,
            "rows": rows_json(rows),
            "seed": [s.__dict__ for s in SEED],
            "comparison": comparison,
            "pass": passed,
            "wall_seconds": round(wall, 1),
        }
        args.json.write_text(json.dumps(document, indent=2) + "\n")
    if args.plot:
        machine = load_preset(PRESET)
        plot(
            rows, args.plot, f"{PRESET}: simulated vs seed (~4K-token prompts)",
            seed=[(s.concurrency, s.throughput_tok_s) for s in SEED], wired_limit_gb=machine.wired_limit_gb,
        )
    return 0 if passed else 1
