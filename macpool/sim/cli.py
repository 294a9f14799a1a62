"""``macpool sim``: run a simulated Mac running llama-server (accepts llama-server's common flags)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import uvicorn
from pydantic import ValidationError
from starlette.types import ASGIApp

from macpool.sim.machine import Machine, MachineError, StartFailure, preset_names
from macpool.sim.settings import DEFAULT_PRESET, SimSettings

# llama-server flags an agent may pass that mean nothing to the simulator: name -> takes a value
IGNORED_FLAGS: dict[str, bool] = {
    "--no-webui": False, "--cont-batching": False, "-cb": False, "--no-cont-batching": False,
    "--jinja": False, "--no-mmap": False, "--mlock": False,
    "--verbose": False, "-v": False, "--log-disable": False, "--embedding": False, "--embeddings": False,
    "--slots": False, "--no-slots": False, "--no-warmup": False,
    "-t": True, "--threads": True, "-tb": True, "--threads-batch": True, "-ngl": True, "--n-gpu-layers": True,
    "--gpu-layers": True, "-b": True, "--batch-size": True, "-ub": True, "--ubatch-size": True,
    "--timeout": True, "-to": True, "--threads-http": True, "--cache-type-k": True, "-ctk": True,
    "--cache-type-v": True, "-ctv": True, "--chat-template": True, "--reasoning-format": True,
    "--seed": True, "-s": True, "-n": True, "--n-predict": True, "--keep": True, "--api-key": True,
    "--flash-attn": True, "-fa": True,  # on, off or auto
    # the simulated model embeds and reranks whatever the flags say
    "--reranking": False, "--rerank": False, "--pooling": True,
}


class UsageError(Exception):
    """Bad command-line input: one line on stderr, exit 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)


def _default(name: str) -> object:
    return SimSettings.model_fields[name].default


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="macpool sim", description="A simulated Mac running llama-server.")
    source = p.add_mutually_exclusive_group()
    source.add_argument(
        "--preset", help=f"machine preset: {', '.join(preset_names())} (default {DEFAULT_PRESET})"
    )
    source.add_argument("--machine", type=Path, help="machine description JSON file")
    # no argparse defaults for settings: an unset flag leaves the value to MACPOOL_SIM_* or SimSettings
    p.add_argument("--host", help=f"listen address (default {_default('host')})")
    p.add_argument("--port", type=int, help=f"listen port (default {_default('port')})")
    p.add_argument("-np", "--parallel", type=int,
                   help="slots (default: the machine's; negative: llama-server's auto, 4 slots over a "
                   "unified cache)")
    p.add_argument("-c", "--ctx-size", type=int,
                   help="total context: split across the slots, or one pool of cells with --kv-unified")
    p.add_argument("-kvu", "--kv-unified", dest="kv_unified", action="store_true", default=None,
                   help="the slots share one pool of cells, and each may take the whole context")
    p.add_argument("-no-kvu", "--no-kv-unified", dest="kv_unified", action="store_false",
                   help="a KV stream of its own per slot (llama-server's default with -np N)")
    p.add_argument("--kv-unified-per-slot", type=int, metavar="N",
                   help="the most context one slot may take (without -c: the context is N x the slots)")
    p.add_argument("-cram", "--cache-ram", type=int, metavar="MIB",
                   help=f"MiB of prompt cache in host memory (default {_default('cache_ram')}; -1: no limit, "
                   "0: none)")
    p.add_argument("--cache-idle-slots", action=argparse.BooleanOptionalAction, default=None,
                   help="save idle slots to the prompt cache as a task starts (default: yes)")
    p.add_argument("-sps", "--slot-prompt-similarity", type=float, metavar="F",
                   help="share of a new prompt a slot must hold to be chosen for it "
                   f"(default {_default('slot_prompt_similarity')}; 0: never)")
    p.add_argument("-m", "--model", help="model path or name (reported as llama-server does)")
    p.add_argument("-a", "--alias", help="model alias")
    p.add_argument("--metrics", action="store_true", default=None, help="enable /metrics")
    p.add_argument("--metrics-clock", choices=("simulated", "wall"),
                   help="the clock of /metrics' prompt and generation seconds: simulated (default), or wall "
                   "(as agents and routers in front of a sped-up simulator time the rest)")
    p.add_argument("--speed", type=float,
                   help=f"simulated seconds per wall second (default {_default('speed')})")
    p.add_argument("--load-seconds", type=float,
                   help=f"answer 503 'Loading model' this long (default {_default('load_seconds')})")
    models = p.add_mutually_exclusive_group()
    models.add_argument("--models", help="router mode: serve several models on this Mac, loaded on demand: "
                        "NAME=PRESET[,NAME=PRESET...] (each model's figures from its preset, on this Mac)")
    models.add_argument("--models-preset", type=Path, metavar="FILE.ini",
                        help="router mode: the models of a llama-server model-preset INI file (a section "
                        "per model: model = FILE.gguf, a machine FILE.json or a preset; parallel; ctx-size)")
    p.add_argument("--models-max", type=int, help="router mode: most models loaded at once "
                   f"(default {_default('models_max')}; 0: no limit)")
    p.add_argument("--models-autoload", action=argparse.BooleanOptionalAction, default=None,
                   help="router mode: load an unloaded model a request names (default: yes)")
    p.add_argument("--log-level", default="warning", help="uvicorn log level (default warning)")
    return p


