"""The simulator on a real socket: /sim endpoints, the prompt cache, cancellation, speed, loading, the CLI."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

import macpool.sim
from macpool.dev.procs import macpool_argv
from macpool.sim.cli import UsageError, parse_settings
from macpool.sim.machine import load_preset
from tests.conftest import Server
from tests.inprocess import LocalStack

SimFactory = Callable[..., Server]
MEMORY_KEYS = {
    "total_gb", "wired_limit_gb", "weights_gb", "pinned_gb", "per_request_gb", "state", "external_gb",
    "swap_used_gb", "pressure", "kv_cache_gb", "kv_unified", "kv_cells", "kv_cells_used", "prompt_cache_gb",
}
STATS_KEYS = {
    "processing", "deferred", "max_concurrent", "completed", "cancelled", "speed", "sim_time_s",
    "busy_time_s", "tokens_predicted_total",
}


def poll(probe: Callable[[], bool], within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if probe():
            return True
        time.sleep(0.02)
    return False


def chat(url: str, text: str, **extra: Any) -> dict[str, Any]:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 4, **extra}
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    data: dict[str, Any] = response.json()
    return data


@pytest.mark.in_process
def test_memory_pressure_and_stats(sim: SimFactory) -> None:
    server = sim("--parallel", "4", "--speed", "50")
    memory = httpx.get(server.url + "/sim/memory").json()
    assert set(memory) == MEMORY_KEYS
    assert memory["state"] == "healthy" and memory["pressure"] == "normal"
    assert memory["pinned_gb"] > memory["weights_gb"]
    headroom = memory["wired_limit_gb"] - memory["pinned_gb"]

    squeezed = httpx.post(server.url + "/sim/pressure", json={"external_gb": headroom + 1}).json()
    assert squeezed["state"] == "paging" and squeezed["pressure"] == "critical"
    assert squeezed["swap_used_gb"] > 0
    cleared = httpx.post(server.url + "/sim/pressure", json={"external_gb": 0}).json()
    assert cleared["pinned_gb"] == memory["pinned_gb"] and cleared["state"] == "healthy"
    assert httpx.post(server.url + "/sim/pressure", json={"external_gb": -1}).status_code == 400

    chat(server.url, "hello")
    stats = httpx.get(server.url + "/sim/stats").json()
    assert set(stats) >= STATS_KEYS
    assert stats["completed"] == 1 and stats["max_concurrent"] == 1 and stats["tokens_predicted_total"] == 4
    reset = httpx.post(server.url + "/sim/reset").json()
    assert reset["completed"] == 0 and reset["max_concurrent"] == 0


@pytest.mark.in_process
def test_prompt_cache_hit_is_reported(sim: SimFactory) -> None:
    server = sim("--parallel", "2", "--speed", "50", "--metrics")
    text = "A long shared system prompt for the cache. " * 30
    first = chat(server.url, text)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    second = chat(server.url, text)
    n_prompt = second["usage"]["prompt_tokens"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == n_prompt - 1
    assert second["timings"]["cache_n"] == n_prompt - 1 and second["timings"]["prompt_n"] == 1
    metrics = httpx.get(server.url + "/metrics").text
    assert f"llamacpp:prompt_tokens_cached_total {n_prompt - 1}" in metrics


@pytest.mark.in_process
def test_disconnect_cancels_the_task(sim: SimFactory) -> None:
    server = sim("--parallel", "1", "--speed", "1")
    body = {"prompt": "a story", "n_predict": 5000, "stream": True}
    with httpx.stream("POST", server.url + "/completion", json=body, timeout=60) as response:
        for _ in response.iter_bytes():
            break

    def cancelled() -> bool:
        stats = httpx.get(server.url + "/sim/stats").json()
        return bool(stats["cancelled"] == 1 and stats["processing"] == 0)

    assert poll(cancelled)
    assert not any(s["is_processing"] for s in httpx.get(server.url + "/slots").json())


@pytest.mark.in_process
def test_a_waiting_child_holds_no_tokens_in_its_slot(sim: SimFactory) -> None:
    # llama-server's /slots n_prompt_tokens counts the tokens a slot holds: none for a child (n > 1) while
    # its parent prefills the prompt
    server = sim("--parallel", "2", "--speed", "1")
    body = {"prompt": "p" * 4 * 6000, "n_predict": 1, "n": 2}  # 2 s of prefill
    held: list[list[int]] = []

    def prefilling() -> bool:
        busy = [s for s in httpx.get(server.url + "/slots").json() if s["is_processing"]]
        # the child's slot (0, the lowest other one), then the parent's (1, the last of the unused)
        held.append([s["n_prompt_tokens"] for s in busy])
        return len(busy) == 2 and busy[1]["n_prompt_tokens"] > 0

    with ThreadPoolExecutor(1) as pool:
        answers = pool.submit(httpx.post, server.url + "/completion", json=body, timeout=60)
        assert poll(prefilling), held
        assert held[-1][0] == 0
        assert answers.result().status_code == 200


@pytest.mark.in_process
def test_speed_compresses_time(sim: SimFactory) -> None:
    server = sim("--parallel", "1", "--speed", "50")
    start_wall = time.monotonic()
    result = chat(server.url, "go", max_tokens=3000)  # ~33 simulated seconds
    wall_ms = (time.monotonic() - start_wall) * 1000
    simulated_ms = result["timings"]["prompt_ms"] + result["timings"]["predicted_ms"]
    assert simulated_ms > 5 * wall_ms  # 50x nominal; generous for a loaded machine


@pytest.mark.in_process
def test_metrics_may_keep_the_wall_clock(sim: SimFactory) -> None:
    # agents time first tokens and decode on the wall clock: in front of a simulator at 10x, its prompt
    # seconds must be wall seconds too, or a prompt would weigh ten times what it does on a Mac
    def seconds(server: Server) -> tuple[float, float]:
        result = chat(server.url, "a prompt to process " * 200, max_tokens=50)
        simulated = result["timings"]["prompt_ms"] / 1000
        lines = httpx.get(server.url + "/metrics", timeout=10).text.splitlines()
        reported = next(float(line.split()[1]) for line in lines
                        if line.startswith("llamacpp:prompt_seconds_total "))
        return simulated, reported

    simulated, reported = seconds(sim("--parallel", "1", "--speed", "10", "--metrics", name="simulated"))
    assert reported == pytest.approx(simulated, rel=1e-3)
    wall = sim("--parallel", "1", "--speed", "10", "--metrics", "--metrics-clock", "wall", name="wall")
    simulated, reported = seconds(wall)
    assert reported == pytest.approx(simulated / 10, rel=1e-3)


def test_loading_then_ready(local_stack: LocalStack) -> None:
    server = local_stack.sim("sim", "--preset", "m2pro-32g-8b-q4", "--load-seconds", "1.5", ready=None)

    def answering() -> bool:
        try:
            return httpx.get(server.url + "/health").status_code in (200, 503)
        except httpx.HTTPError:
            return False

    assert poll(answering)
    loading = httpx.get(server.url + "/health")
    if loading.status_code == 503:  # unless the machine was too slow to see it
        error = {"message": "Loading model", "type": "unavailable_error", "code": 503}
        assert loading.json() == {"error": error}
    assert poll(lambda: httpx.get(server.url + "/health").status_code == 200)


@pytest.mark.in_process
def test_llama_server_flags_and_model_name(sim: SimFactory) -> None:
    server = sim(
        "--host", "127.0.0.1", "-np", "3", "-c", "6000", "--metrics", "-m", "/models/qwen-14b-q4.gguf",
        "--no-webui", "--cont-batching", "-t", "4", "-ngl", "99", "--jinja", "-fa", "on",
        preset="m5max-128g-14b-q4",
    )
    props = httpx.get(server.url + "/props").json()
    assert props["total_slots"] == 3 and props["default_generation_settings"]["n_ctx"] == 2000
    assert props["model_path"] == "/models/qwen-14b-q4.gguf"
    assert props["build_info"].startswith("sim-")
    assert httpx.get(server.url + "/v1/models").json()["data"][0]["id"] == "qwen-14b-q4.gguf"


@pytest.mark.in_process
def test_default_context_is_the_presets_per_slot(sim: SimFactory) -> None:
    server = sim("--parallel", "2", preset="m4max-64g-32b-q4")
    slots = httpx.get(server.url + "/slots").json()
    assert [s["n_ctx"] for s in slots] == [8192, 8192]
    assert httpx.get(server.url + "/metrics").status_code == 501  # like llama-server without --metrics


@pytest.mark.in_process
def test_embeddings_and_cors_preflight(sim: SimFactory) -> None:
    server = sim("--speed", "50")
    preflight = httpx.options(server.url + "/v1/chat/completions")
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-methods"] == "GET, POST"
    body = {"input": ["one", "two"]}
    first = httpx.post(server.url + "/v1/embeddings", json=body).json()
    second = httpx.post(server.url + "/v1/embeddings", json=body).json()
    assert first["data"] == second["data"] and len(first["data"]) == 2
    assert first["data"][0]["embedding"] != first["data"][1]["embedding"]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(macpool_argv("sim", *args), capture_output=True, text=True, timeout=60)


def test_bad_flags_exit_2_with_one_line() -> None:
    for args in (["--preset", "nope"], ["--speed", "0"], ["--bogus"], ["--parallel", "x"]):
        result = run_cli(*args)
        assert result.returncode == 2, args
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert "Traceback" not in result.stderr


def test_a_bad_value_is_named_where_it_was_given(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(UsageError, match=r"^--load-seconds=-1\.0: "):
        parse_settings(["--load-seconds", "-1"])
    monkeypatch.setenv("MACPOOL_SIM_SPEED", "0")
    with pytest.raises(UsageError, match=r"^MACPOOL_SIM_SPEED='0': "):
        parse_settings([])


@pytest.mark.in_process
def test_environment_fills_the_flags_not_given(sim: SimFactory) -> None:
    env = {"MACPOOL_SIM_SPEED": "40", "MACPOOL_SIM_METRICS": "true", "MACPOOL_SIM_PARALLEL": "3"}
    server = sim("--parallel", "2", env=env)  # a flag still wins over the environment
    assert httpx.get(server.url + "/sim/stats").json()["speed"] == 40.0
    assert httpx.get(server.url + "/metrics").status_code == 200
    assert len(httpx.get(server.url + "/slots").json()) == 2


def test_every_flag_has_its_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """`MACPOOL_SIM_<FLAG>`, as the docs say: `--machine` is `MACPOOL_SIM_MACHINE`."""
    preset = Path(macpool.sim.__file__).parent / "presets" / "m2pro-32g-8b-q4.json"
    monkeypatch.setenv("MACPOOL_SIM_MACHINE", str(preset))
    monkeypatch.setenv("MACPOOL_SIM_CTX_SIZE", "4096")
    monkeypatch.setenv("MACPOOL_SIM_LOAD_SECONDS", "0.5")
    settings, _ = parse_settings([])
    assert settings.load_machine().name == load_preset("m2pro-32g-8b-q4").name
    assert (settings.ctx_size, settings.load_seconds) == (4096, 0.5)


def test_a_machine_flag_wins_over_the_other_ones_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """--preset and --machine are one choice: a flag naming one beats the other's variable."""
    machine = Path(macpool.sim.__file__).parent / "presets" / "m2pro-32g-8b-q4.json"
    monkeypatch.setenv("MACPOOL_SIM_PRESET", "m4max-64g-32b-q4")
    settings, _ = parse_settings(["--machine", str(machine)])
    assert settings.load_machine().name == load_preset(machine.stem).name
    monkeypatch.delenv("MACPOOL_SIM_PRESET")
    monkeypatch.setenv("MACPOOL_SIM_MACHINE", str(machine))
    settings, _ = parse_settings(["--preset", "m4max-64g-32b-q4"])
    assert settings.load_machine().name == load_preset("m4max-64g-32b-q4").name
