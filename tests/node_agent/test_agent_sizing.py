"""Supervise mode sizes llama-server to the Mac when the operator gives no --parallel, and gives memory
back (fewer slots) when pressure persists."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import httpx
import psutil

from macpool.dev.procs import macpool_argv
from macpool.dev.redis_server import free_port
from node_agent.sizing import MAX_SLOTS, Sizing, choose, operator_cache_ram, prompt_cache, shrunk
from tests.conftest import SpawnFactory
from tests.node_agent.helpers import SIM_COMMAND, AgentFactory, read_node, status, wait_until, write_gguf
from tests.node_agent.test_agent_supervise import one_liner

KV_14B = 48 * 8 * 128 * 2 * 2  # bytes per token of a 14B GQA model's f16 KV cache (196,608)


def _choose(**overrides: Any) -> Sizing:
    figures: dict[str, Any] = {
        "parallel": None, "ctx_per_slot": 4096, "wired_limit_gb": 36.0, "weights_gb": 8.0, "headroom_gb": 2.0,
        "kv_bytes_per_token": KV_14B, "calibrated_cap": None, **overrides,
    }
    return choose(**figures)


def test_the_slots_that_fit_bounded_by_the_calibrated_cap() -> None:
    fits = _choose(wired_limit_gb=12.0)  # (12 - 8 - 2) GB / 0.805 GB a slot (4,096 x 196,608 bytes)
    assert (fits.parallel, fits.chosen_by, fits.fits) == (2, "memory", 2)
    assert "wired limit 12.0 GB - weights 8.0 GB - headroom 2.0 GB" in fits.reason
    roomy = _choose()
    assert (roomy.parallel, roomy.chosen_by) == (MAX_SLOTS, "memory")
    capped = _choose(calibrated_cap=6)
    assert (capped.parallel, capped.chosen_by) == (6, "calibrated")
    given = _choose(parallel=3, calibrated_cap=2)
    assert (given.parallel, given.chosen_by) == (3, "operator")
    blind = _choose(wired_limit_gb=None, calibrated_cap=2)
    assert (blind.parallel, blind.chosen_by) == (2, "default")
    assert _choose(kv_bytes_per_token=None).parallel == 4
    tight = _choose(wired_limit_gb=10.0)
    assert tight.parallel == 1 and "not even one slot fits" in tight.reason
    assert (tight.fits, given.fits) == (0, 32)  # the operator's slots are sized too: to say what fits


def test_the_context_is_the_models_at_most() -> None:
    trained = _choose(ctx_per_slot=32768, n_ctx_train=8192, wired_limit_gb=12.0)
    assert (trained.ctx_per_slot, trained.parallel) == (8192, 1)
    assert trained.reason.startswith("1 slots x 8192 tokens (the model's training context; --ctx-per-slot "
                                     "32768): 1 fit")


def test_a_mac_that_cannot_hold_one_request_says_what_to_change_and_does_not_start(tmp_path: Path) -> None:
    model = write_gguf(tmp_path / "m.gguf", layers=48, heads=40, kv_heads=8, embd=5120, context=131072)
    # a 14B-class KV cache at the default context, 32,768 tokens: 6.44 GB, where 8 - 2 GB are left
    line = one_liner("--llama-server", SIM_COMMAND, "--model", str(model), "--wired-limit-gb", "8",
                     "--headroom-gb", "2", "--redis-url", "redis://127.0.0.1:1/0")
    weights = model.stat().st_size / 1e9
    limit_mb = math.ceil((weights + 2 + 6.4425) * 1e9 / 2**20)
    assert line == (
        "macpool agent: error: this Mac cannot hold one request of 32768 tokens: its KV cache takes 6.44 GB, "
        f"and the wired limit 8.0 GB - weights {weights:.1f} GB - headroom 2.0 GB leaves 6.00 GB. Change "
        "one: a smaller --ctx-per-slot (29696 fits), a smaller model or quantization, or more wired memory "
        f"(at least 8.4 GB: sudo sysctl iogpu.wired_limit_mb={limit_mb})"
    )
    # the operator's slots do not make it fit either
    assert "cannot hold one request" in one_liner(
        "--llama-server", SIM_COMMAND, "--model", str(model), "--wired-limit-gb", "8", "--parallel", "2",
        "--redis-url", "redis://127.0.0.1:1/0")


def test_pressure_takes_a_quarter_of_the_slots_down_to_one() -> None:
    chain = []
    current: Sizing | None = _choose(calibrated_cap=8)
    while current is not None and (current := shrunk(current, 10)) is not None:
        chain.append(current.parallel)
        assert current.chosen_by == "pressure" and "memory pressure for 10 heartbeats" in current.reason
    assert chain == [6, 4, 3, 2, 1]


def test_the_prompt_cache_gets_the_ram_the_rest_leaves() -> None:
    # 2 slots x 4,096 tokens x 196,608 bytes = 1.61 GB of KV cache beside 8 GB of weights on a 64 GB Mac
    sized = prompt_cache(_choose(parallel=2), total_gb=64.0, weights_gb=8.0, kv_bytes_per_token=KV_14B,
                         headroom_gb=2.0, reserve_gb=8.0)
    spare = 64.0 - 8.0 - 2 * 4096 * KV_14B / 1e9 - 2.0 - 8.0
    assert sized.cache_ram_mib == math.floor(spare * 1e9 / 2**20) == 42333
    assert sized.cache_ram == ("42333 MiB (RAM 64.0 GB - weights 8.0 GB - KV cache 1.6 GB - headroom 2.0 GB"
                               " - host reserve 8.0 GB)")
    # more slots, less cache; and none at all when nothing is left (llama-server's default would page)
    assert prompt_cache(_choose(parallel=20), total_gb=64.0, weights_gb=8.0, kv_bytes_per_token=KV_14B,
                        headroom_gb=2.0, reserve_gb=8.0).cache_ram_mib == 28509
    bare = prompt_cache(_choose(parallel=2), total_gb=16.0, weights_gb=8.0, kv_bytes_per_token=KV_14B,
                        headroom_gb=2.0, reserve_gb=8.0)
    assert bare.cache_ram_mib == 0 and bare.cache_ram.endswith(": no memory to spare for it")
    # fewer slots under pressure keep it
    assert shrunk(sized, 10) is not None and shrunk(sized, 10).cache_ram_mib == 42333  # type: ignore[union-attr]


def test_the_operators_prompt_cache_is_theirs() -> None:
    assert operator_cache_ram(["-ngl", "99", "--cache-ram", "512"], {}) == "--cache-ram"
    assert operator_cache_ram(["-cram=0"], {}) == "-cram"
    assert operator_cache_ram([], {"LLAMA_ARG_CACHE_RAM": "4096"}) == "LLAMA_ARG_CACHE_RAM"
    assert operator_cache_ram(["--cache-reuse", "256"], {"LLAMA_ARG_CACHE_RAM": ""}) is None


def test_supervise_sizes_the_prompt_cache_unless_the_operator_did(
    agent: AgentFactory, spawn: SpawnFactory, redis_url: str, tmp_path: Path
) -> None:
    model = write_gguf(tmp_path / "model-14b-q4.gguf", layers=48, heads=40, kv_heads=8, embd=5120)
    gateway = agent("--llama-server", SIM_COMMAND, "--model", str(model), "--ctx-per-slot", "4096",
                    "--parallel", "2", "--host-reserve-gb", "1")
    shown = status(gateway.url)
    spare = (psutil.virtual_memory().total / 1e9 - model.stat().st_size / 1e9 - 2 * 4096 * KV_14B / 1e9
             - 2.0 - 1.0)
    expected = max(0, math.floor(spare * 1e9 / 2**20))
    assert shown["sizing"]["cache_ram_mib"] == expected
    argv = shown["llama_server"]["argv"]
    assert argv[argv.index("--cache-ram") + 1] == str(expected)
    assert f"llama-server's prompt cache (--cache-ram): {expected} MiB (RAM " in Path(
        str(gateway.log_path)).read_text()

    port = free_port()  # given here: the `agent` fixture's --port would land after `--`
    theirs = spawn(argv=macpool_argv(
        "agent", "run", "--redis-url", redis_url, "--node-id", "n2", "--port", str(port), "--llama-server",
        SIM_COMMAND, "--model", str(model), "--ctx-per-slot", "4096", "--parallel", "2", "--", "-cram", "512",
    ), port=port, name="agent-n2")
    shown = status(theirs.url)
    assert shown["sizing"]["cache_ram_mib"] is None
    assert shown["sizing"]["cache_ram"] == "the operator's (-cram)"
    argv = shown["llama_server"]["argv"]
    assert "--cache-ram" not in argv and argv[argv.index("-cram") + 1] == "512"


def test_supervise_sizes_llama_server_then_restarts_it_smaller_under_pressure(
    agent: AgentFactory, redis_url: str, tmp_path: Path
) -> None:
    model = write_gguf(tmp_path / "model-14b-q4.gguf", layers=48, heads=40, kv_heads=8, embd=5120)
    # (8 GB - 2 GB headroom) / 0.805 GB a slot at 4,096 tokens -> 7 slots
    gateway = agent("--llama-server", SIM_COMMAND, "--model", str(model), "--ctx-per-slot", "4096",
                    "--wired-limit-gb", "8", "--headroom-gb", "2", "--shrink-after-beats", "3")
    doc = wait_until(lambda: (d := read_node(redis_url, "n1")) and d.state == "ready" and d, what="ready")
    assert doc.total_slots == 7 and doc.sizing.startswith("7 slots x 4096 tokens: 7 fit")
    shown = status(gateway.url)
    assert shown["sizing"]["parallel"] == 7 and shown["sizing"]["chosen_by"] == "memory"
    argv = shown["llama_server"]["argv"]
    assert argv[argv.index("--parallel") + 1] == "7" and argv[argv.index("--ctx-size") + 1] == str(7 * 4096)

    # another app takes the pool: the simulated Mac pages until llama-server gives memory back
    llama = shown["llama_server"]["url"]
    httpx.post(llama + "/sim/pressure", json={"external_gb": 40}, timeout=5).raise_for_status()
    doc = wait_until(lambda: (d := read_node(redis_url, "n1")) and d.state == "ready" and d.total_slots == 5
                     and d, what="llama-server back with fewer slots", timeout=60)
    assert doc.sizing.startswith("5 slots x 4096 tokens: memory pressure for 3 heartbeats with 7")
    shown = status(gateway.url)
    assert (shown["sizing"]["parallel"], shown["sizing"]["chosen_by"]) == (5, "pressure")
    log = Path(str(gateway.log_path)).read_text()
    assert "memory pressure for 3 heartbeats: restarting llama-server with 5 slots (was 7)" in log
    assert "llama-server sized: 7 slots" in log
