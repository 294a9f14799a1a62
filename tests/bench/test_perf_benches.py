"""Smoke tests of the performance benches: tiny parameters, real processes, JSON keys and sane values.

No timing targets here (the machine is shared): speed is what the bench commands themselves report.
"""

from __future__ import annotations

import asyncio
import itertools
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from macpool.bench.loadclient import Rec, closed_loop
from macpool.bench.stats import take_turns
from macpool.bench.wire import Post
from tests.bench.conftest import run_bench

pytestmark = pytest.mark.timeout(600)


def positive(value: Any) -> bool:
    return isinstance(value, int | float) and value > 0


def test_relay(tmp_path: Path) -> None:
    data = run_bench(
        tmp_path, "relay", "--streams", "8", "--concurrency", "4", "--warmup", "0.5", "--duration", "1"
    )
    for key in ("chunks_per_s", "requests_per_s", "cpu_s_per_1000"):
        assert positive(data[key]), (key, data)
    assert data["streaming"]["chunks"] > 0
    assert data["non_streaming"]["errors"] == 0


def test_reject(tmp_path: Path) -> None:
    data = run_bench(tmp_path, "reject", "--concurrency", "4", "--warmup", "0.5", "--duration", "1")
    assert positive(data["rejections_per_s"])
    assert positive(data["reject_p99_ms"])
    measured = data["measured"]
    assert measured["rejected_503"] > 0 and measured["other_status"] == 0
    assert measured["retry_after_fraction"] == 1.0
    assert set(measured["reasons"]) == {"pool_full"}


@pytest.mark.skipif(shutil.which("wrk") is None, reason="wrk not installed (apt-get install wrk)")
def test_reject_with_wrk(tmp_path: Path) -> None:
    data = run_bench(tmp_path, "reject", "--client", "wrk", "--concurrency", "4", "--warmup", "1",
                     "--duration", "1")
    measured = data["measured"]
    assert measured["client"] == "wrk"
    assert measured["rejected_503"] > 0 and measured["other_status"] == 0 and measured["socket_errors"] == 0
    assert measured["retry_after_fraction"] == 1.0
    assert positive(data["rejections_per_s"]) and positive(data["reject_p99_ms"])


def test_paths_take_turns_in_alternating_order() -> None:
    calls: list[str] = []
    turns = take_turns(["a", "b", "c"], 3, lambda name: calls.append(name) or len(calls))
    assert calls == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]
    assert turns[1] == {"c": 4, "b": 5, "a": 6}
    assert take_turns(["a"], 0, lambda name: name) == [{"a": "a"}]  # at least one round


def test_overhead(tmp_path: Path) -> None:
    data = run_bench(tmp_path, "overhead", "--levels", "1,4", "--duration", "1", "--warmup", "0.3",
                     "--rounds", "2")
    assert set(data["levels"]) == {"1", "4"}
    for row in data["levels"].values():
        for path in ("direct", "routed", "router_only"):
            assert row[path]["ok"] > 0 and row[path]["errors"] == 0, row
        assert len(row["rounds_ttft_added_p50_ms"]) == 2, row  # the paths took turns twice
        assert isinstance(row["ttft_added_p50_ms"], float)
        assert isinstance(row["ttft_added_p99_ms"], float)
        assert positive(row["routed"]["router_cpu_ms_per_request"])


def test_overhead_paced(tmp_path: Path) -> None:
    """Streams at a Mac's pace from the fast upstream; the target is judged on the simulator run only."""
    data = run_bench(tmp_path, "overhead", "--upstream", "paced", "--levels", "4", "--max-tokens", "5",
                     "--interval-ms", "10", "--duration", "1", "--warmup", "0.2", "--no-router-only")
    assert data["upstream"] == "paced" and data["interval_ms"] == 10.0
    assert data["target_met"] is None and isinstance(data["within_target_figures"], bool)
    row = data["levels"]["4"]
    for path in ("direct", "routed"):
        assert row[path]["ok"] > 0 and row[path]["errors"] == 0, row
        # five events 10 ms apart: a stream lasts at least 40 ms whichever way it went
        assert row[path]["latency_p50_ms"] >= 40.0, row
    assert isinstance(row["ttft_added_p50_ms"], float)


def test_overload(tmp_path: Path) -> None:
    """The 2-Mac pool at 1x and 2x its capacity, no queue: admitted streams complete, the rest get 503s."""
    figure = tmp_path / "overload.png"
    data = run_bench(tmp_path, "overload", "--levels", "1,2", "--cap", "2", "--queue-size", "0",
                     "--duration", "20", "--speed", "20", "--prompt-tokens", "256", "--max-tokens", "16",
                     "--plot", str(figure))
    names = ["router 1x", "direct 1x", "router 2x", "direct 2x", "knee (1 node)"]
    assert [run["name"] for run in data["runs"]] == names
    assert [run["clients"] for run in data["runs"]] == [4, 4, 8, 8, 2]
    assert [level["level"] for level in data["levels"]] == [1.0, 2.0]
    for level in data["levels"]:
        assert level["completed"] > 0 and level["errors_non_503"] == 0
        assert positive(level["goodput_tok_s"]) and positive(level["goodput_ratio"])
        assert 0 < level["admitted_ttft_p50_s"] <= level["admitted_ttft_p99_s"]
        assert 0 < level["admitted_latency_p50_s"] <= level["admitted_latency_p99_s"]
    over = data["levels"][1]
    assert over["rejected_503"] > 0 and over["retry_after_present"] == 1.0
    assert 0 < over["reject_p50_ms"] <= over["reject_p99_ms"]
    assert set(over["reasons"]) == {"pool_full"}  # no queue: every refusal is immediate
    assert over["reasons"]["pool_full"]["count"] == over["rejected_503"]
    # the top-level figures are the highest level's
    assert data["goodput_tok_s"] == over["goodput_tok_s"] and data["rejected_503"] == over["rejected_503"]
    for run in data["runs"]:
        if run["name"].startswith("direct"):
            assert run["rejected_503"] == 0 and run["completed"] > 0  # nothing in front of the Macs refuses
    assert positive(data["knee_tok_s"])
    assert figure.read_bytes().startswith(b"\x89PNG")


