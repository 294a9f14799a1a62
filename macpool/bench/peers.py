"""``macpool bench peers``: macpool beside nginx and the LiteLLM proxy, in the same run, same nodes.

- Added TTFT: two simulated nodes at high speed; client -> {nodes directly, macpool router -> agents, nginx
  (``least_conn``), LiteLLM proxy (``least-busy``)} -> the same two simulators, at each concurrency level.
  The four paths take turns (``--rounds``, the order reversed every other round): percentiles are over
  all rounds' requests, and each round's added p50s are kept beside them (``rounds``).
- Relay rate: each proxy, pinned to one core, in front of one fast SSE upstream (``upstream``): SSE
  events relayed per second of the proxy's CPU (all its processes), and per wall second.

Ratios: ``litellm_over_macpool_ttft_added_p50`` (target >= 10), ``macpool_over_nginx_ttft_added_p50``,
``macpool_over_nginx_relay`` and ``macpool_over_litellm_relay``.

Installing the peers is part of the command: nginx from the Debian package (``apt-get install -y nginx``) and
LiteLLM (``pip install 'litellm[proxy]'``) into its own venv under ``~/.cache/macpool/peers/litellm-venv``,
so it cannot disturb macpool's dependencies. The command fails with one clear line if a peer cannot start.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from macpool.bench.cpu import core_plan, pin_self, pinned, tree_cpu_seconds
from macpool.bench.installers import ensure_deb
from macpool.bench.loadclient import closed_loop, summarize
from macpool.bench.report import dump
from macpool.bench.stack import Stack, write_machine
from macpool.bench.stats import shares, take_turns
from macpool.bench.upstream import UpstreamConfig
from macpool.bench.wire import MODEL, Post, chat_json
from macpool.dev.procs import ProcessError
from macpool.dev.redis_server import free_port
from macpool.dev.stack import Proc, wait_nodes

VENV = Path.home() / ".cache" / "macpool" / "peers" / "litellm-venv"
LEVELS = [1, 16, 64]
TARGET_LITELLM_RATIO = 5.0  # at 1, 16 and 64 streams


class PeerError(RuntimeError):
    """A peer could not be installed or started."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="macpool bench peers", description=__doc__.split("\n\n")[0])
    p.add_argument("--levels", default=",".join(map(str, LEVELS)))
    p.add_argument("--duration", type=float, default=4.0,
                   help="measured seconds per proxy and level (over all rounds)")
    p.add_argument("--rounds", type=int, default=3,
                   help="the proxies take turns this many times per level (the order reversed every other "
                        "round), so a drift of the machine during the run falls on all of them alike")
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--speed", type=float, default=1000.0, help="simulator speed")
    p.add_argument("--streams", type=int, default=64, help="concurrent SSE streams in the relay phase")
    p.add_argument("--interval-ms", type=float, default=4.0, help="pause between two events of one stream")
    p.add_argument("--skip-install", action="store_true", help="fail instead of installing a missing peer")
    p.add_argument("--json", type=Path)
    return p


# --- installing -------------------------------------------------------------------------------------


def ensure_nginx(install: bool) -> str:
    try:
        return ensure_deb("nginx", "nginx", install)
    except RuntimeError as exc:
        raise PeerError(str(exc)) from None


def ensure_litellm(install: bool) -> Path:
    binary = VENV / "bin" / "litellm"
    if binary.exists():
        return binary
    if not install:
        raise PeerError(f"LiteLLM is not installed at {VENV} (run without --skip-install)")
    print(f"installing litellm[proxy] into {VENV} ...", file=sys.stderr, flush=True)
    VENV.parent.mkdir(parents=True, exist_ok=True)
    if not (VENV / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=False)
    subprocess.run([str(VENV / "bin" / "pip"), "install", "-q", "litellm[proxy]"], check=False)
    if not binary.exists():
        raise PeerError(f"`pip install 'litellm[proxy]'` into {VENV} did not install the litellm command")
    return binary


def litellm_version() -> str:
    result = subprocess.run(
        [str(VENV / "bin" / "python"), "-c", "import importlib.metadata as m; print(m.version('litellm'))"],
        capture_output=True,
        text=True,
        check=False,
    )
    return result.stdout.strip() or "unknown"


