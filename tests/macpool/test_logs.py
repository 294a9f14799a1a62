"""The logging the router and the agent set up (macpool/logs.py), in a process of its own: it is global."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# what uvicorn logs when requests outlast its graceful shutdown (uvicorn/server.py), and an error of its own
EMIT = """
import logging, sys
from macpool import logs
logs.configure("info", sys.argv[1])
uvicorn_log = logging.getLogger("uvicorn.error")
uvicorn_log.error("Cancel %s running task(s), timeout graceful shutdown exceeded", 1)
uvicorn_log.error("Exception in ASGI application")
"""


def logged(log_format: str) -> list[tuple[str, str]]:
    """(level, message) of each line a process logging as the router and the agent do writes for ``EMIT``."""
    done = subprocess.run(
        [sys.executable, "-c", EMIT, log_format], capture_output=True, text=True, timeout=30, check=True
    )
    lines = done.stderr.splitlines()
    if log_format == "json":
        return [(record["level"], record["message"]) for record in map(json.loads, lines)]
    fields = [line.split(" ", 4) for line in lines]  # date, time, level, logger, message
    return [(level, message) for _date, _time, level, _logger, message in fields]


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_uvicorn_graceful_shutdown_timeout_is_a_warning_not_an_error(log_format: str) -> None:
    assert logged(log_format) == [
        ("WARNING", "Cancel 1 running task(s), timeout graceful shutdown exceeded"),
        ("ERROR", "Exception in ASGI application"),  # only that one line is lowered
    ]
