"""bench elastic's figures from a recorded run: lost requests, 503s by reason, time to serve, node-seconds."""

from __future__ import annotations

from macpool.bench.elastic import ElasticOptions, Outcome, PoolRun, summarize


def point(t: float, capacity: float, nodes_on: float) -> dict[str, float]:
    return {"t": t, "demand": 0.0, "ready_capacity": capacity, "nodes_ready": nodes_on, "nodes_on": nodes_on,
            "clients": 0.0}


def test_the_summary_counts_what_the_clients_and_the_pool_view_saw() -> None:
    opts = ElasticOptions(low_s=2.0, high_s=4.0, tail_s=2.0)
    run = PoolRun("elastic", timeline=[point(0, 4, 2), point(1, 4, 2), point(2, 4, 2), point(3.5, 8, 4),
                                       point(6, 8, 4), point(8, 4, 2)])
    outcomes = [Outcome(1, "low", 200), Outcome(3, "high", 200), Outcome(3, "high", 503, "queue_timeout"),
                Outcome(4, "high", 200), Outcome(5, "high", 0, "ReadError"), Outcome(7, "tail", 200)]
    summarize(run, outcomes, opts)
    assert (run.requests, run.ok, run.lost) == (6, 4, 1)
    assert run.rejected == {"queue_timeout": 1}
    assert run.goodput_high_rps == 0.5  # two answered over the 4 s step
    assert run.time_to_added_capacity_s == 1.5  # capacity above its pre-step 4 at 3.5 s, the step at 2 s
    assert run.node_seconds == 2 * 3.5 + 4 * 4.5
