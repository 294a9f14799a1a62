"""CPU time of processes, and pinning them to cores (``taskset``, ``sched_setaffinity``)."""

from __future__ import annotations

import contextlib
import os
import shutil

import psutil


def cpu_seconds(pid: int) -> float:
    """user + system CPU seconds of a process (all its threads)."""
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of a process and all its descendants (nginx's workers, LiteLLM's server process)."""
    try:
        root = psutil.Process(pid)
        family = [root, *root.children(recursive=True)]
    except psutil.Error:  # ended already: nothing left to count
        return 0.0
    total = 0.0
    for process in family:
        with contextlib.suppress(psutil.Error):  # a descendant that ended meanwhile
            times = process.cpu_times()
            total += times.user + times.system
    return total


def cpus() -> list[int]:
    """The CPUs this process may run on (every CPU where the system does not say: macOS)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def pinned(argv: list[str], cpu: int | None) -> list[str]:
    if cpu is None or shutil.which("taskset") is None:
        return argv
    return ["taskset", "-c", str(cpu), *argv]


def pin_self(cpu: int | None) -> None:
    """Keep this process (the load client) off the router's core."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})


def core_plan() -> tuple[int | None, int | None]:
    """(router core, everything-else core) on a machine with >= 2 cores, else (None, None)."""
    available = cpus()
    if len(available) < 2:
        return None, None
    return available[0], available[1]
