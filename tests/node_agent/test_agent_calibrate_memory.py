"""``macpool agent calibrate`` finds the memory knee of two machine descriptions (a file of its own: each
sweep takes a while, and pytest-xdist runs files side by side)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.node_agent.test_agent_calibrate import SimFactory, calibrate


@pytest.mark.slow
def test_calibrate_recommends_8_on_the_seed_machine(sim: SimFactory, tmp_path: Path) -> None:
    upstream = sim("--parallel", "24", "--speed", "50", "--metrics")
    # 4,864 prompt + 256 generated tokens: the working set of the seed's 4K-prompt requests, in fewer steps
    result = calibrate(upstream.url, tmp_path,
                       "--prompt-tokens", "4864", "--max-tokens", "256", "--levels", "1,4,8,9")
    assert result["recommended_cap"] == 8
    assert result["limited_by"] == "memory"
    per_request = result["per_request_gb"]
    assert isinstance(per_request, float) and 2.3 < per_request < 2.9  # the preset's 2.625 GB
    rows = result["rows"]
    assert isinstance(rows, list) and rows[0]["concurrency"] == 1


@pytest.mark.slow
def test_calibrate_finds_the_knee_of_another_machine(sim: SimFactory, tmp_path: Path) -> None:
    # M2 Pro 32 GB, 8B model: 4.9 GB fixed + 1.06 GB per 2K-token request under 0.85 x 21.3 GB -> 12
    upstream = sim("--parallel", "16", "--speed", "40", "--metrics", preset="m2pro-32g-8b-q4")
    result = calibrate(upstream.url, tmp_path,
                       "--prompt-tokens", "2048", "--max-tokens", "256", "--levels", "1,6,12,13")
    assert result["recommended_cap"] == 12
    assert result["limited_by"] == "memory"
