"""Smoke test of ``macpool bench affinity``: a tiny run, real processes, the JSON's keys and sane values.

No speed target here (the machine is shared): the ratios are what the bench command itself reports.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.bench.conftest import run_bench

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CLIENTS, PER_CLIENT, TURNS = 4, 1, 3
RUN_KEYS = {
    "ttft_p50_s", "ttft_p99_s", "ttft_p50_first_turn_s", "ttft_p50_follow_up_s", "latency_p50_s",
    "throughput_tok_s", "completed", "errors", "rejected_503", "follow_ups_on_previous_node",
    "turns_per_node", "prompt_tokens_cached_total", "prompt_tokens_cached_per_node", "cached_share",
    "reusable_share", "router_affinity_total", "speed_achieved", "truncated",
}


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    args = [
        "--nodes", "2", "--parallel", "2", "--per-client", str(PER_CLIENT), "--turns", str(TURNS),
        "--doc-tokens", "1500", "--reply-tokens", "32", "--speed", "4", "--max-wall", "60",
    ]
    return run_bench(tmp_path_factory.mktemp("affinity"), "affinity", *args, timeout=240)


def test_both_runs_complete_every_turn(result: dict[str, Any]) -> None:
    assert set(result["runs"]) == {"affinity_on", "affinity_off"}
    for run in result["runs"].values():
        assert set(run) >= RUN_KEYS, RUN_KEYS - set(run)
        assert run["errors"] == 0, run["error_sample"]
        assert run["completed"] == CLIENTS * PER_CLIENT * TURNS and not run["truncated"]
        assert sum(run["turns_per_node"].values()) == run["completed"]
        assert set(run["turns_per_node"]) <= {"mac-0", "mac-1"}


def test_times_and_rates_are_sane(result: dict[str, Any]) -> None:
    for run in result["runs"].values():
        assert 0 < run["ttft_p50_s"] <= run["ttft_p99_s"] < run["latency_p50_s"] * 10
        assert run["throughput_tok_s"] > 0
        assert 0 < run["speed_achieved"] <= 4 * 1.05  # the simulators never outrun --speed 4


def test_cached_tokens_never_exceed_what_the_histories_allow(result: dict[str, Any]) -> None:
    for run in result["runs"].values():
        cached = run["prompt_tokens_cached_per_node"]
        assert set(cached) == {"mac-0", "mac-1"} and sum(cached.values()) == run["prompt_tokens_cached_total"]
        assert 0 < run["reusable_share"] < 1
        assert 0 <= run["cached_share"] <= run["reusable_share"] + 0.01, run


def test_ratios_are_the_runs_figures(result: dict[str, Any]) -> None:
    on, off = result["runs"]["affinity_on"], result["runs"]["affinity_off"]
    ttft, throughput = off["ttft_p50_s"] / on["ttft_p50_s"], on["throughput_tok_s"] / off["throughput_tok_s"]
    assert result["ttft_p50_ratio"] == pytest.approx(ttft, abs=1e-3)
    assert result["throughput_ratio"] == pytest.approx(throughput, abs=1e-3)
    assert result["target_met"] == (result["ttft_p50_ratio"] >= 2 and result["throughput_ratio"] >= 0.95)


def test_only_the_affinity_router_reports_affinity_outcomes(result: dict[str, Any]) -> None:
    on, off = result["runs"]["affinity_on"], result["runs"]["affinity_off"]
    assert off["router_affinity_total"] is None
    outcomes = on["router_affinity_total"]
    assert outcomes and set(outcomes) <= {"hit", "miss", "overridden"}, outcomes
    assert sum(outcomes.values()) <= on["completed"]
    assert outcomes.get("miss", 0) >= CLIENTS * PER_CLIENT  # every first turn: its document is new
    assert outcomes.get("hit", 0) > 0
