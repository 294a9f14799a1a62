"""``macpool router``: build one Settings object from the command line and serve ``create_app(settings)``."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from types import FrameType

import uvicorn

from macpool import logs
from macpool.credentials import warn_on_command_line
from macpool.serving import server_config, tls_options
from router.settings import ConfigError, Settings


def build_settings(argv: list[str]) -> Settings:
    """The settings of ``macpool router <argv>``: its flags come from the settings model."""
    return Settings.from_argv(argv)


def serve(settings: Settings) -> None:
    from router.app import create_app, with_cors

    logs.configure(settings.log_level, settings.log_format)
    app = create_app(settings)
    config = server_config(
        with_cors(app, settings.cors_origins),
        # idle client connections stay open longer than clients keep them (httpx, the OpenAI SDK: 5 s), so
        # a client never sends a request on a connection the router is closing (it would get no answer)
        keep_alive=75,
        graceful_shutdown=settings.shutdown_timeout,
        host=settings.host,
        port=settings.port,
        loop="uvloop" if importlib.util.find_spec("uvloop") else "asyncio",
        access_log=settings.access_log,
        proxy_headers=settings.access_log,  # a client's address (X-Forwarded-For) is for the access log
        log_level=settings.log_level,
        backlog=4096,
        **tls_options(settings.tls_cert, settings.tls_key),
    )
    _Server(config, on_exit=app.state.begin_shutdown).run()


class _Server(uvicorn.Server):
    """uvicorn that also tells the application when a shutdown begins: uvicorn waits for every open
    response, and the dashboard's streams only end when told to."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]) -> None:
        super().__init__(config)
        self.on_exit = on_exit

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        self.on_exit()


def main(argv: list[str]) -> int:
    warn_on_command_line("macpool router", argv, ("--admin-key", "--read-key", "--agent-token"))
    try:
        settings = build_settings(argv)
        if settings.api_keys_file:
            from router.auth import load_api_keys

            load_api_keys(settings.api_keys_file)  # fail at the edge, not at first request
        if settings.pool_secret_file:
            from router.trust import NodeTrust

            NodeTrust(settings)  # an unreadable pool secret, or one others may read, fails here
    except ConfigError as exc:
        print(f"macpool router: {exc}", file=sys.stderr)
        return 2
    serve(settings)
    return 0