def strip_ignored(argv: list[str]) -> list[str]:
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in IGNORED_FLAGS:
            skip = IGNORED_FLAGS[name] and "=" not in arg
            continue
        out.append(arg)
    return out


def parse_settings(argv: list[str]) -> tuple[SimSettings, str]:
    args = build_parser().parse_args(strip_ignored(argv))
    values = {
        "host": args.host, "port": args.port, "preset": args.preset, "machine": args.machine,
        "parallel": args.parallel, "ctx_size": args.ctx_size, "kv_unified": args.kv_unified,
        "kv_unified_per_slot": args.kv_unified_per_slot, "cache_ram": args.cache_ram,
        "cache_idle_slots": args.cache_idle_slots, "slot_prompt_similarity": args.slot_prompt_similarity,
        "model": args.model, "alias": args.alias,
        "metrics": args.metrics, "metrics_clock": args.metrics_clock, "speed": args.speed,
        "load_seconds": args.load_seconds,
        "models": args.models, "models_preset": args.models_preset, "models_max": args.models_max,
        "models_autoload": args.models_autoload,
    }
    given = {k: v for k, v in values.items() if v is not None}
    if "preset" in given or "machine" in given:  # one choice: the flag's wins over the other's variable
        given = {"preset": None, "machine": None, **given}
    if "models" in given or "models_preset" in given:
        given = {"models": None, "models_preset": None, **given}
    try:
        settings = SimSettings(**given)
    except ValidationError as exc:
        first = exc.errors()[0]
        name = str(first["loc"][0])
        source = f"--{name.replace('_', '-')}" if name in given else f"MACPOOL_SIM_{name.upper()}"
        raise UsageError(f"{source}={first['input']!r}: {first['msg']}") from exc
    if ("models_max" in given or "models_autoload" in given) and not router_mode(settings):
        raise UsageError("--models-max and --models-autoload need --models or --models-preset")
    return settings, args.log_level


def router_mode(settings: SimSettings) -> bool:
    return bool(settings.models) or settings.models_preset is not None


def create(settings: SimSettings, machine: Machine | None = None) -> ASGIApp:
    """The simulator's app: one model, or several loaded on demand (router mode, ``--models`` or
    ``--models-preset``)."""
    from macpool.sim.app import create_app
    from macpool.sim.router_mode import create_router_app

    if router_mode(settings):
        return create_router_app(settings, machine)
    return create_app(settings, machine)


def main(argv: list[str]) -> int:
    try:
        settings, log_level = parse_settings(argv)
        machine = settings.load_machine()
    except (UsageError, MachineError) as exc:
        print(f"macpool sim: {exc}", file=sys.stderr)
        return 2
    try:
        app = create(settings, machine)
    except StartFailure as exc:  # as llama-server: its loader's lines on stderr, then exit status 1
        print("\n".join(exc.lines), file=sys.stderr)
        return 1
    except MachineError as exc:
        print(f"macpool sim: {exc}", file=sys.stderr)
        return 2
    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, log_level=log_level, server_header=False,
        access_log=False, timeout_graceful_shutdown=3,
    )
    uvicorn.Server(config).run()
    return 0
