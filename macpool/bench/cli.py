"""``macpool bench <name>``: each benchmark is a module with ``main(argv) -> int``, named in one table."""

from __future__ import annotations

import importlib
import os
import signal
import sys
from types import FrameType

# name -> (module of macpool.bench, one-line help). Add a benchmark by adding a row.
BENCHMARKS: dict[str, tuple[str, str]] = {
    "sweep": ("sweep", "step concurrency up against one server and record the curve"),
    "seed-table": ("seed_table", "reproduce the seed's measured table on the simulated M5 Max"),
    "overload": ("overload", "1x-10x the pool's capacity, admission control vs straight at the Macs"),
    "overhead": ("overhead", "added TTFT/latency of router + agent vs straight to the simulator"),
    "relay": ("relay", "SSE chunks/s and requests/s one router core relays; CPU per 1,000 requests"),
    "reject": ("reject", "503s per second one router core returns when the pool is full, and p99"),
    "peers": ("peers", "added TTFT and relay rate beside nginx and the LiteLLM proxy, as ratios"),
    "scale": ("scale", "50 nodes x 2 routers: decision time, Redis round trips, no over-admission"),
    "soak": ("soak", "1.5x capacity for minutes with node churn: no errors but 503, no leaks"),
    "affinity": ("affinity", "long multi-turn chats: TTFT and throughput, prefix affinity on vs off"),
    "chaos": ("chaos", "five faults under streaming load (Sentinel): outcomes, recovery, leaks"),
    "elastic": ("elastic", "0.3x -> 3x -> 0.3x on 4 Macs, 2 in standby under autoscale, vs static"),
    "fairness": ("fairness", "flooding vs light tenant: the light one's queue wait, fair vs FIFO"),
    "placement": ("placement", "a mixed pool of Macs at 0.5x-4x load: macpool vs LiteLLM vs nginx"),
    "models": ("models", "model A -> B -> A on Macs holding one at a time: cold starts, memory"),
    "prefill": ("prefill", "llama-server's prefill of a recorded Claude Code or Codex turn"),
    "agents": ("agents", "coding-agent sessions on a mixed pool: macpool vs nginx vs LiteLLM"),
}


def usage() -> str:
    lines = ["usage: macpool bench <name> [options]", "", "benchmarks:"]
    lines += [f"  {name:<12} {help_}" for name, (_, help_) in BENCHMARKS.items()]
    return "\n".join(lines)


def _stop(signum: int, frame: FrameType | None) -> None:
    """SIGTERM (a timeout, a cancelled job) ends a bench the way Ctrl-C does - as a SIGINT, which asyncio's
    runner turns into cancelling the run and then KeyboardInterrupt - so that what it started (Redis,
    simulators, agents, routers) is stopped on the way out instead of left running. Once: a second SIGTERM
    must not cut that cleanup short."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.kill(os.getpid(), signal.SIGINT)


def main(argv: list[str]) -> int:
    # Ctrl-C too, even when started with SIGINT ignored (a background job of a non-interactive shell):
    # asyncio's runner only takes SIGINT over (cancelling the run cleanly) when its handler is Python's own
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _stop)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    entry = BENCHMARKS.get(argv[0])
    if entry is None:
        print(f"macpool bench: unknown benchmark {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    result: int = importlib.import_module(f"macpool.bench.{entry[0]}").main(argv[1:])
    return result
