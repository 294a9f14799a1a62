"""Several models on one Mac (node_agent/models.py): the memory budget's decisions, then one agent over a
simulated Mac in router mode behind a real router and Redis - idle models unloaded least recently used
first, never one with a request in flight, a load refused when busy models hold the memory, the Mac's
memory never over its wired limit, and load on demand picking the Mac where loading costs least."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from macpool.dev.stack import Proc, Stack
from macpool.sim.model_files import write_model_gguf
from macpool.store import Keys
from node_agent.models import PRESET_DIR_PREFIX, Budget, ModelSpec, Unit, preset_dir
from node_agent.runtime import Runtime
from node_agent.settings import AgentSettings
from node_agent.sizing import Sizing
from tests.blocking_store import sync_redis
from tests.node_agent.helpers import read_node, wait_until

MAC = "m2pro-32g-8b-q4"  # wired limit 21.3 GB
WIRED_LIMIT = 21.3
HEADROOM = 2.0  # budget 19.3 GB: two 9 GB models (weights + 2 slots of KV), not three
SLOW_SIM = f"{sys.executable} -m macpool.cli sim --preset {MAC} --speed 2"
# a streamed answer this long keeps its model busy for ~9 s: past every step a test takes meanwhile (a 2 s
# cold-start refusal, a load and an unload), even on a loaded machine
BUSY_TOKENS = 600


# --- the budget ---------------------------------------------------------------------------------------------

def unit(name: str, memory_gb: float, held: bool = False, in_flight: int = 0, last_busy: float = 0.0) -> Unit:
    settings = AgentSettings(upstream="http://127.0.0.1:1", node_id=f"mac/{name}")
    runtime = Runtime(settings)
    runtime.hold(in_flight)
    runtime.last_busy = last_busy
    spec = ModelSpec(name, Path(f"{name}.gguf"), Sizing(2, 4096, "operator", ""), memory_gb)
    return Unit(spec, settings, runtime, held=held)


def test_a_model_that_fits_beside_the_loaded_ones_unloads_nothing() -> None:
    a, b = unit("a", 8, held=True), unit("b", 8)
    assert Budget(19.3).plan(b, [a, b]) == []
    assert Budget(19.3).cost(b, [a, b]) == "free"


def test_idle_models_are_unloaded_least_recently_used_first_and_only_as_many_as_needed() -> None:
    old, recent, busy = unit("old", 6, True, last_busy=1), unit("recent", 6, True, last_busy=2), \
        unit("busy", 6, True, in_flight=1, last_busy=0)
    want = unit("new", 6)
    assert Budget(19.3).plan(want, [old, recent, busy, want]) == [old]
    assert Budget(19.3).cost(want, [old, recent, busy, want]) == "evict"
    big = unit("big", 12)
    assert Budget(19.3).plan(big, [old, recent, busy, big]) == [old, recent]


def test_a_model_that_fits_only_by_unloading_a_busy_one_is_refused() -> None:
    busy_a, busy_b = unit("a", 9, True, in_flight=1), unit("b", 9, True, in_flight=2)
    want = unit("c", 9)
    assert Budget(19.3).plan(want, [busy_a, busy_b, want]) is None
    assert Budget(19.3).cost(want, [busy_a, busy_b, want]) == "full"
    assert Budget(5).plan(unit("huge", 6), []) is None  # larger than the whole budget
    assert Budget(None).plan(unit("x", 1e6), []) == []  # no wired limit known: no bound


def test_the_preset_folders_of_agents_killed_with_9_are_removed_by_the_next_one() -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a process id no agent runs under any more
    left = Path(tempfile.gettempdir()) / f"{PRESET_DIR_PREFIX}{gone.pid}-x1"
    left.mkdir()
    (left / "models.ini").write_text("version = 1\n")
    folder = preset_dir()
    try:
        assert not left.exists()
        assert Path(folder.name).name.startswith(f"{PRESET_DIR_PREFIX}{os.getpid()}-")
        preset_dir().cleanup()  # another agent starting: the folder of this one, running, stays
        assert Path(folder.name).is_dir()
    finally:
        folder.cleanup()
        shutil.rmtree(left, ignore_errors=True)


# --- one agent, a simulated Mac ----------------------------------------------------------------------------

@dataclass
class Mac:
    agent: Proc
    node_id: str

    def status(self) -> dict[str, Any]:
        data: dict[str, Any] = httpx.get(self.agent.url + "/status", timeout=5).json()
        return data

    def memory(self) -> dict[str, Any]:
        sim = self.status()["llama_server"]["url"]
        data: dict[str, Any] = httpx.get(sim + "/sim/memory", timeout=5).json()
        return data

    def state(self, model: str) -> str:
        return str(self.status()["models"][model]["state"])


def model_files(folder: Path, names: str = "abc") -> str:
    """``--models`` for 9 GB models (7.5 GB of weights, 2 slots x 4096 tokens of KV)."""
    return ",".join(f"{n}={write_model_gguf(folder / f'{n}.gguf', weights_gb=7.5)}" for n in names)


def start_mac(stack: Stack, redis_url: str, node_id: str, models: str, *args: str) -> Mac:
    agent = stack.macpool(
        f"agent-{node_id}", "agent", "run", "--redis-url", redis_url, "--node-id", node_id,
        "--llama-server", SLOW_SIM, "--models", models, "--parallel", "2", "--ctx-per-slot", "4096",
        "--wired-limit-gb", str(WIRED_LIMIT), "--headroom-gb", str(HEADROOM), "--heartbeat-interval", "0.2",
        *args, ready="/status")
    mac = Mac(agent, node_id)
    wait_until(lambda: all(m["state"] == "standby" for m in mac.status()["models"].values()), what="standby")
    return mac


def start_router(stack: Stack, redis_url: str, timeout: str = "30") -> str:
    return stack.router("router", redis_url, "--cold-start-timeout", timeout, "--refresh-interval", "0.2").url


def load_cost(router: str, node_id: str) -> str | None:
    """``node_id``'s load cost as the router sees it (its pool view lags Redis by a refresh): what a test
    waits for before asking for a model, since that view is what the router decides on."""
    nodes = httpx.get(router + "/api/pool", timeout=10).json()["nodes"]
    return next((n.get("load_cost") for n in nodes if n["node_id"] == node_id), None)


def ask(router: str, model: str, max_tokens: int = 4, stream: bool = False) -> httpx.Response:
    return httpx.post(router + "/v1/chat/completions", timeout=120, json={
        "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens,
        "stream": stream})


class MemoryWatch:
    """Samples a Mac's pinned memory every 50 ms while the test runs: the highest seen, and its limit."""

    def __init__(self, mac: Mac) -> None:
        self.mac = mac
        self.peak = 0.0
        self.limit = WIRED_LIMIT
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                figures = self.mac.memory()
                self.peak, self.limit = max(self.peak, figures["pinned_gb"]), figures["wired_limit_gb"]
            except (httpx.HTTPError, KeyError):
                pass
            time.sleep(0.05)

    def __enter__(self) -> MemoryWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


