"""``macpool agent run`` and ``macpool agent calibrate``: build the settings from the command line, run."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import tomllib
from pathlib import Path
from typing import Any

from pydantic_settings import CliSettingsSource

from macpool import logs, plotting
from macpool.settings import ConfigError

from .settings import AgentSettings, calibrated

PROG = "macpool agent"


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
    """The settings of ``macpool agent run <argv>``: its flags come from the settings model; the arguments
    after ``--`` are llama-server's (``llama_args``)."""
    own, extra = _split_extra(argv)
    flags = CliSettingsSource[Any](AgentSettings)(args=own)
    given = set(flags())
    init: dict[str, Any] = {"llama_args": extra} if extra else {}
    for mode, other in (("upstream", "llama_server"), ("llama_server", "upstream")):
        if mode in given and other not in given:
            # one choice: --upstream or --llama-server on the command line sets aside the other's setting in
            # the environment or the file (attaching to a test server with the Mac's usual config file)
            init[other] = None
    return calibrated(AgentSettings.from_argv(own, flags, **init), given)


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
    from .settings import _http_url

    try:
        _http_url(a.upstream)
    except ValueError as exc:
        raise ConfigError(f"--upstream {a.upstream!r}: {exc}") from None
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
