"""How a bench command ends: its table, a one-line JSON summary and the whole result as a file."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from macpool.bench.stack import Stack


def run_and_report(
    run: Callable[[Stack, Callable[[str], None]], dict[str, Any]],
    table: Callable[[dict[str, Any]], str],
    logs: Path | None,
    json_path: Path | None,
    details: tuple[str, ...],
) -> int:
    """A bench command's tail: run it on a fresh Stack (its logs kept in ``logs`` if given), print the table
    and the one-line summary (the result without ``details``), write the whole result to ``json_path``."""
    if logs:
        logs.mkdir(parents=True, exist_ok=True)
    with Stack(logs=logs, keep_logs=True) if logs else Stack() as stack:
        result = run(stack, lambda line: print(line, file=sys.stderr, flush=True))
    print(table(result))
    print(json.dumps({k: v for k, v in result.items() if k not in details}))
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def dump(data: dict[str, Any], path: Path | None) -> None:
    text = json.dumps(data, indent=2)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    print(text)
