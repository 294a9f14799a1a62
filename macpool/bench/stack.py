"""The processes of one performance run on the process harness (``macpool.dev.stack``): the bench's fast
upstream, and simulators, agents and routers pinned to a CPU with ``taskset`` where a bench asks."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import TracebackType
from typing import Any

from macpool.bench.cpu import pinned
from macpool.bench.upstream import UpstreamConfig
from macpool.bench.wire import MODEL
from macpool.dev.stack import Proc, free_port
from macpool.dev.stack import Stack as ProcStack


class Stack:
    """Every process of one benchmark run, on the process harness (``macpool.dev.stack``): the bench's own
    upstream, and simulators, agents and routers pinned to a CPU with ``taskset`` where a bench asks."""

    def __init__(self, logs: Path | None = None, keep_logs: bool = False) -> None:
        self.procs = ProcStack(keep_logs=keep_logs) if logs is None else ProcStack(logs, keep_logs=keep_logs)

    @property
    def logs(self) -> Path:
        return self.procs.logs

    @property
    def keep_logs(self) -> bool:
        return self.procs.keep_logs

    @keep_logs.setter
    def keep_logs(self, keep: bool) -> None:
        self.procs.keep_logs = keep

    def start_redis(self) -> str:
        return self.procs.redis()

    def spawn(
        self,
        name: str,
        argv: list[str],
        port: int,
        ready: str = "/health",
        timeout: float = 60.0,
        env: dict[str, str] | None = None,
    ) -> Proc:
        return self.procs.spawn(name, argv, port, ready=ready, timeout=timeout, env=env)

    def upstream(
        self,
        name: str,
        config: UpstreamConfig,
        redis_url: str | None = None,
        prefix: str = "fast-",
        cpu: int | None = None,
    ) -> Proc:
        port = free_port()
        argv = [
            sys.executable, "-m", "macpool.bench.upstream", "--port", str(port),
            "--events", str(config.events), "--interval-ms", str(config.interval_s * 1000),
            "--first-delay-ms", str(config.first_delay_s * 1000), "--capacity", str(config.capacity),
            "--nodes", str(config.nodes), "--tokens", str(config.tokens), "--node-prefix", prefix,
        ]
        if redis_url:
            argv += ["--redis-url", redis_url]
        if config.events_from_body:
            argv.append("--events-from-body")
        return self.spawn(name, pinned(argv, cpu), port)

    def sim(self, name: str, machine: Path, parallel: int, speed: float, cpu: int | None = None) -> Proc:
        return self.procs.sim(
            name, "--machine", str(machine), "--parallel", str(parallel), "--speed", str(speed),
            "--alias", MODEL, prefix=pinned([], cpu),
        )

    def agent(
        self, name: str, upstream: str, redis_url: str, node_id: str, cap: int, cpu: int | None = None
    ) -> Proc:
        return self.procs.agent(
            name, upstream, redis_url, node_id, "--cap", str(cap), "--log-level", "warning",
            prefix=pinned([], cpu),
        )

    def router(self, name: str, redis_url: str, *extra: str, cpu: int | None = None) -> Proc:
        return self.procs.router(name, redis_url, "--log-level", "warning", *extra, prefix=pinned([], cpu))

    def close(self) -> None:
        self.procs.stop()

    def __enter__(self) -> Stack:
        self.procs.__enter__()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.procs.__exit__(exc_type, exc, tb)


# A machine for overhead runs: the seed box's decode speed, but memory so roomy that hundreds of
# concurrent short requests never page (the bench measures the proxy, not the Mac).
FAST_MACHINE: dict[str, Any] = {
    "name": "bench-fast",
    "description": "roomy machine for proxy-overhead benchmarks",
    "model_name": "model-bench.gguf",
    "total_gb": 4096,
    "wired_limit_gb": 4000,
    "weights_gb": 1.0,
    "base_gb": 0.1,
    "seq_overhead_gb": 0.001,
    "kv_mb_per_token": 0.001,
    "decode_t0_ms": 9.24,
    "decode_t1_ms": 0.05,
    "prefill_tok_s": 100000,
    "paging_scale_gb": 3.5,
    "paging_exponent": 1.3,
    "collapse_overflow_gb": 8.0,
    "ctx_per_slot": 2048,
    "default_parallel": 8,
    "typical_prompt_tokens": 64,
    "typical_output_tokens": 16,
    "default_n_predict": 16,
}


def write_machine(folder: Path) -> Path:
    path = folder / "bench-fast.json"
    path.write_text(json.dumps(FAST_MACHINE))
    return path