def test_overload_takes_an_exact_client_count(tmp_path: Path) -> None:
    data = run_bench(tmp_path, "overload", "--clients", "3", "--cap", "1", "--no-direct", "--duration", "10",
                     "--speed", "20", "--prompt-tokens", "256", "--max-tokens", "16")
    assert [run["name"] for run in data["runs"]] == ["router 1.5x", "knee (1 node)"]
    assert data["levels"][0]["clients"] == 3 and data["levels"][0]["direct_tok_s"] is None


def test_scale(tmp_path: Path) -> None:
    data = run_bench(
        tmp_path,
        "scale",
        "--nodes",
        "5",
        "--capacity",
        "2",
        "--events",
        "4",
        "--interval-ms",
        "20",
        "--duration",
        "2",
        "--decisions",
        "50",
    )
    assert data["no_over_admission"] is True and data["over_admission"] == 0
    assert data["overload_phase"]["max_in_flight_per_node"] <= 2
    assert data["admitted_phase"]["admitted"] > 0
    # a count, not a timing: each admitted request is one reserve and one release EVALSHA (Lua's own commands,
    # named from the scripts, are not round trips)
    assert 1.9 <= data["redis_round_trips_per_admitted"] <= 2.1
    assert data["admitted_phase"]["redis_commands_per_admitted"]["evalsha"] == pytest.approx(2.0, abs=0.1)
    assert data["routing_decision"]["candidates"] == 5
    assert positive(data["routing_decision"]["decision_p50_ms"])


def test_load_clients_keep_their_connections() -> None:
    """The bench clients reuse one keep-alive connection each (a new connection per request would add a
    TCP handshake and an accept to every measured request), and open a new one when the server closes."""
    accepted: list[int] = []

    async def main() -> list[Rec]:
        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            accepted.append(1)
            served = 0
            while await reader.readuntil(b"\r\n\r\n"):
                await reader.readexactly(2)  # the body: "{}"
                served += 1
                close = served == 5  # every fifth answer ends the connection
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n"
                             + (b"connection: close\r\n" if close else b"") + b"\r\nok")
                await writer.drain()
                if close:
                    writer.close()
                    return

        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            return await closed_loop(port, lambda _: Post("/", b"{}"), 2, requests=40)

    records = asyncio.run(main())
    assert [r.status for r in records] == [200] * 40
    assert len(accepted) == 8  # 40 requests, 5 per connection


def test_load_clients_can_start_staggered() -> None:
    """With ``stagger_s`` the connections' first requests are spread over that time, not sent at once (paced
    streams of equal length started together would keep arriving as one burst)."""
    arrivals: list[float] = []

    async def main(stagger: float) -> None:
        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            await reader.readexactly(2)
            arrivals.append(time.perf_counter())
            await asyncio.sleep(1.0)  # a long answer: each connection sends one request of the four
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            await closed_loop(port, lambda _: Post("/", b"{}"), 4, requests=4, stagger_s=stagger)

    asyncio.run(main(0.0))
    assert max(arrivals) - min(arrivals) < 0.15
    arrivals.clear()
    asyncio.run(main(0.8))
    gaps = [b - a for a, b in itertools.pairwise(sorted(arrivals))]
    assert len(gaps) == 3 and all(gap >= 0.15 for gap in gaps), gaps  # 0.2 s apart


def test_a_bench_stopped_with_sigterm_stops_what_it_started() -> None:
    """A timeout or a cancelled job sends SIGTERM: the bench's Redis, simulator, agent and router go too."""
    bench = subprocess.Popen([sys.executable, "-m", "macpool.cli", "bench", "overhead", "--levels", "1",
                              "--duration", "120", "--no-router-only"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        parent = psutil.Process(bench.pid)
        deadline = time.monotonic() + 60
        started: list[psutil.Process] = []
        while time.monotonic() < deadline and len(started) < 4:  # Redis, simulator, agent, router
            time.sleep(0.5)
            started = parent.children(recursive=True)
        assert len(started) >= 4, started
        time.sleep(2)  # into the measurement
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=60) != 0
        _, alive = psutil.wait_procs(started, timeout=15)
        assert not alive, [p.cmdline() for p in alive]
    finally:
        if bench.poll() is None:
            bench.kill()
