"""``macpool agent run`` and ``macpool agent calibrate``: build the settings from the command line, run."""

from __future__ import annotations

import asyncio
import logging
import sys
from typing import Any

from pydantic_settings import CliSettingsSource

from macpool import logs, plotting
from macpool.credentials import warn_on_command_line
from macpool.settings import ConfigError, from_argv

from .settings import AgentSettings, CalibrateSettings, calibrated

PROG = "macpool agent"


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
    return calibrated(AgentSettings.from_argv(own, flags, **init), given).with_token_read()


def run(argv: list[str]) -> int:
    warn_on_command_line(f"{PROG} run", _split_extra(argv)[0], ("--token", "--agent-token"))
    settings = build_settings(argv)
    logs.configure(settings.log_level, settings.log_format)
    logging.getLogger("asyncio").setLevel(logging.ERROR)  # "socket.send() raised" after a client left
    from .agent import run_agent  # uvicorn and friends only once the configuration is known good

    return run_agent(settings)


def calibrate(argv: list[str]) -> int:
    from . import calibrate as cal

    a = from_argv(CalibrateSettings, argv)
    if a.plot is not None:
        plotting.check()
    options = cal.CalibrateOptions(
        upstream=a.upstream,
        prompt_tokens=a.prompt_tokens,
        max_tokens=a.max_tokens,
        max_concurrency=a.max_concurrency,
        step=a.step,
        window_requests=a.window,
        model=a.model,
        levels=a.levels,
        bounds=cal.Bounds(a.max_p50_ratio, a.max_ttft),
    )
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
    if a.json_file:
        cal.dump_json(a.json_file, data)
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


def join(argv: list[str]) -> int:
    from . import join as joining

    return joining.main(argv)


def fetch(argv: list[str]) -> int:
    """``macpool agent fetch REF``: download a model from Hugging Face into this Mac's cache, verified."""
    import argparse

    from . import hub

    parser = argparse.ArgumentParser(
        prog=f"{PROG} fetch",
        description="Download a model from Hugging Face into this Mac's Hugging Face cache (HF_HOME), verify "
        "it against the hub's SHA-256, and print the path of its GGUF. HF_ENDPOINT, HF_TOKEN and "
        "HF_HUB_OFFLINE apply. Exits 1 when it cannot.",
    )
    parser.add_argument("ref", help="org/repo:QUANT (as llama.cpp's -hf; every part of a split GGUF) or "
                        "org/repo/file.gguf")
    text = parser.parse_args(argv).ref
    ref = hub.parse_ref(text)
    if ref is None:
        raise ConfigError(f"{text!r} is not a Hugging Face reference (org/repo:QUANT or org/repo/file.gguf)")
    logs.configure("info", "text")
    try:
        resolved = hub.resolve(ref)
        print(f"{ref}: {', '.join(f.name for f in resolved.files)} at {resolved.revision[:12]}, "
              f"{resolved.size / 1e9:.2f} GB", file=sys.stderr, flush=True)
        path = hub.download(resolved)
    except hub.HubError as exc:
        print(f"{PROG} fetch: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


COMMANDS = {"run": run, "calibrate": calibrate, "join": join, "fetch": fetch}


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(f"usage: {PROG} {{run,calibrate,join,fetch}} [options]   ({PROG} run --help)", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    try:
        return COMMANDS[argv[0]](argv[1:])
    except ConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
