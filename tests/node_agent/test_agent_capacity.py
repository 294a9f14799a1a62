"""Capacity arithmetic, the pressure guard's hysteresis, and the calibrate knee on described machines."""

from __future__ import annotations

from node_agent.calibrate import Bounds, dipped, find_knee
from node_agent.capacity import PressureGuard, decide, memory_cap
from node_agent.loadgen import LevelResult
from node_agent.memory import MemorySample, Pressure


def test_memory_cap_floors_and_never_goes_negative() -> None:
    assert memory_cap(36, 8, 2, 2.6) == 10
    assert memory_cap(36, 8, 2, 2.0) == 13
    assert memory_cap(8, 8, 2, 1.0) == 0


def test_decide_takes_the_smallest_known_term() -> None:
    decision = decide(configured=24, memory=10, calibrated=8, in_flight=3)
    assert decision.capacity == 8
    assert "calibrated" in decision.reason
    assert decide(None, None, None, 0).capacity == 0
    assert decide(16, None, None, 0).capacity == 16


def test_capacity_never_exceeds_the_slots_of_llama_server() -> None:
    over = decide(configured=6, memory=None, calibrated=None, in_flight=0, slots=3)
    assert (over.capacity, over.breakdown.configured) == (3, 3)
    assert over.reason == "capacity 3 set by llama-server's 3 slots (--cap 6 is above them)"
    assert decide(None, None, None, 0, slots=24).reason == "capacity 24 set by llama-server's 24 slots"
    assert decide(4, None, None, 0, slots=4).reason == "capacity 4 set by the configured limit"
    assert decide(2, None, None, 0, slots=4).reason == "capacity 2 set by the configured limit"
    assert decide(6, 10, 8, 0, slots=24).capacity == 6
    assert decide(None, 10, 12, 0, slots=24).reason == "capacity 10 set by the memory limit"
    assert decide(6, None, None, 0).capacity == 6  # the slots not known yet: the cap alone


def test_pressure_admits_nothing_new() -> None:
    decision = decide(configured=24, memory=10, calibrated=8, in_flight=5, pressure_reason="memory paging")
    assert decision.capacity == 5
    assert decision.breakdown.pressure_limited


def _sample(pinned: float, swap: float = 0.0, pressure: Pressure = "normal") -> MemorySample:
    return MemorySample(
        total_gb=128, wired_limit_gb=36, pinned_gb=pinned, swap_used_gb=swap, pressure=pressure
    )


def test_pressure_guard_enters_at_once_and_leaves_after_calm_beats() -> None:
    guard = PressureGuard(recover_beats=3)
    assert not guard.update(_sample(20))
    assert guard.update(_sample(35.5))  # pinned near the wired limit
    assert "wired limit" in guard.reason
    assert guard.update(_sample(20))
    assert guard.update(_sample(20))
    assert not guard.update(_sample(20))
    assert guard.update(_sample(20, swap=0.5))  # swap growing
    assert PressureGuard().update(_sample(10, pressure="warning"))


def _rows(machine: list[tuple[int, float, float, float | None]], limit: float | None) -> list[LevelResult]:
    return [
        LevelResult(c, thr, p50, p50 / 4, pinned, limit, None, 2 * c, 0) for c, thr, p50, pinned in machine
    ]


def test_knee_of_the_seed_table() -> None:
    seed = [(1, 82, 1.0, 11), (4, 190, 1.7, 19), (8, 240, 3.1, 30), (12, 210, 6.4, 41), (16, 70, 18, 48)]
    knee = find_knee(_rows(seed, 36))
    assert knee.recommended_cap == 8
    assert knee.per_request_gb is not None and 2 < knee.per_request_gb < 3


def test_knee_without_memory_figures_is_where_throughput_saturates() -> None:
    # a real llama-server: no /sim/memory; throughput saturates (130 x c / (c + 1.5)) while p50 climbs
    curve = [(c, 130 * c / (c + 1.5), 1 + 0.5 * c, None) for c in range(1, 10)]
    knee = find_knee(_rows(curve, None))
    assert (knee.recommended_cap, knee.throughput_knee, knee.memory_knee) == (7, 7, None)
    assert knee.limited_by == "throughput" and "throughput knee 7" in knee.reason
    assert knee.per_request_gb is None


def test_one_noisy_level_moves_the_throughput_knee_by_one_at_most() -> None:
    clean = [(c, 130 * c / (c + 1.5), 1 + 0.5 * c, None) for c in range(1, 13)]
    for noisy in (2, 3, 5, 7):
        for factor in (0.9, 1.1):
            curve = [(c, thr * (factor if c == noisy else 1), p50, m) for c, thr, p50, m in clean]
            measured = next(
                knee for k in range(3, 13) if (knee := find_knee(_rows(curve[:k], None), complete=False))
                .throughput_knee
            )
            assert measured.throughput_knee in (6, 7, 8), (noisy, factor)


