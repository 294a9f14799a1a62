"""``macpool autoscale``: parse flags, build the settings, run the controller until a signal."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from pathlib import Path

from macpool import logs
from macpool.settings import ConfigError
from macpool.store import Keys
from macpool.store.connect import connect

from .controller import Controller
from .settings import AutoscaleSettings, load_settings

PROG = "macpool autoscale"
log = logging.getLogger("macpool.autoscale")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Act on the pool's demand: activate standby Macs (and wake sleeping ones with "
        "Wake-on-LAN) when it exceeds ready capacity, send them back to standby when it stays low. Run "
        "two for high availability: one leads (a lease in Redis), the other takes over.",
        argument_default=None,
    )
    p.add_argument("--config", type=Path, help="TOML file, [autoscale] section (flags > env > file)")
    p.add_argument("--redis-url", dest="redis_url", help="default redis://127.0.0.1:6379/0")
    p.add_argument("--key-prefix", dest="key_prefix", help="Redis key prefix (default macpool:{pool}:)")
    p.add_argument("--interval", type=float, help="seconds between two looks at the pool (default 1)")
    p.add_argument("--lease", type=float, help="leader lease, seconds (default 5)")
    p.add_argument("--target-utilisation", dest="target_utilisation", type=float,
                   help="scale up when demand exceeds this share of capacity (default 0.8)")
    p.add_argument("--low-utilisation", dest="low_utilisation", type=float,
                   help="scale down when demand fits under this share without a node (default 0.5)")
    p.add_argument("--up-delay", dest="up_delay", type=float, help="seconds demand must stay high (10)")
    p.add_argument("--down-delay", dest="down_delay", type=float, help="seconds demand must stay low (120)")
    p.add_argument("--cooldown", type=float, help="seconds after any action before a scale-down (30)")
    p.add_argument("--min-nodes", dest="min_nodes", type=int, help="nodes kept active (default 0)")
    p.add_argument("--max-nodes", dest="max_nodes", type=int, help="nodes active at most (default 64)")
    p.add_argument("--wake-timeout", dest="wake_timeout", type=float,
                   help="seconds a woken Mac has to come back before it is woken again (120)")
    p.add_argument("--wol-port", dest="wol_port", type=int, help="UDP port of magic packets (default 9)")
    p.add_argument("--controller-id", dest="controller_id", help="default: host name and a random suffix")
    p.add_argument("--log-level", dest="log_level", choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-format", dest="log_format", choices=["text", "json"])
    return p


async def run(settings: AutoscaleSettings) -> int:
    """Lead or follow until SIGTERM/SIGINT; a clean stop gives the lease up at once."""
    connection = connect(settings.redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)
    controller = Controller(connection.client, Keys(settings.key_prefix), settings.controller())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("autoscale controller %s on %s", controller.id, connection.target.redacted)
    task = asyncio.create_task(controller.run())
    try:
        await stop.wait()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(controller.resign(), 2)
        await connection.aclose()
    return 0


def main(argv: list[str]) -> int:
    args = vars(_parser().parse_args(argv))
    config = args.pop("config")
    try:
        settings = load_settings(args, config)
    except ConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    logs.configure(settings.log_level, settings.log_format)
    try:
        return asyncio.run(run(settings))
    except KeyboardInterrupt:
        return 130
