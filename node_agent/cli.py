"""``macpool agent run`` and ``macpool agent calibrate``: parse flags, build the settings, run."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import tomllib
from pathlib import Path
from typing import Any

from macpool import logs, plotting
from macpool.settings import ConfigError

from .settings import AgentSettings, load_settings

PROG = "macpool agent"


def _run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"{PROG} run",
        description="Run the node agent: a capped local gateway in front of llama-server, heartbeats into "
        "Redis. Arguments after `--` go to llama-server unchanged.",
        argument_default=None,
    )
    p.add_argument("--config", type=Path, help="TOML file with the same keys (flags > MACPOOL_* env > file)")
    mode = p.add_argument_group("llama-server (exactly one of --upstream or --llama-server)")
    mode.add_argument("--upstream", help="attach: URL of a running llama-server (or `macpool sim`)")
    mode.add_argument(
        "--llama-server", dest="llama_server", help="supervise: llama-server path or command line"
    )
    mode.add_argument(
        "-m", "--model", type=Path, help="the GGUF file (required to supervise; sizes the KV cache)"
    )
    mode.add_argument(
        "--models",
        help="several models on this Mac instead of --model: NAME=FILE.gguf[,NAME=FILE.gguf...], served by "
        "llama-server's router mode, loaded on demand under one memory budget (each is a pool node "
        "<node-id>/<NAME>)",
    )
    mode.add_argument(
        "--parallel", type=int,
        help="llama-server slots (supervise; default: the slots whose KV cache fits the memory budget at "
        "--ctx-per-slot, bounded by the calibrated cap; fewer after persistent memory pressure)",
    )
    mode.add_argument(
        "--ctx-per-slot", dest="ctx_per_slot", type=int,
        help="the most tokens (prompt and output) one request may hold: each slot's context (default 32768, "
        "a coding agent's turn); the slots that fit are sized at it",
    )
    mode.add_argument(
        "--llama-log", dest="llama_log", type=Path, help="append llama-server output to this file"
    )
    pool = p.add_argument_group("pool")
    pool.add_argument("--redis-url", dest="redis_url", help="default redis://127.0.0.1:6379/0")
    pool.add_argument("--node-id", dest="node_id", help="default: the host name")
    pool.add_argument(
        "--advertise-url", dest="advertise_url",
        help="how routers reach this agent (default http://<host>:<port>)",
    )
    pool.add_argument("--key-prefix", dest="key_prefix", help="Redis key prefix (default macpool:{pool}:)")
    pool.add_argument(
        "--heartbeat-interval", dest="heartbeat_interval", type=float, help="seconds (default 1)"
    )
    gw = p.add_argument_group("gateway")
    gw.add_argument("--host", help="listen address (default 127.0.0.1; 0.0.0.0 to serve the LAN)")
    gw.add_argument("--port", type=int, help="listen port (default 8090)")
    gw.add_argument("--token", help="require this token in X-Macpool-Token (env MACPOOL_AGENT_TOKEN)")
    gw.add_argument("--drain-timeout", dest="drain_timeout", type=float, help="seconds (default 30)")
    gw.add_argument(
        "--request-read-timeout", dest="request_read_timeout", type=float,
        help="seconds a client may take to send a request's body, then 408 (default 30)",
    )
    gw.add_argument(
        "--light-cap", dest="light_cap", type=int,
        help="token counts, templates and tokenizations in flight at once, 503 node_full above (default 8; "
        "they hold no generation slot)",
    )
    gw.add_argument(
        "--connect-timeout", dest="connect_timeout", type=float, help="upstream, seconds (default 5)"
    )
    gw.add_argument(
        "--read-timeout", dest="read_timeout", type=float, help="upstream silence, s (default 600)"
    )
    tls = p.add_argument_group("TLS (docs/security.md): HTTPS to the routers")
    tls.add_argument(
        "--tls-cert", dest="tls_cert", type=Path,
        help="serve HTTPS with this certificate chain (PEM; with --tls-key): the node URL becomes https://",
    )
    tls.add_argument("--tls-key", dest="tls_key", type=Path, help="the private key of --tls-cert (PEM)")
    tls.add_argument(
        "--tls-client-ca", dest="tls_client_ca", type=Path,
        help="require every client (the routers) to show a certificate of this CA: mutual TLS",
    )
    cap = p.add_argument_group("capacity")
    cap.add_argument(
        "--cap", type=int, help="configured cap, never above llama-server's total_slots (default: that)"
    )
    cap.add_argument("--calibration", type=Path, help="a `calibrate --json` result or --write-config file")
    cap.add_argument("--calibrated-cap", dest="calibrated_cap", type=int, help="the calibrated cap, directly")
    cap.add_argument(
        "--headroom-gb", dest="headroom_gb", type=float, help="kept free under the wired limit (2)"
    )
    cap.add_argument(
        "--wired-limit-gb", dest="wired_limit_gb", type=float,
        help="the GPU wired-memory limit llama-server's slots are sized for (default: the memory probe's)",
    )
    cap.add_argument(
        "--shrink-after-beats", dest="shrink_after_beats", type=int,
        help="heartbeats of memory pressure before a supervised llama-server restarts with a quarter fewer "
        "slots (default 10; only when the agent chose the slots)",
    )
    cap.add_argument(
        "--request-overhead-gb",
        dest="request_overhead_gb",
        type=float,
        help="per-request working set beyond the KV cache, for the GGUF estimate (0.25)",
    )
    cap.add_argument(
        "--memory-probe", dest="memory_probe", choices=["auto", "macos", "linux", "sim"],
        help="where memory figures come from (default auto: the upstream's /sim/memory if it has one, "
        "else this OS)",
    )
    elastic = p.add_argument_group("elastic pool (macpool autoscale)")
    elastic.add_argument(
        "--elastic", action="store_true", default=None,
        help="follow the autoscaler: load the model or go to standby when it says so",
    )
    elastic.add_argument(
        "--standby", action="store_true", default=None,
        help="start in standby (implies --elastic): registered, model not loaded, admitting nothing",
    )
    elastic.add_argument(
        "--idle-unload", dest="idle_unload", type=float,
        help="seconds without a request after which the node unloads its model and goes back to standby "
             "by itself (default 0: only when the autoscaler says so)",
    )
    elastic.add_argument("--wol-mac", dest="wol_mac", help="this Mac's MAC address, to be woken from sleep")
    elastic.add_argument(
        "--wol-broadcast", dest="wol_broadcast",
        help="broadcast address of its LAN, for the magic packet (default 255.255.255.255)",
    )
    p.add_argument(
        "--log-level", dest="log_level", choices=["debug", "info", "warning", "error"], help="default info"
    )
    p.add_argument(
        "--log-format", dest="log_format", choices=["text", "json"],
        help="default text; json: one JSON object per line (uvicorn's lines too)",
    )
    return p


def _calibrate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"{PROG} calibrate",
        description="Drive concurrency up in steps and recommend the cap: the smaller of the memory knee and "
        "the throughput knee (the smallest level reaching 95%% of the best throughput). Exits 1 when no "
        "level is safe.",
    )
    p.add_argument("--upstream", required=True, help="llama-server (or `macpool sim`) URL")
    p.add_argument(
        "--prompt-tokens", type=int,
        help="prompt length (default: near the context one request may hold on the server - its slots' "
        "context less --max-tokens - the requests the Mac is sized for)",
    )
    p.add_argument(
        "--max-tokens", type=int, default=1024, help="generated tokens per request (default 1024)"
    )
    p.add_argument("--max-concurrency", type=int, default=24, help="highest level tried (default 24)")
    p.add_argument("--step", type=int, default=1, help="between two levels (default 1)")
    p.add_argument("--levels", help="explicit comma-separated concurrency levels instead of 1..max by step")
    p.add_argument(
        "--window", type=int, default=0, help="requests measured per level (default max(16, 6 x level))"
    )
    p.add_argument(
        "--max-p50-ratio", type=float,
        help="latency bound: the cap is the largest level whose p50 is at most this many times the first "
        "level's (instead of the throughput knee; memory and errors still bound it)",
    )
    p.add_argument(
        "--max-ttft", type=float, help="latency bound: the largest level whose TTFT p50 is at most this (s)"
    )
    p.add_argument("--model", help="model name to send (default: the server's)")
    p.add_argument("--json", type=Path, help="write the result (recommended_cap, per_request_gb, rows)")
    p.add_argument("--plot", type=Path, help="draw throughput, p50 and pinned memory curves (PNG)")
    p.add_argument("--write-config", type=Path, help="store calibrated_cap in this agent TOML config")
    return p


def _split_extra(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []


def build_settings(argv: list[str]) -> AgentSettings:
    """The settings of ``macpool agent run <argv>`` (flags > MACPOOL_* > the --config file)."""
    own, extra = _split_extra(argv)
    args = vars(_run_parser().parse_args(own))
    config = args.pop("config")
    if extra:
        args["llama_args"] = extra
    return load_settings(args, config)


def run(argv: list[str]) -> int:
    settings = build_settings(argv)
    logs.configure(settings.log_level, settings.log_format)
    logging.getLogger("asyncio").setLevel(logging.ERROR)  # "socket.send() raised" after a client left
    from .agent import run_agent  # uvicorn and friends only once the configuration is known good

    return run_agent(settings)


def _check_calibrate_args(a: argparse.Namespace, levels: list[int]) -> None:
    """Bad figures and unwritable outputs fail before the sweep, not after minutes of measuring."""
    prompt = 1 if a.prompt_tokens is None else a.prompt_tokens  # (unset: near the server's context)
    for flag, value, least in (("--prompt-tokens", prompt, 1), ("--max-tokens", a.max_tokens, 1),
                               ("--max-concurrency", a.max_concurrency, 1), ("--step", a.step, 1),
                               ("--window", a.window, 0)):
        if value < least:
            raise ConfigError(f"{flag} {value}: must be >= {least}")
    bounds: tuple[tuple[str, float | None, float], ...] = (
        ("--max-p50-ratio", a.max_p50_ratio, 1.0), ("--max-ttft", a.max_ttft, 0.0)
    )
    for name, bound, floor in bounds:
        if bound is not None and not bound > floor:
            raise ConfigError(f"{name} {bound}: must be > {floor:g}")
    if any(level < 1 for level in levels):
        raise ConfigError(f"--levels {a.levels!r}: every level must be >= 1")
    for flag, path in (("--json", a.json), ("--plot", a.plot), ("--write-config", a.write_config)):
        if path is None:
            continue
        folder = path.parent if str(path.parent) else Path(".")
        if not folder.is_dir() or not os.access(folder, os.W_OK):
            raise ConfigError(f"{flag} {str(path)!r}: {str(folder)!r} is not a writable directory")
        if path.exists() and (path.is_dir() or not os.access(path, os.W_OK)):
            raise ConfigError(f"{flag} {str(path)!r}: not a writable file")
    if a.plot is not None:
        plotting.check()
    if a.write_config is not None and a.write_config.exists():
        try:  # the calibrated keys are placed by its tables: a file that does not parse must say so now
            tomllib.loads(a.write_config.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"--write-config {str(a.write_config)!r}: not a TOML file ({exc})") from None


def calibrate(argv: list[str]) -> int:
    from . import calibrate as cal

    a = _calibrate_parser().parse_args(argv)
    try:
        levels = [int(x) for x in a.levels.split(",")] if a.levels else []
    except ValueError as exc:
        raise ConfigError(f"--levels {a.levels!r}: expected integers separated by commas") from exc
    options = cal.CalibrateOptions(
        upstream=a.upstream,
        prompt_tokens=a.prompt_tokens,
        max_tokens=a.max_tokens,
        max_concurrency=a.max_concurrency,
        step=a.step,
        window_requests=a.window,
        model=a.model,
        levels=levels,
        bounds=cal.Bounds(a.max_p50_ratio, a.max_ttft),
    )
    from .settings import _check_http_url

    _check_http_url("--upstream", a.upstream)
    _check_calibrate_args(a, levels)
    header: list[bool] = []

    def announce(note: str) -> None:
        print(note, flush=True)

    first: list[float] = []

    def progress(row: Any) -> None:
        if not header:
            header.append(True)
            print(f"{'conc':>4} {'tok/s':>8} {'p50 s':>8} {'ratio':>6} {'ttft s':>7} {'pinned GB':>9} "
                  f"{'errors':>6}  state", flush=True)
        first.append(row.p50_latency_s or 1.0)
        pinned = "-" if row.peak_pinned_gb is None else f"{row.peak_pinned_gb:.1f}"
        print(
            f"{row.concurrency:>4} {row.throughput_tok_s:>8.1f} {row.p50_latency_s:>8.2f} "
            f"{row.p50_latency_s / first[0]:>5.1f}x {row.ttft_p50_s:>7.2f} {pinned:>9} "
            f"{row.errors:>6}  {row.state or '-'}",
            flush=True,
        )

    import httpx

    try:
        rows, knee, planned = asyncio.run(cal.sweep(options, progress, announce))
    except httpx.HTTPError as exc:
        raise ConfigError(f"--upstream {a.upstream}: {type(exc).__name__} ({exc})") from exc
    except (ValueError, RuntimeError) as exc:
        raise ConfigError(str(exc)) from exc
    data = cal.result_json(rows, knee, options, planned)
    if a.json:
        cal.dump_json(a.json, data)
    if a.plot:
        cal.plot(a.plot, rows, knee)
    print(f"why: {knee.reason}")
    if knee.recommended_cap == 0:
        print(f"{PROG} calibrate: no safe concurrency (measured: {knee.reason}). To change: "
              f"{cal.advice(knee, options.bounds)}", file=sys.stderr)
        return 1
    per_request = "-" if knee.per_request_gb is None else f"{knee.per_request_gb:.2f} GB"
    print(
        f"recommended cap: {knee.recommended_cap} (limited by {knee.limited_by}; per request {per_request})"
    )
    if a.write_config:
        cal.write_config(a.write_config, knee)
        print(f"wrote calibrated_cap = {knee.recommended_cap} to {a.write_config}")
    return 0


COMMANDS = {"run": run, "calibrate": calibrate}


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(f"usage: {PROG} {{run,calibrate}} [options]   ({PROG} run --help)", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    try:
        return COMMANDS[argv[0]](argv[1:])
    except ConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
