"""``macpool bench prefill`` against the real llama-server: every run reads a recorded turn whole."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench.conftest import run_bench
from tests.e2e.conftest import require_llama_server


@pytest.mark.slow
@pytest.mark.llama_server
def test_each_run_prefills_the_whole_recorded_turn(tmp_path: Path) -> None:
    require_llama_server()
    report = run_bench(tmp_path, "prefill", "--turn", "claude", "--runs", "2")
    tokens = [run["prompt_tokens"] for run in report["runs"]]
    assert tokens[0] == tokens[1] > 20_000  # the slot's cache was erased between the runs
    assert report["path"] == "/v1/messages" and report["median_s"] > 0
