"""``python tests/reliability/task_count.py <macpool subcommand> ...``: the subcommand, plus a test-only hook:
on SIGUSR1 the process prints ``tasks <n>`` - the asyncio tasks of its server's event loop - to its output.

A leak test compares the count at rest before and after a run; nothing in the product exposes it.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path
from typing import Any

import uvicorn

_serve = uvicorn.Server.serve


async def _counted_serve(self: uvicorn.Server, *args: Any, **kwargs: Any) -> None:
    loop = asyncio.get_running_loop()
    count = lambda: print(f"tasks {len(asyncio.all_tasks(loop))}", flush=True)  # noqa: E731
    loop.add_signal_handler(signal.SIGUSR1, count)
    await _serve(self, *args, **kwargs)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout, when run by path
    uvicorn.Server.serve = _counted_serve  # type: ignore[method-assign]
    from macpool.cli import main

    sys.exit(main(sys.argv[1:]))
