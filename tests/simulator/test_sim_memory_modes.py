"""Memory as llama-server really allocates it (``kv_at_start``): flat under load, the cliff at start."""

from __future__ import annotations

import subprocess

import httpx

from macpool.dev.procs import macpool_argv
from macpool.sim.engine import Engine, Task, closed_loop
from macpool.sim.machine import MemoryState, load_preset
from tests.conftest import Server, SpawnFactory


def _busy(engine: Engine, n: int, prompt_tokens: int = 1024) -> None:
    for i in range(n):
        engine.submit(Task(prompt=f"{i} " + "x" * 4 * prompt_tokens, n_prompt=prompt_tokens, n_predict=64))
    for _ in range(40):
        engine.step()


def test_kv_at_start_is_flat_under_load_and_the_working_set_grows() -> None:
    real = load_preset("m4pro-48g-14b-q4")
    engine = Engine(real, n_slots=8, n_ctx_slot=8192)
    idle = engine.pinned_gb()
    assert idle == real.weights_gb + real.base_gb + 8 * 8192 * real.kv_mb_per_token / 1024
    _busy(engine, 8)
    assert len(engine.running) == 8 and engine.pinned_gb() == idle

    seed = load_preset("m5max-128g-14b-q4")
    growing = Engine(seed, n_slots=8, n_ctx_slot=8192)
    idle = growing.pinned_gb()
    _busy(growing, 8)
    assert growing.pinned_gb() > idle + 8 * seed.seq_overhead_gb


def test_a_start_past_the_wired_limit_pages_from_the_first_request() -> None:
    ultra = load_preset("m3ultra-192g-70b-q4")
    fits = Engine(ultra, n_slots=4, n_ctx_slot=8192)
    over = Engine(ultra, n_slots=16, n_ctx_slot=32768)  # 160 GB of KV cache on top of 41 GB
    assert ultra.state(fits.pinned_gb()) == MemoryState.HEALTHY
    assert ultra.state(over.pinned_gb()) in (MemoryState.PAGING, MemoryState.COLLAPSED)
    _busy(fits, 1)
    _busy(over, 1)
    assert over.sim_time > 2 * fits.sim_time  # the same single request, slowed by paging
    assert over.counters.worst_state != MemoryState.HEALTHY.value


def test_throughput_plateaus_early_while_p50_keeps_climbing() -> None:
    # a 70B model whose prompt processing dominates: past a few requests, only latency grows
    ultra = load_preset("m3ultra-192g-70b-q4")
    runs = {c: closed_loop(ultra, c, 4096, 128, requests_per_client=3, n_ctx_slot=8192) for c in (1, 3, 6, 9)}
    assert runs[6].throughput_tok_s < 1.1 * runs[3].throughput_tok_s
    assert runs[9].throughput_tok_s < 1.05 * runs[6].throughput_tok_s
    assert runs[3].throughput_tok_s > 1.2 * runs[1].throughput_tok_s
    rise = [runs[c].p50_latency_s for c in (3, 6, 9)]
    assert rise[2] - rise[1] > 0.8 * (rise[1] - rise[0]) > 0  # about a straight line
    assert {r.state for r in runs.values()} == {"healthy"}


def test_a_start_that_does_not_fit_fails_to_load_like_llama_server() -> None:
    # 16 slots x 16K context x 0.1875 MB = 48 GB of KV cache: past the M4 Pro's 36 GB wired limit
    done = subprocess.run(
        macpool_argv("sim", "--preset", "m4pro-48g-14b-q4", "-np", "16", "-c", "262144", "--port", "0"),
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert "failed to allocate buffer for kv cache" in done.stderr
    assert lines[-1] == "main: exiting due to model loading error"
    assert "Traceback" not in done.stderr


def test_the_memory_endpoint_reports_the_start_allocation(sim: SpawnFactory) -> None:
    server: Server = sim("--parallel", "4", "-c", "32768", "--speed", "50", preset="m4pro-48g-14b-q4")
    memory = httpx.get(server.url + "/sim/memory", timeout=5).json()
    assert memory["kv_cache_gb"] == 4 * 8192 * 0.1875 / 1024
    assert memory["per_request_gb"] == 8192 * 0.1875 / 1024  # one more slot, as the agent estimates it
    assert memory["pinned_gb"] == round(8.4 + 0.5 + memory["kv_cache_gb"], 3)
    body = {"prompt": "hello " * 200, "max_tokens": 32}
    assert httpx.post(server.url + "/v1/completions", json=body, timeout=30).status_code == 200
    assert httpx.get(server.url + "/sim/stats", timeout=5).json()["peak_pinned_gb"] == memory["pinned_gb"]
