"""Logging of the long-running processes (router, agent): text lines, or one JSON object per line.

Both set up the root logger here and run uvicorn without its own logging configuration, so uvicorn's lines
(startup, errors, the access log) come out in the same format as theirs. ``--log-format json`` writes each
record as ``{"level", "logger", "message", "ts"}`` (ts in ISO 8601, UTC) plus ``exc_info`` for a traceback,
for log shippers.
"""

from __future__ import annotations

import logging
import sys
from typing import Literal

from pythonjsonlogger.core import RESERVED_ATTRS
from pythonjsonlogger.json import JsonFormatter

LogFormat = Literal["text", "json"]
TEXT = "%(asctime)s %(levelname)s %(name)s %(message)s"

# uvicorn logs this at ERROR when requests outlast its graceful shutdown: every agent drain that times out
# with a stream open, every router stopped with streams open. Those streams end with an error event by
# design, so the line is a warning: at ERROR it pages whoever alerts on errors, at every such deploy.
UVICORN_SHUTDOWN_TIMEOUT = "Cancel %s running task(s), timeout graceful shutdown exceeded"


def _shutdown_timeout_as_warning(record: logging.LogRecord) -> bool:
    if record.msg == UVICORN_SHUTDOWN_TIMEOUT and record.levelno > logging.WARNING:
        record.levelno, record.levelname = logging.WARNING, logging.getLevelName(logging.WARNING)
    return True


def configure(level: str, log_format: LogFormat) -> None:
    """Send every logger's records (uvicorn's included: pass ``log_config=None`` to it) to stderr."""
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(
            JsonFormatter(
                "%(levelname)s %(name)s %(message)s",
                rename_fields={"levelname": "level", "name": "logger"},
                timestamp="ts",  # ISO 8601, UTC
                reserved_attrs=[*RESERVED_ATTRS, "color_message"],  # uvicorn's copy with terminal colours
                json_ensure_ascii=False,
            )
        )
    else:
        handler.setFormatter(logging.Formatter(TEXT))
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level.upper())
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per upstream call is too much
    uvicorn_log = logging.getLogger("uvicorn.error")
    if _shutdown_timeout_as_warning not in uvicorn_log.filters:
        uvicorn_log.addFilter(_shutdown_timeout_as_warning)
