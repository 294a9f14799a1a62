"""Shared by the bench smoke tests: run one ``macpool bench`` command for real and read its JSON."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from macpool.dev.procs import macpool_argv


def run_bench(out_dir: Path, name: str, *args: str, timeout: float = 400) -> dict[str, Any]:
    """``macpool bench <name> <args> --json <out_dir>/<name>.json``; fails with its stderr if it fails."""
    out = out_dir / f"{name}.json"
    done = subprocess.run(
        macpool_argv("bench", name, *args, "--json", str(out)), capture_output=True, text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    data: dict[str, Any] = json.loads(out.read_text())
    return data
