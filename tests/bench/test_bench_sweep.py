"""The load driver and the sweep end to end against a simulator; the seed-table verdict."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

from macpool.bench import seed_table
from macpool.bench.load import ClosedLoop, RequestRecord, chat_body, retimed
from macpool.bench.sweep import ROW_KEYS, Row
from macpool.bench.sweep import main as sweep_main
from tests.conftest import Server

SimFactory = Callable[..., Server]


def test_closed_loop_records_every_request(sim: SimFactory) -> None:
    server = sim("--parallel", "2", "--speed", "50")
    loop = ClosedLoop(server.url, concurrency=3, make_body=chat_body(64, 8), requests_per_client=2)
    records = asyncio.run(loop.run())
    assert len(records) == 6
    assert all(r.ok and r.tokens == 8 and r.ttft_s is not None for r in records)
    assert all(r.latency_s >= (r.ttft_s or 0) for r in records)


def test_sweep_writes_rows_and_plot(sim: SimFactory, tmp_path: Path) -> None:
    server = sim("--parallel", "4", "--speed", "50")
    out, png = tmp_path / "rows.json", tmp_path / "sweep.png"
    code = sweep_main([
        "--target", server.url, "--concurrency", "1,4", "--prompt-tokens", "512", "--max-tokens", "16",
        "--json", str(out), "--plot", str(png),
    ])
    assert code == 0
    rows = json.loads(out.read_text())
    assert [list(r) for r in rows] == [ROW_KEYS, ROW_KEYS]
    assert [r["concurrency"] for r in rows] == [1, 4]
    assert rows[0]["p50_ratio"] == 1.0
    assert all(r["throughput_tok_s"] > 0 and r["errors"] == 0 and r["rejected"] == 0 for r in rows)
    assert all(r["peak_pinned_gb"] is not None and r["state"] == "healthy" for r in rows)
    assert rows[1]["throughput_tok_s"] > rows[0]["throughput_tok_s"]  # batching
    assert png.stat().st_size > 0


def row(n: int, tok_s: float, pinned: float | None, state: str) -> Row:
    return Row(n, tok_s, 1.0, 1.0, 0.1, pinned, state, 0, 0)


def test_seed_table_verdict() -> None:
    good = [
        row(1, 80, 11.2, "healthy"), row(4, 200, 18.5, "healthy"), row(8, 230, 29.0, "near_ceiling"),
        row(12, 220, 40.0, "paging"), row(16, 75, 52.0, "collapsed"),
    ]
    assert all(c["ok"] for c in seed_table.compare(good))
    slow = [*good[:4], row(16, 90, 52.0, "collapsed")]  # +29% throughput at 16
    assert [c["ok"] for c in seed_table.compare(slow)] == [True, True, True, True, False]
    healthy_at_12 = [*good[:3], row(12, 220, 40.0, "near_ceiling"), good[4]]
    assert not seed_table.compare(healthy_at_12)[3]["ok"]
    fat = [row(1, 80, 13.0, "healthy"), *good[1:]]  # pinned +18%
    assert not seed_table.compare(fat)[0]["ok"]


def test_answer_lengths_spread_around_the_mean() -> None:
    make = chat_body(64, 100, spread=0.5)
    lengths = [make(0)["max_tokens"] for _ in range(200)]
    assert all(50 <= n <= 150 for n in lengths) and len(set(lengths)) > 20
    assert 90 < sum(lengths) / len(lengths) < 110
    assert {chat_body(64, 100)(0)["max_tokens"] for _ in range(5)} == {100}


def test_an_answer_after_refusals_is_timed_from_its_first_try() -> None:
    refused = [RequestRecord(0, 502, started, None, 0.01, 0) for started in (10.0, 10.5)]
    answered = RequestRecord(0, 200, 11.0, 0.2, 1.0, 8)
    first_try = None
    for record in refused:
        kept, first_try = retimed(record, first_try, (502, 503))
        assert kept is record  # a refusal keeps its own time (how fast a router refuses)
    assert first_try == 10.0
    timed, first_try = retimed(answered, first_try, (502, 503))
    assert (timed.started, timed.ttft_s, timed.latency_s, first_try) == (10.0, 1.2, 2.0, None)
    again = RequestRecord(0, 200, 13.0, 0.2, 1.0, 8)
    assert retimed(again, None, (502, 503)) == (again, None)  # answered at once: as measured