def test_a_flat_top_is_read_where_it_starts() -> None:
    # throughput that stops growing at 4: the first three curves were measured with a plain sweep past the
    # slots of a real llama-server (F16 model, one thread, --parallel 4), the last is an ideal roofline
    for measured in ((109, 110, 147, 164, 164, 164, 159), (105, 108, 148, 166, 169, 167, 167),
                     (112, 111, 144, 159, 159, 161, 160), (60, 100, 130, 150, 150, 150, 150)):
        curve = [(c, thr, 1 + 0.5 * c, None) for c, thr in zip((1, 2, 3, 4, 5, 6, 8), measured, strict=True)]
        knee = find_knee(_rows(curve, None))
        assert knee.throughput_knee in (4, 5), (measured, knee.reason)
    # the fit over every level, flat tail included, bends late: it would say 6 here
    ideal = (60, 100, 130, 150, 150, 150, 150)
    curve = [(c, thr, 1 + 0.5 * c, None) for c, thr in zip((1, 2, 3, 4, 5, 6, 8), ideal, strict=True)]
    assert find_knee(_rows(curve, None)).throughput_knee == 4
    # a top that later levels rise above is no flat top: the whole curve is fitted
    rising = [(c, 130 * c / (c + 1.5) * (1.1 if c == 5 else 1), 1 + 0.5 * c, None) for c in range(1, 10)]
    assert find_knee(_rows(rising, None)).throughput_knee == 7


def test_a_level_reading_well_below_the_best_before_it_is_measured_again() -> None:
    # a real sweep (Q4_0 model, one thread): 5 read 251 once, where it reads ~297; kept, the fit over four
    # levels would call 2 the knee and end the sweep
    rows = _rows([(2, 250, 1.0, None), (3, 255, 1.1, None), (4, 315, 1.2, None)], None)
    assert dipped(rows, _rows([(5, 251, 1.4, None)], None)[0])
    assert not dipped(rows, _rows([(5, 297, 1.4, None)], None)[0])
    assert not dipped([], _rows([(1, 10, 1.0, None)], None)[0])
    paging = _rows([(5, 100, 9.0, 60)], 64)[0]  # past the memory knee: a signal, not a window to repeat
    assert not dipped(rows, paging)


def test_levels_with_failed_requests_end_the_healthy_range_and_keep_the_sweep() -> None:
    curve = [(c, 40.0 * c, 1 + 0.05 * c, 5 + c) for c in range(1, 7)]
    rows = _rows(curve, 64)
    rows[4].errors, rows[4].succeeded = 3, 20  # 13% failed at 5
    knee = find_knee(rows)
    assert (knee.recommended_cap, knee.limited_by, knee.error_knee) == (4, "errors", 4)
    assert "errors at 5: 3 of 23 requests failed" in knee.reason


def test_a_latency_bound_takes_the_largest_level_meeting_it() -> None:
    curve = [(c, 130 * c / (c + 1.5), 1 + 0.5 * c, None) for c in range(1, 10)]
    knee = find_knee(_rows(curve, None), Bounds(max_p50_ratio=2.0))
    assert (knee.recommended_cap, knee.limited_by, knee.latency_cap) == (4, "latency", 4)  # 3.0 / 1.5
    knee = find_knee(_rows(curve, None), Bounds(max_ttft_s=0.5))  # _rows: TTFT = p50 / 4
    assert (knee.recommended_cap, knee.limited_by) == (2, "latency")
    knee = find_knee(_rows(curve, None), Bounds(max_ttft_s=0.3))
    assert (knee.recommended_cap, knee.limited_by) == (0, "latency")


def test_knee_of_a_machine_that_never_bends() -> None:
    curve = [(c, 40.0 * c, 1 + 0.05 * c, 5 + c) for c in range(1, 5)]
    knee = find_knee(_rows(curve, 64))
    assert (knee.recommended_cap, knee.limited_by) == (4, "none")


def test_memory_that_does_not_grow_with_concurrency_gives_no_per_request_figure() -> None:
    # llama-server allocates its KV cache up front: pinned memory flat, or a hair lower at the next level
    curve = [(1, 40.0, 1.0, 20.002), (2, 80.0, 1.05, 20.0)]
    knee = find_knee(_rows(curve, 64))
    assert knee.per_request_gb is None and knee.weights_gb is not None
