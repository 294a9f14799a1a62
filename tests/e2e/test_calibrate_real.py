"""``agent calibrate`` against the real llama-server: the sweep completes, and its cap falls within one
level of the saturation point the load generator measures on its own.

The generated ``small`` model (~19 M parameters in F16) on one thread: a batch of a few sequences already
fills the arithmetic, so throughput saturates at a small concurrency while p50 keeps climbing.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
from pathlib import Path

import httpx
import numpy as np
import pytest

from macpool import tiny_model
from macpool.procs import macpool_argv
from macpool.redis_server import free_port
from node_agent.loadgen import Clock, Level
from tests.conftest import SpawnFactory
from tests.e2e.conftest import require_llama_server

pytestmark = [pytest.mark.llama_server, pytest.mark.slow]

LEVELS = range(1, 7)
PROMPT_TOKENS, MAX_TOKENS = 32, 16


async def measured_saturation(base: str) -> tuple[int, list[float]]:
    """Every level measured in turn, then the smallest level reaching 95% of the best throughput on the
    saturating curve ``A x c / (c + h)`` fitted to them all (one level on a shared machine can read well off
    its own): ``c / throughput`` is a straight line, ``c / A + h / A``."""
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=None)) as client:
        clock = Clock(client, base)
        await clock.detect()
        raw = []
        for c in LEVELS:
            level = Level(client, base, clock, c, PROMPT_TOKENS, MAX_TOKENS, None, max(12, 4 * c))
            raw.append((await level.run()).throughput_tok_s)
    inverse_a, h_over_a = np.polyfit(list(LEVELS), [c / t for c, t in zip(LEVELS, raw, strict=True)], 1)
    if inverse_a <= 0 or h_over_a < 0:  # not a saturating curve: the medians of neighbouring levels
        curve = [statistics.median(raw[max(0, i - 1) : i + 2]) for i in range(len(raw))]
    else:
        curve = [c / (inverse_a * c + h_over_a) for c in LEVELS]
    best = max(curve)
    return next(c for c, value in zip(LEVELS, curve, strict=True) if value >= 0.95 * best), raw


def test_calibrate_finds_the_saturation_point_of_the_real_llama_server(
    spawn: SpawnFactory, tmp_path: Path
) -> None:
    # a throughput curve is only measurable on CPUs this test has to itself (CI runners do); on a machine
    # already running more than it has cores for, other processes decide every level's figure
    busy, cores = os.getloadavg()[0], os.cpu_count() or 1
    if busy > cores and not os.environ.get("CI"):
        pytest.skip(f"load average {busy:.1f} on {cores} cores: throughput here measures the other processes")
    binary, model, port = require_llama_server(), tiny_model.ensure("small"), free_port()
    slots = max(LEVELS)
    argv = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
            "--parallel", str(slots), "--ctx-size", str(slots * 256), "--metrics", "-t", "1"]
    server = spawn(argv=argv, port=port, ready_path="/health", timeout=60, name="llama-server")

    out = tmp_path / "cal.json"
    done = subprocess.run(
        macpool_argv("agent", "calibrate", "--upstream", server.url, "--prompt-tokens", str(PROMPT_TOKENS),
                     "--max-tokens", str(MAX_TOKENS), "--max-concurrency", str(slots), "--json", str(out)),
        capture_output=True, text=True, timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert result["rows"] and result["reason"] and result["memory_knee"] is None  # no wired limit on Linux
    saturation, raw = asyncio.run(measured_saturation(server.url))
    cap = result["recommended_cap"]
    swept = [round(row["throughput_tok_s"], 1) for row in result["rows"]]
    assert abs(cap - saturation) <= 1, (cap, saturation, swept, [round(t, 1) for t in raw], result["reason"])
