"""Smoke test of ``macpool bench fairness``: a short run, real processes, the JSON's keys and the light
tenant's bounded wait.

The same run holds its own control: in the ``fifo`` phase the light clients send the flood's key, so the
router cannot favour them, and the bound that the ``fair`` phase must meet has to fail there.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.bench.conftest import run_bench

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

BATCH_PHASE_S = 4.0
SUMMARY_KEYS = {
    "wait_measure", "service_s", "light_wait_bound_s", "light_wait_bounded", "fair_light_wait_p50_s",
    "fair_light_wait_p99_s", "fair_flood_wait_p50_s", "fair_ratio_light_flood_wait_p50",
    "fifo_light_wait_p50_s", "fifo_light_wait_p99_s", "fifo_over_fair_light_wait_p50",
    "batch_light_served_while_flood_ran",
    "batch_light_requests", "batch_light_wait_p50_s", "conditions", "phases",
}
TENANT_KEYS = {
    "requests", "errors", "latency_p50_s", "latency_p99_s", "service_p50_s", "queue_wait_p50_s",
    "queue_wait_p99_s", "queue_wait_mean_s", "router_queued", "router_queue_wait_mean_s",
}
TENANTS = {
    "unloaded": {"light"}, "flood_alone": {"flood"}, "fair": {"flood", "light"}, "fifo": {"flood", "light"},
    "batch": {"flood", "light"},
}


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    args = ["--unloaded", "3", "--warmup", "2", "--phase", "8", "--batch-phase", str(BATCH_PHASE_S)]
    return run_bench(tmp_path_factory.mktemp("fairness"), "fairness", *args, timeout=240)


def light_wait_is_bounded(phase: dict[str, Any], service_s: float) -> bool:
    """The light tenant waits for about one freed slot, not for the flood queued ahead of it."""
    light, flood = phase["light"], phase["flood"]
    return bool(
        light["queue_wait_p99_s"] <= 2 * service_s
        and light["queue_wait_p50_s"] * 4 < flood["queue_wait_p50_s"]
    )


def test_every_phase_reports_each_tenant_without_errors(result: dict[str, Any]) -> None:
    assert set(result) >= SUMMARY_KEYS, SUMMARY_KEYS - set(result)
    phases = result["phases"]
    assert set(phases) == set(TENANTS)
    for name, tenants in TENANTS.items():
        assert {"flood", "light"} & set(phases[name]) == tenants, name
        for tenant in tenants:
            figures = phases[name][tenant]
            assert set(figures) >= TENANT_KEYS, (name, tenant, TENANT_KEYS - set(figures))
            assert figures["requests"] > 0 and figures["errors"] == 0, (name, tenant, figures)
            assert 0 <= figures["queue_wait_p50_s"] <= figures["queue_wait_p99_s"], (name, tenant, figures)


def test_the_light_tenant_waits_for_one_slot_not_for_the_flood(result: dict[str, Any]) -> None:
    service = result["service_s"]
    assert 0.1 < service < 1.0, service  # the conditions the bench is sized for
    fair = result["phases"]["fair"]
    assert result["light_wait_bounded"], fair
    assert light_wait_is_bounded(fair, service), fair
    # the flood queues behind its own clients for several service times
    assert fair["flood"]["queue_wait_p50_s"] > 2 * service, fair


def test_without_fair_queueing_the_same_clients_wait_behind_the_flood(result: dict[str, Any]) -> None:
    fifo = result["phases"]["fifo"]
    assert not light_wait_is_bounded(fifo, result["service_s"]), fifo
    assert result["fifo_over_fair_light_wait_p50"] > 3, result["fifo_over_fair_light_wait_p50"]


def test_the_router_measures_the_same_waits(result: dict[str, Any]) -> None:
    for tenant in ("flood", "light"):
        figures = result["phases"]["fair"][tenant]
        assert figures["router_queued"] <= figures["requests"] + 4, figures  # a few straddle the boundary
        # the client-side figure adds the relay's overhead (the unloaded phase's wait)
        assert figures["router_queue_wait_mean_s"] == pytest.approx(figures["queue_wait_mean_s"], abs=0.15)
    assert result["phases"]["fifo"]["light"]["router_queue_wait_mean_s"] is None  # the router saw no light


def test_batch_waits_behind_interactive(result: dict[str, Any]) -> None:
    assert result["batch_light_requests"] > 0
    assert result["batch_light_served_while_flood_ran"] == 0
    assert result["batch_light_wait_p50_s"] > BATCH_PHASE_S / 2, result["phases"]["batch"]["light"]
