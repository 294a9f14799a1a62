"""``macpool bench models`` for real, small: A -> B -> A on two Macs that hold one model at a time."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench.conftest import run_bench

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

ARGS = (
    "--phase-seconds", "5",
    "--idle-unload", "2",  # A's Mac gives A back during B, so that the return to A is a cold start again
    # the router asks for a model's load at most once per cold-start timeout: the return to A (10 s after A's
    # first load) must come after that ask lapses, or it waits for it
    "--cold-start-timeout", "8",
)


def test_models_bench_loads_each_shift_on_demand_within_the_wired_limit(tmp_path: Path) -> None:
    result = run_bench(tmp_path, "models", *ARGS, timeout=100)
    phases = result["phases"]
    assert [p["model"] for p in phases] == ["a", "b", "a"]
    for p in phases:
        assert p["completed"] > 0, p
        assert p["errors"] == 0, p
        # the phase's model was loaded on some Mac during the phase: the shift cost a cold start
        assert sum(mac["loads"].get(p["model"], 0) for mac in p["macs"].values()) >= 1, p
        assert p["first_ttft_s"] and p["first_ttft_s"][0] > p["ttft_p50_s"], p
    assert result["errors"] == 0
    for name, mac in result["macs"].items():
        assert mac["samples"] > 0, name
        assert mac["peak_pinned_gb"] <= mac["wired_limit_gb"], (name, mac)
    assert result["within_wired_limit"] and result["cold_start_shows"]
    assert result["loads"]["a"] >= 2 and result["loads"]["b"] >= 1, result["loads"]
