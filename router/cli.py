"""``macpool router``: parse flags into one Settings object and serve ``create_app(settings)``."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn
from pydantic_core import PydanticUndefined

from macpool import logs
from macpool.serving import server_config
from router.settings import ConfigError, Settings, load_settings

# flag -> (type, help); every flag also has a MACPOOL_<NAME> environment variable and a TOML key
FLAGS: dict[str, tuple[type, str]] = {
    "redis-url": (str, "Redis URL shared with the agents and the other router replicas"),
    "host": (str, "address to listen on"),
    "port": (int, "port to listen on"),
    "queue-size": (int, "global bound of the wait queue, across all replicas (0: no queue)"),
    "queue-timeout": (float, "seconds a request may wait in the queue before 503 queue_timeout"),
    "cold-start-timeout": (float, "seconds a request waits while a standby node loads its model, when no "
                                  "node of its model is ready (then 503 cold_start; 0: at once)"),
    "lease-seconds": (float, "reservation lease; live requests renew it, a crashed router's expire"),
    "liveness-seconds": (float, "a router that has not beaten in Redis for this long counts as dead: the "
                                "other routers give its reservations back"),
    "max-body-bytes": (int, "largest accepted request body (413 above)"),
    "request-read-timeout": (float, "seconds a client may take to send a request's body, then 408"),
    "api-keys-file": (Path, "client API keys, one per line: plaintext or SHA-256 hex digest, then optional "
                            "name=TENANT priority=interactive|batch max_concurrency=N"),
    "admin-key": (str, "bearer key for /admin/* (admin API disabled when unset)"),
    "agent-token": (str, "token sent to the agents in X-Macpool-Token"),
    "default-model": (str, "model used when a request names none (unset: any node)"),
    "model-aliases": (str, "names clients send for a served model, NAME=MODEL or PATTERN=MODEL, comma-"
                           "separated: exact names first, then patterns in order (claude-*=qwen3-coder)"),
    "light-concurrency": (int, "light requests (token counts, templates) this router sends a node at once"),
    "cors-origins": (str, "browser origins allowed to call the API, comma-separated "
                          "(https://chat.example.com), or * for any (unset: no CORS)"),
    "placement": (str, "fastest: the node that would answer soonest, from each node's measured TTFT and "
                       "per-slot decode speed; least-utilised: the node with the smallest share in use"),
    "placement-tokens": (int, "answer length, in tokens, the fastest placement expects a request to ask for"),
    "affinity-abs-threshold": (int, "affinity yields to the node placement chose when the preferred node has "
                                    "at least this many more requests in flight (and the relative holds)"),
    "affinity-rel-threshold": (float, "affinity yields when the preferred node's utilisation is over this "
                                      "multiple of placement's node's (and the absolute one holds)"),
    "affinity-max-entries": (int, "prompt-prefix entries remembered in Redis (least recently used dropped)"),
    "default-priority": (str, "priority of requests without X-Macpool-Priority or a per-key default"),
    "batch-queue-share": (float, "share of the queue batch requests may occupy (0: batch never queues)"),
    "key-max-concurrency": (int, "requests in flight (and queued) per API key, 429 above (0: no limit)"),
    "connect-timeout": (float, "seconds to connect to an agent"),
    "first-byte-timeout": (float, "seconds from sending a streamed request to its first response byte"),
    "response-timeout": (float, "seconds from sending a non-streamed request to its answer (it arrives "
                                "whole, after the whole generation)"),
    "idle-timeout": (float, "seconds allowed between two chunks of a response"),
    "max-attempts": (int, "nodes tried per request before giving up (failover before the first byte)"),
    "key-prefix": (str, "prefix of every Redis key"),
    "router-id": (str, "this replica's id (default: host-pid-random)"),
    "refresh-interval": (float, "seconds between full reads of the pool"),
    "stale-after": (float, "a node whose heartbeat is older than this many seconds is not routed to"),
    "circuit-failures": (int, "consecutive connect failures that open a node's circuit"),
    "circuit-cooldown": (float, "seconds an open circuit waits before letting traffic probe the node"),
    "log-level": (str, "debug, info, warning or error"),
    "log-format": (str, "text, or json: one JSON object per line (uvicorn's lines too)"),
    "shutdown-timeout": (int, "on SIGTERM, seconds in-flight requests may take to finish; streams still "
                              "open then end with an SSE error event (router_shutdown)"),
    "scale-target-utilisation": (float, "the scale hint asks for more Macs when demand passes this share of "
                                        "the pool's capacity"),
    "scale-low-utilisation": (float, "...and for fewer when demand would fit under this share of fewer Macs"),
    "scale-up-delay": (float, "seconds demand must stay over the target before the hint goes up"),
    "scale-down-delay": (float, "seconds demand must stay under the low share before the hint goes down"),
    "scale-min-nodes": (int, "the fewest Macs the scale hint asks for"),
    "scale-max-nodes": (int, "the most Macs the scale hint asks for"),
    "scale-webhook": (str, "POST the scale hint (GET /api/pool/scale) here when desired_nodes changes"),
}


def _default(flag: str) -> str:
    """' (default X)' from the settings object (the flags themselves default to None: unset)."""
    field = Settings.model_fields.get(flag.replace("-", "_"))
    if field is None or field.default_factory is not None or field.default in (None, "", PydanticUndefined):
        return ""
    return f" (default {field.default})"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="macpool router", description="Run the pool's OpenAI-compatible router.")
    p.add_argument("--config", type=Path, help="TOML file (top-level keys or a [router] table)")
    for flag, (type_, help_) in FLAGS.items():
        p.add_argument(f"--{flag}", type=type_, help=help_ + _default(flag))
    # both ways, so a flag can undo what the file or the environment set
    p.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=None,
                   help="log every request (default off)")
    p.add_argument("--load-on-demand", action=argparse.BooleanOptionalAction, default=None,
                   help="a request for a model no ready node serves asks a standby node of it to load it, "
                        "once for every router (--no-load-on-demand: only the autoscaler loads; default on)")
    p.add_argument("--affinity", action=argparse.BooleanOptionalAction, default=None,
                   help="prefer the node holding the prompt's prefix; --no-affinity routes by load only "
                        "(default on)")
    return p


def build_settings(argv: list[str]) -> Settings:
    args = parser().parse_args(argv)
    overrides: dict[str, Any] = {k: v for k, v in vars(args).items() if k != "config" and v is not None}
    return load_settings(overrides, args.config)


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
    try:
        settings = build_settings(argv)
        if settings.api_keys_file:
            from router.auth import load_api_keys

            load_api_keys(settings.api_keys_file)  # fail at the edge, not at first request
    except ConfigError as exc:
        print(f"macpool router: {exc}", file=sys.stderr)
        return 2
    serve(settings)
    return 0