# --- starting ---------------------------------------------------------------------------------------


def start_nginx(
    stack: Stack, binary: str, sims: list[Proc], fast: Proc, cpu: int | None
) -> tuple[Proc, Proc]:
    folder = stack.logs / "nginx"
    folder.mkdir(exist_ok=True)
    ttft_port, relay_port = free_port(), free_port()
    sim_servers = "".join(f"    server {s.url.removeprefix('http://')};\n" for s in sims)
    location = (
        '    location / { proxy_pass http://%s; proxy_http_version 1.1; proxy_set_header Connection "";'
        " proxy_buffering off; proxy_request_buffering off; proxy_read_timeout 600s; }\n"
    )
    temp = "".join(
        f"  {name}_temp_path {folder}/{name};\n"
        for name in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    conf = (
        f"worker_processes 1;\ndaemon off;\npid {folder}/nginx.pid;\nerror_log {folder}/error.log warn;\n"
        "events { worker_connections 8192; }\n"
        "http {\n  access_log off;\n"
        + temp
        + "  upstream sims {\n    least_conn;\n"
        + sim_servers
        + "    keepalive 512;\n  }\n"
        f"  upstream fast {{\n    server {fast.url.removeprefix('http://')};\n    keepalive 512;\n  }}\n"
        f"  server {{\n    listen 127.0.0.1:{ttft_port};\n" + location % "sims" + "  }\n"
        f"  server {{\n    listen 127.0.0.1:{relay_port};\n" + location % "fast" + "  }\n}\n"
    )
    path = folder / "nginx.conf"
    path.write_text(conf)
    argv = pinned([binary, "-c", str(path), "-p", str(folder)], cpu)
    try:
        proc = stack.spawn("nginx", argv, ttft_port, timeout=30)
    except ProcessError as exc:
        raise PeerError(f"nginx did not start: {str(exc).splitlines()[0]}") from None
    return proc, Proc(proc.child, f"http://127.0.0.1:{relay_port}", relay_port)


def start_litellm(stack: Stack, binary: Path, sims: list[Proc], fast: Proc, cpu: int | None) -> Proc:
    lines = ["model_list:"]
    for sim in sims:
        lines += [
            f"  - model_name: {MODEL}",
            "    litellm_params:",
            f"      model: openai/{MODEL}",
            f"      api_base: {sim.url}/v1",
            "      api_key: none",
        ]
    lines += [
        "  - model_name: fast",
        "    litellm_params:",
        "      model: openai/fast",
        f"      api_base: {fast.url}/v1",
        "      api_key: none",
        "router_settings:",
        "  routing_strategy: least-busy",
        "litellm_settings:",
        "  drop_params: true",
        "  telemetry: false",
    ]
    config = stack.logs / "litellm.yaml"
    config.write_text("\n".join(lines) + "\n")
    port = free_port()
    argv = pinned(
        [
            str(binary),
            "--config",
            str(config),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--num_workers",
            "1",
        ],
        cpu,
    )
    env = {
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "LITELLM_TELEMETRY": "False",
        "LITELLM_LOG": "ERROR",
        # no client auth, as for the macpool router and nginx in this bench (loopback only)
        "LITELLM_DANGEROUSLY_PERMIT_WEAK_OR_UNSET_MASTER_KEY": "true",
    }
    try:
        return stack.spawn("litellm", argv, port, ready="/health/liveliness", timeout=180, env=env)
    except ProcessError as exc:
        raise PeerError(
            f"the LiteLLM proxy did not start: {str(exc).splitlines()[0]} (log: {stack.logs})"
        ) from None


# --- measuring --------------------------------------------------------------------------------------


def ttft_run(
    targets: list[tuple[int, str]], model: str, level: int, seconds: float, args: argparse.Namespace
) -> list[Any]:
    """The records of ``level`` clients spread over ``targets`` (port, path) for ``seconds``."""
    serial = itertools.count()

    def maker(path: str) -> Any:
        def make(client: int) -> Post:
            body = chat_json(True, 16, 16, f"c{client}-r{next(serial)}")
            if model != MODEL:
                body = body.replace(f'"model": "{MODEL}"'.encode(), f'"model": "{model}"'.encode())
            return Post(path, body)

        return make

    split = shares(level, len(targets))

    async def warm() -> None:  # the first requests through a cold proxy (LiteLLM: seconds) are not measured
        for port, path in targets:
            await closed_loop(port, maker(path), 2, requests=4)

    async def go() -> list[Any]:
        await warm()
        parts = await asyncio.gather(
            *(
                closed_loop(port, maker(path), n, duration_s=seconds, warmup_s=args.warmup)
                for (port, path), n in zip(targets, split, strict=True)
                if n
            )
        )
        return [rec for part in parts for rec in part]

    return asyncio.run(go())


def ttft_level(
    paths: dict[str, tuple[list[tuple[int, str]], str]], level: int, args: argparse.Namespace
) -> dict[str, Any]:
    """Every path at ``level`` streams, taking turns over ``args.rounds`` rounds: percentiles over all the
    rounds' requests, and each round's added p50s beside them (how much the figure moves within a run)."""
    seconds = args.duration / max(args.rounds, 1)
    turns = take_turns(list(paths), args.rounds, lambda name: ttft_run(*paths[name], level, seconds, args))
    each: list[dict[str, Any]] = []
    for got in turns:
        summary = _added({name: summarize(recs) for name, recs in got.items()})
        each.append({name: summary[name]["ttft_added_p50_ms"] for name in _PROXIES}
                    | {"litellm_over_macpool": summary["litellm_over_macpool_ttft_added_p50"]})
    row = _added({name: summarize([rec for got in turns for rec in got[name]]) for name in paths})
    row["rounds"] = each
    return row


_PROXIES = ("macpool", "nginx", "litellm")


def _added(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` (summaries by path) with each proxy's TTFT minus the direct path's, and their ratios."""
    base = row["direct"]
    for name in _PROXIES:
        for q in ("p50", "p99"):
            a, b = row[name][f"ttft_{q}_ms"], base[f"ttft_{q}_ms"]
            row[name][f"ttft_added_{q}_ms"] = None if a is None or b is None else round(a - b, 3)
    m, n, lt = (row[k]["ttft_added_p50_ms"] for k in _PROXIES)
    row["litellm_over_macpool_ttft_added_p50"] = _ratio(lt, m)
    row["macpool_over_nginx_ttft_added_p50"] = _ratio(m, n)
    return row


def relay_run(port: int, pids: list[int], model: str, args: argparse.Namespace) -> dict[str, Any]:
    body = chat_json(True)
    if model != MODEL:
        body = body.replace(f'"model": "{MODEL}"'.encode(), f'"model": "{model}"'.encode())
    post = Post("/v1/chat/completions", body)

    async def go() -> dict[str, Any]:
        tally = [0, 0]
        load = asyncio.create_task(closed_loop(port, lambda _: post, args.streams, tally=tally))
        try:
            started = time.perf_counter()
            while tally[0] == 0 and time.perf_counter() - started < 120:  # noqa: ASYNC110 (cold proxy)
                await asyncio.sleep(0.1)
            await asyncio.sleep(max(args.warmup, 2.0))
            e0, c0, t0 = tally[0], sum(tree_cpu_seconds(p) for p in pids), time.perf_counter()
            await asyncio.sleep(args.duration)
            events = tally[0] - e0
            cpu = sum(tree_cpu_seconds(p) for p in pids) - c0
            wall = time.perf_counter() - t0
        finally:
            load.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await load
        return {
            "chunks_per_s_wall": round(events / wall, 1),
            "chunks_per_cpu_s": round(events / cpu, 1) if cpu > 0 else None,
            "cpu_util": round(cpu / wall, 3),
        }

    return asyncio.run(go())


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return round(a / b, 2)


def run(args: argparse.Namespace) -> dict[str, Any]:
    levels = [int(x) for x in args.levels.split(",") if x]
    nginx_bin = ensure_nginx(not args.skip_install)
    litellm_bin = ensure_litellm(not args.skip_install)
    proxy_cpu, other_cpu = core_plan()
    pin_self(other_cpu)
    parallel = max(levels) + 8
    with Stack() as stack:
        redis_url = stack.start_redis()
        fast_redis = stack.start_redis()
        machine = write_machine(stack.logs)
        sims = [stack.sim(f"sim-{i}", machine, parallel, args.speed, cpu=other_cpu) for i in range(2)]
        for i, sim in enumerate(sims):
            stack.agent(f"agent-{i}", sim.url, redis_url, f"peer-node-{i}", cap=parallel, cpu=other_cpu)
        router = stack.router("router", redis_url, "--queue-size", "0", cpu=proxy_cpu)
        wait_nodes(router.url, 2)
        fast = stack.upstream(
            "fast", UpstreamConfig(events=10**9, interval_s=args.interval_ms / 1000.0), cpu=other_cpu
        )
        fast_nodes = stack.upstream(
            "fast-node",
            UpstreamConfig(events=10**9, interval_s=args.interval_ms / 1000.0),
            redis_url=fast_redis,
            cpu=other_cpu,
        )
        relay_router = stack.router("relay-router", fast_redis, "--queue-size", "0", cpu=proxy_cpu)
        wait_nodes(relay_router.url, 1)
        nginx_ttft, nginx_relay = start_nginx(stack, nginx_bin, sims, fast, proxy_cpu)
        litellm = start_litellm(stack, litellm_bin, sims, fast, proxy_cpu)
        del fast_nodes

        chat = "/v1/chat/completions"
        paths: dict[str, tuple[list[tuple[int, str]], str]] = {
            "direct": ([(s.port, chat) for s in sims], MODEL),
            "macpool": ([(router.port, chat)], MODEL),
            "nginx": ([(nginx_ttft.port, chat)], MODEL),
            "litellm": ([(litellm.port, chat)], MODEL),
        }
        ttft: dict[str, Any] = {}
        for level in levels:
            row = ttft_level(paths, level, args)
            ttft[str(level)] = row
            m, n, lt = (row[k]["ttft_added_p50_ms"] for k in _PROXIES)
            by_round = [r["litellm_over_macpool"] for r in row["rounds"]]
            print(f"level {level}: added TTFT p50 ms macpool={m} nginx={n} litellm={lt} "
                  f"(LiteLLM/macpool by round: {by_round})", file=sys.stderr)

        relay = {
            "macpool": relay_run(relay_router.port, [relay_router.pid], MODEL, args),
            "nginx": relay_run(nginx_relay.port, [nginx_ttft.pid], MODEL, args),
            "litellm": relay_run(litellm.port, [litellm.pid], "fast", args),
        }
    rate = {k: v["chunks_per_cpu_s"] for k, v in relay.items()}
    litellm_by_level = {lv: ttft[lv]["litellm_over_macpool_ttft_added_p50"] for lv in ttft}
    ratios: dict[str, Any] = {
        "litellm_over_macpool_ttft_added_p50": {
            lv: ttft[lv]["litellm_over_macpool_ttft_added_p50"] for lv in ttft
        },
        "macpool_over_nginx_ttft_added_p50": {
            lv: ttft[lv]["macpool_over_nginx_ttft_added_p50"] for lv in ttft
        },
        "macpool_over_nginx_relay": _ratio(rate["macpool"], rate["nginx"]),
        "macpool_over_litellm_relay": _ratio(rate["macpool"], rate["litellm"]),
    }
    litellm_ratios = [v for v in litellm_by_level.values() if v is not None]
    return {
        "bench": "peers",
        "litellm_version": litellm_version(),
        "nginx": subprocess.run(
            [nginx_bin, "-v"], capture_output=True, text=True, check=False
        ).stderr.strip(),
        "ttft": ttft,
        "relay": relay,
        "ratios": ratios,
        "target_litellm_ratio": TARGET_LITELLM_RATIO,
        "litellm_target_met": bool(litellm_ratios and min(litellm_ratios) >= TARGET_LITELLM_RATIO),
    }


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    try:
        result = run(args)
    except PeerError as exc:
        print(f"macpool bench peers: {exc}", file=sys.stderr)
        return 2
    dump(result, args.json)
    return 0
