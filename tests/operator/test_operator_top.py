"""``macpool top --once`` renders a real pool."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable

import pytest

from macpool.dev.procs import macpool_argv
from tests.operator.helpers import Pool


@pytest.mark.in_process
def test_top_once_renders_every_node_and_the_totals(pool: Callable[..., Pool]) -> None:
    running = pool(nodes=2)
    result = subprocess.run(
        macpool_argv("top", "--router", running.router.url, "--once"),
        capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr
    # a pipe, not a terminal: the figures stay on their labels' lines
    assert re.search(r"503/s[ \t]+\d", result.stdout), result.stdout
    for node_id in running.agents:
        assert node_id in result.stdout
    capacity = running.view()["pool"]["capacity"]  # type: ignore[index]
    assert f"capacity {capacity} " in result.stdout
    assert "503/s" in result.stdout
    assert "healthy" in result.stdout


def test_top_once_says_what_is_wrong_when_the_router_is_not_there() -> None:
    result = subprocess.run(
        macpool_argv("top", "--router", "http://127.0.0.1:9", "--once"),
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 1
    assert "cannot read http://127.0.0.1:9/api/pool" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_node_that_left_shows_as_gone_for_a_while() -> None:
    from router.top import GONE_KEEP_S, TopView

    def view(*ids: str) -> dict[str, object]:
        return {"pool": {}, "nodes": [{"node_id": i, "state": "ready", "capacity": 8} for i in ids]}

    top = TopView()
    assert [state for _, state in top.update(view("a", "b"), now=0)] == ["healthy", "healthy"]
    rows = top.update(view("a"), now=1)
    assert [(doc["node_id"], state) for doc, state in rows] == [("a", "healthy"), ("b", "gone")]
    assert [doc["node_id"] for doc, _ in top.update(view("a"), now=2 + GONE_KEEP_S)] == ["a"]


def test_top_shows_the_affinity_hit_rate_and_each_keys_queue() -> None:
    from rich.console import Console

    from router.top import TopView

    view = {"pool": {"capacity": 4}, "nodes": [], "affinity": {"enabled": True, "hit_rate": 0.75},
            "tenants": [{"tenant": "app", "in_flight": 3, "queued": {"interactive": 2, "batch": 0}},
                        {"tenant": "nightly", "in_flight": 1, "queued": {"interactive": 0, "batch": 5}}]}
    console = Console(width=200, record=True)
    console.print(TopView().render(view, "http://router", now=0))
    text = console.export_text()
    assert "affinity hits 75%" in text
    assert "app: 3 in flight, queued 2 interactive / 0 batch" in text
    assert "nightly: 1 in flight, queued 0 interactive / 5 batch" in text


def test_top_says_a_node_is_drained_and_does_not_make_up_memory_figures() -> None:
    from rich.console import Console

    from router.top import TopView

    nodes = [{"node_id": "mac-1", "state": "ready", "capacity": 8, "drained": True,
              "reason": "capacity 8 set by llama-server's 8 slots",
              "memory": {"pinned_gb": 20.0, "wired_limit_gb": 36.0},
              "model_states": [{"name": "qwen-14b", "state": "loaded", "memory_gb": 19.25}]},
             {"node_id": "mac-2", "state": "unhealthy", "capacity": 4,
              "reason": "llama-server is not reachable", "memory": {"pinned_gb": 0.0, "wired_limit_gb": 0.0}}]
    console = Console(width=200, record=True)
    console.print(TopView().render({"pool": {}, "nodes": nodes}, "http://router", now=0, width=200))
    lines = {line.split()[0]: line for line in console.export_text().splitlines() if line.startswith(" mac")
             or line.startswith("mac")}
    assert "drained through the admin API; capacity 8" in lines["mac-1"]
    assert "20.0/36" in lines["mac-1"]
    assert "qwen-14b loaded 19.2G" in lines["mac-1"]  # each model, and the memory it holds
    assert "0.0/0" not in lines["mac-2"]


def test_top_shows_the_kv_cells_each_node_holds() -> None:
    from rich.console import Console

    from router.top import TopView

    nodes = [{"node_id": "mac-1", "state": "ready", "capacity": 4, "kv_cells": 65536, "kv_cells_used": 24576,
              "kv_unified": True},
             {"node_id": "mac-2", "state": "ready", "capacity": 2, "kv_cells": 0}]
    console = Console(width=200, record=True)
    console.print(TopView().render({"pool": {}, "nodes": nodes}, "http://router", now=0, width=200))
    text = console.export_text()
    lines = {line.split()[0]: line for line in text.splitlines() if line.lstrip().startswith("mac")}
    assert "KV cells" in text
    assert "24K/64K shared" in lines["mac-1"]
    assert "shared" not in lines["mac-2"]


def test_top_shows_a_model_downloading_and_how_far() -> None:
    from rich.console import Console

    from router.top import TopView

    nodes = [{"node_id": "mac-1/qwen", "state": "downloading", "capacity": 0, "elastic": True,
              "reason": "downloading Qwen/Qwen3-8B-GGUF:Q4_K_M: 42% of 5.03 GB",
              "model_states": [{"name": "qwen", "state": "downloading",
                                "download": {"done_bytes": 2_112_600_000, "total_bytes": 5_030_000_000,
                                             "percent": 42.0}}]}]
    console = Console(width=220, record=True)
    console.print(TopView().render({"pool": {}, "nodes": nodes}, "http://router", now=0, width=220))
    line = next(line for line in console.export_text().splitlines() if "mac-1/qwen" in line)
    assert "downloading" in line.split("mac-1/qwen", 1)[1].split()[0]
    assert "qwen downloading 42% of 5.0G" in line