@pytest.fixture
def mac_and_router(stack: Stack, redis_url: str, tmp_path: Path) -> Iterator[tuple[Mac, str]]:
    yield start_mac(stack, redis_url, "mac", model_files(tmp_path)), start_router(stack, redis_url)


def test_the_idle_model_is_unloaded_for_a_third_never_the_one_streaming(
        mac_and_router: tuple[Mac, str], redis_url: str) -> None:
    mac, router = mac_and_router
    with MemoryWatch(mac) as watch:
        assert ask(router, "a").status_code == 200
        assert ask(router, "b").status_code == 200  # a and b loaded: the budget is full
        with ThreadPoolExecutor(1) as pool:
            streaming = pool.submit(ask, router, "a", BUSY_TOKENS, True)
            wait_until(lambda: mac.status()["models"]["a"]["in_flight"] == 1, what="a streaming")
            assert ask(router, "b").status_code == 200  # b is now the most recently used, yet idle
            third = ask(router, "c")  # the least recently used model is a, but it is busy: b makes room
            assert third.status_code == 200, third.text
            assert mac.state("b") == "standby" and mac.state("a") == "ready"
            answer = streaming.result(timeout=120)
        assert answer.status_code == 200
        events = [line for line in answer.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and len(events) > 100  # not cut by the unload
    assert 0 < watch.peak <= watch.limit
    memory = mac.memory()["models"]
    assert {name: m["status"] for name, m in memory.items()} == {
        "a": "loaded", "b": "unloaded", "c": "loaded"}
    with sync_redis(redis_url) as store:  # b says it is in standby, so no router's word loads it again
        assert store.get(Keys().desired("mac/b")) == "standby"
    # a loaded model's KV cache is its preset's: 2 slots of 4096 tokens, each its own cells
    wait_until(lambda: (d := read_node(redis_url, "mac/a")) and (d.seq_ctx, d.kv_unified, d.kv_cells)
               == (4096, False, 8192), what="model a's KV cache in its heartbeat")


def test_a_model_is_not_loaded_while_busy_models_hold_the_memory(
        stack: Stack, redis_url: str, tmp_path: Path) -> None:
    mac = start_mac(stack, redis_url, "mac", model_files(tmp_path))
    router = start_router(stack, redis_url, timeout="2")
    assert ask(router, "a").status_code == 200
    assert ask(router, "b").status_code == 200
    with ThreadPoolExecutor(2) as pool:
        busy = [pool.submit(ask, router, model, BUSY_TOKENS, True) for model in ("a", "b")]
        wait_until(lambda: all(mac.status()["models"][m]["in_flight"] == 1 for m in "ab"), what="both busy")
        wait_until(lambda: load_cost(router, "mac/c") == "full", what="c's load cost: full")
        refused = ask(router, "c")  # no Mac can load it now: the router asks none, and says so in time
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] in ("cold_start", "model_loading")
        assert int(refused.headers["Retry-After"]) >= 1
        assert mac.state("c") == "standby"
        assert [f.result(timeout=120).status_code for f in busy] == [200, 200]
    assert mac.memory()["models"]["c"]["loads"] == 0
    # once they are done, c loads (one of them, idle, unloaded for it)
    wait_until(lambda: load_cost(router, "mac/c") == "evict", what="c's load cost: evict")
    assert ask(router, "c").status_code == 200


