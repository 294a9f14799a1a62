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
