"""``macpool bench chaos`` for real, at its smallest: five faults, each one clean (macpool/bench/chaos.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench.conftest import run_bench

pytestmark = pytest.mark.timeout(600)


def test_chaos_runs_every_fault_cleanly(tmp_path: Path) -> None:
    data = run_bench(tmp_path, "chaos", "--nodes", "2", "--cap", "2", "--clients", "3", "--freeze", "1")
    assert [r["fault"].split()[0] for r in data] == ["agent", "simulator", "Redis", "Redis", "router"]
    for result in data:
        assert set(result["outcomes"]) <= {"ok", "503", "sse_error", "router_died"}, result
        assert result["outcomes"].get("ok", 0) > 0, result
        assert result["over_admission"] == 0 and result["left"] == 0, result