def test_load_on_demand_picks_the_mac_with_free_memory_over_one_that_must_unload(
        stack: Stack, redis_url: str, tmp_path: Path) -> None:
    files = model_files(tmp_path, "ab")
    # mac-1 has a loaded and room for one more 9 GB model... only after unloading a: its budget is one model
    mac1 = start_mac(stack, redis_url, "mac-1", files, "--wired-limit-gb", "12")
    mac2 = start_mac(stack, redis_url, "mac-2", files)
    router = start_router(stack, redis_url)
    with sync_redis(redis_url) as store:
        store.set(Keys().desired("mac-1/a"), "active")
    wait_until(lambda: mac1.state("a") == "ready", what="a loaded on mac-1")
    wait_until(lambda: load_cost(router, "mac-1/b") == "evict", what="mac-1 must unload a for b")
    wait_until(lambda: load_cost(router, "mac-2/b") == "free", what="mac-2 has room for b")
    assert ask(router, "b").status_code == 200
    assert mac2.state("b") == "ready" and mac1.state("b") == "standby" and mac1.state("a") == "ready"


def test_memory_pressure_that_lasts_unloads_the_least_recently_used_idle_model(
        stack: Stack, redis_url: str, tmp_path: Path) -> None:
    mac = start_mac(stack, redis_url, "mac", model_files(tmp_path, "ab"), "--shrink-after-beats", "3")
    router = start_router(stack, redis_url)
    assert ask(router, "a").status_code == 200
    assert ask(router, "b").status_code == 200  # 16.6 GB of models pinned: 21.1 with 4.5 more
    sim = mac.status()["llama_server"]["url"]
    httpx.post(sim + "/sim/pressure", json={"external_gb": 4.5}, timeout=5)  # another app: near the limit
    wait_until(lambda: mac.state("a") == "standby", 15, what="a, the least recently used, unloaded")
    time.sleep(1.5)  # pressure is gone with a: b stays
    assert mac.state("b") == "ready"
    assert mac.memory()["models"]["a"]["status"] == "unloaded"


def test_a_burst_for_a_cold_model_loads_it_once_across_macs(
        stack: Stack, redis_url: str, tmp_path: Path) -> None:
    files = model_files(tmp_path, "ab")
    macs = [start_mac(stack, redis_url, f"mac-{i}", files) for i in (1, 2)]
    router = start_router(stack, redis_url)
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda _: ask(router, "b"), range(6)))
    assert [a.status_code for a in answers] == [200] * 6, [a.text for a in answers]
    loads = [mac.memory()["models"]["b"]["loads"] for mac in macs]
    assert sorted(loads) == [0, 1], loads


def test_a_model_unloaded_when_idle_is_loaded_again_when_asked_before_the_first_ask_lapses(
        stack: Stack, redis_url: str, tmp_path: Path) -> None:
    mac = start_mac(stack, redis_url, "mac", model_files(tmp_path, "ab"), "--idle-unload", "1")
    router = start_router(stack, redis_url, timeout="60")  # the first ask's marker holds for 60 s
    assert ask(router, "a").status_code == 200
    wait_until(lambda: mac.state("a") == "standby", 15, what="a unloaded when idle")
    # the ask is over (a loaded, then unloaded): a new one is made, rather than a wait for the marker to lapse
    again = httpx.post(router + "/v1/chat/completions", timeout=20, json={
        "model": "a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert again.status_code == 200, again.text
    assert mac.memory()["models"]["a"]["loads"] == 2
