"""``macpool models``: the models the pool serves and on how many Macs, kept in Redis (the desired state
that agents started with ``--from-pool`` converge on: node_agent/pool_models.py)."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from macpool.contract import MODEL_NAME, DeclaredModel, now_ms
from macpool.hub import HubRef, model_source
from macpool.settings import CommandSettings, ConfigError, RedisUrl
from macpool.store import DEFAULT_PREFIX, Keys
from macpool.store.connect import connect
from macpool.store.models import ModelStore

PROG = "macpool models"
NAME_HELP = "the model's name, which requests give as \"model\" (letters, digits, '.', '_', ':', '-')"


class ModelsSettings(CommandSettings):
    """Where the pool's Redis is (after the subcommand's own arguments)."""

    model_config = SettingsConfigDict(cli_prog_name=PROG)
    config_table = "models"

    redis_url: RedisUrl = Field(default="redis://127.0.0.1:6379/0", description="the pool's Redis")
    key_prefix: str = Field(default=DEFAULT_PREFIX,
                            description="Redis key prefix (as the routers' and agents')")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Say which models the pool serves and on how many Macs. Agents run with --from-pool take "
        "the models that fit their memory budget, download them from Hugging Face and serve them. "
        "Connection options (--redis-url, --key-prefix, --config; MACPOOL_REDIS_URL, ...) follow the "
        "subcommand's arguments.",
    )
    sub = p.add_subparsers(dest="command", required=True)
    add = sub.add_parser("add", help="serve a model (or change its reference or replicas)")
    add.add_argument("name", help=NAME_HELP)
    add.add_argument("ref", help="org/repo:QUANT or org/repo/file.gguf on Hugging Face (as llama.cpp's -hf), "
                     "or a GGUF path that every Mac has")
    add.add_argument("--replicas", type=int, default=1, help="on how many Macs (default 1)")
    sub.add_parser("ls", help="the declared models, and the Macs holding each")
    rm = sub.add_parser("rm", help="stop serving a model: drained (in-flight requests finish), unloaded, "
                        "forgotten")
    rm.add_argument("name")
    rm.add_argument("--timeout", type=float, default=300.0,
                    help="seconds to wait for the Macs to drain and unload it (default 300; 0: do not wait)")
    return p


async def _add(store: ModelStore, name: str, ref: str, replicas: int) -> int:
    if not MODEL_NAME.match(name):
        raise ConfigError(f"{name!r} is not a model name ({NAME_HELP})")
    if replicas < 1:
        raise ConfigError(f"--replicas {replicas}: must be >= 1")
    source = model_source(ref)
    kind = "Hugging Face" if isinstance(source, HubRef) else "a file path every Mac must have"
    await store.declare(DeclaredModel(name=name, ref=str(source), replicas=replicas, added_at_ms=now_ms()))
    print(f"{name}: {source} ({kind}) on {replicas} Mac{'s' if replicas > 1 else ''}")
    return 0


async def _ls(store: ModelStore) -> int:
    declared = await store.declared()
    if not declared:
        print("no model declared (macpool models add NAME REF)")
        return 0
    rows = [("NAME", "REF", "REPLICAS", "HELD BY", "STATE")]
    for model in declared.values():
        holders = await store.holders(model.name)
        state = "removing" if model.removing else "ok" if len(holders) >= model.replicas else "placing"
        rows.append((model.name, model.ref, f"{len(holders)}/{model.replicas}", ",".join(holders) or "-",
                     state))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    return 0


async def _rm(store: ModelStore, name: str, wait_s: float) -> int:
    if await store.remove(name) is None:
        print(f"{PROG} rm: {name!r} is not declared", file=sys.stderr)
        return 1
    deadline = time.monotonic() + wait_s
    shown: list[str] | None = None
    while True:
        if await store.get(name) is None:
            print(f"{name}: drained, unloaded and removed")
            return 0
        holders = await store.holders(name)
        if not holders:  # nobody holds it any more (the Macs that did are gone): nothing left to drain
            await store.forget(name)
            print(f"{name}: removed (no Mac held it)")
            return 0
        if holders != shown:
            print(f"{name}: draining on {', '.join(holders)}", flush=True)
            shown = holders
        if time.monotonic() >= deadline:
            print(f"{name}: still draining on {', '.join(holders)}; it is removed once they are done "
                  f"(`{PROG} ls` shows it until then)")
            return 0
        await asyncio.sleep(0.5)


async def _run(args: argparse.Namespace, settings: ModelsSettings) -> int:
    connection = connect(settings.redis_url, socket_timeout=5.0, socket_connect_timeout=5.0)
    store = ModelStore(connection.client, Keys(settings.key_prefix))
    try:
        if args.command == "add":
            return await _add(store, args.name, args.ref, args.replicas)
        if args.command == "ls":
            return await _ls(store)
        return await _rm(store, args.name, args.timeout)
    finally:
        await connection.aclose()


def main(argv: list[str]) -> int:
    args, rest = _parser().parse_known_args(argv)
    try:
        settings = ModelsSettings.from_argv(rest)
        return asyncio.run(_run(args, settings))
    except ConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # (redis-py's connection errors are OSErrors' kin; said in one line)
        print(f"{PROG}: error: the pool's Redis: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
