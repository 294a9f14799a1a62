"""``macpool autoscale``: build the settings from the command line, run the controller until a signal."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys

from macpool import logs
from macpool.settings import ConfigError
from macpool.store import Keys
from macpool.store.connect import connect

from .controller import Controller
from .settings import AutoscaleSettings

PROG = "macpool autoscale"
log = logging.getLogger("macpool.autoscale")


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
    try:
        settings = AutoscaleSettings.from_argv(argv)
    except ConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    logs.configure(settings.log_level, settings.log_format)
    try:
        return asyncio.run(run(settings))
    except KeyboardInterrupt:
        return 130
