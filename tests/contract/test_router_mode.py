"""llama-server's router mode (several models, loaded on demand), on the real llama-server and the simulator.

Both serve two models, ``tiny`` and ``small`` (the real one from a ``--models-dir`` holding the two generated
GGUFs, the simulator from two presets), with autoload off and at most one model loaded at once, as an agent
that owns the Mac's memory budget would run it. The shapes and error texts are those of
tools/server/server-models.cpp.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from macpool.dev import tiny_model
from macpool.dev.redis_server import free_port
from tests.conftest import SpawnFactory
from tests.contract.conftest import _llama_server_binary
from tests.inprocess import LocalStack

MODELS = ("small", "tiny")
COMMON = ["--parallel", "2", "-c", "2048", "--no-models-autoload", "--models-max", "1"]


@pytest.fixture(params=["sim", "llama-server"])
def router(request: pytest.FixtureRequest, spawn: SpawnFactory, tmp_path: Path) -> Iterator[str]:
    """The URL of a router-mode server serving MODELS."""
    if request.param == "sim":
        servers: LocalStack = request.getfixturevalue("local_stack")
        served = servers.sim("sim", "--preset", "m5max-128g-14b-q4", "--speed", "20",
                             "--models", "tiny=m5max-128g-14b-q4,small=m2pro-32g-8b-q4", *COMMON)
        yield served.url
        return
    binary = _llama_server_binary()
    if binary is None:
        pytest.skip("llama-server not built: run `macpool dev build-llama-server`")
    models = tmp_path / "models"
    models.mkdir()
    for name in MODELS:
        (models / f"{name}.gguf").symlink_to(tiny_model.ensure(name))
    port = free_port()
    argv = [binary, "--models-dir", str(models), "--host", "127.0.0.1", "--port", str(port), "--no-webui",
            "-t", "1", *COMMON]
    yield spawn(argv=argv, port=port, name="llama-server-router", timeout=60).url


def statuses(url: str) -> dict[str, str]:
    listing = httpx.get(url + "/models", timeout=10).json()
    return {m["id"]: m["status"]["value"] for m in listing["data"]}


def wait_for(url: str, name: str, status: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while statuses(url).get(name) != status:
        assert time.monotonic() < deadline, f"{name} not {status}: {statuses(url)}"
        time.sleep(0.1)


def chat(url: str, model: str | None, **extra: Any) -> httpx.Response:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
    if model is not None:
        body["model"] = model
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=60)


def error_of(response: httpx.Response) -> tuple[int, str, str]:
    e = response.json()["error"]
    return response.status_code, e["message"], e["type"]


INVALID = "invalid_request_error"


def test_models_are_listed_with_their_status(router: str) -> None:
    listing = httpx.get(router + "/models", timeout=10).json()
    assert listing["object"] == "list"
    assert sorted(m["id"] for m in listing["data"]) == list(MODELS)
    for model in listing["data"]:
        assert model["object"] == "model" and model["owned_by"] == "llamacpp"
        assert model["status"]["value"] == "unloaded" and isinstance(model["status"]["args"], list)
        assert model["architecture"]["input_modalities"] == ["text"]
        assert "meta" not in model  # only a loaded model reports what it holds
    v1 = httpx.get(router + "/v1/models", timeout=10).json()
    assert sorted(m["id"] for m in v1["data"]) == list(MODELS)
    props = httpx.get(router + "/props", timeout=10).json()
    assert props["role"] == "router" and props["max_instances"] == 1 and props["models_autoload"] is False


def test_a_request_names_a_loaded_model_or_is_refused(router: str) -> None:
    assert error_of(chat(router, None)) == (400, "model name is missing from the request", INVALID)
    assert error_of(chat(router, "nope")) == (400, "model 'nope' not found", INVALID)
    assert error_of(chat(router, "tiny")) == (400, "model is not loaded", INVALID)
    slots = httpx.get(router + "/slots", params={"model": "tiny"}, timeout=10)
    assert error_of(slots) == (400, "model is not loaded", INVALID)
    unnamed = httpx.get(router + "/slots", timeout=10)
    assert error_of(unnamed) == (400, "model name is missing from the request", INVALID)
    bad = httpx.post(router + "/v1/chat/completions", content=b'{"model":', timeout=10)
    assert bad.status_code == 400 and "parse error" in bad.json()["error"]["message"]


def test_load_serve_and_unload(router: str) -> None:
    assert httpx.post(router + "/models/load", json={"model": "tiny"}, timeout=10).json() == {"success": True}
    wait_for(router, "tiny", "loaded")
    again = httpx.post(router + "/models/load", json={"model": "tiny"}, timeout=10)
    assert error_of(again) == (400, "model is already running", INVALID)
    answer = chat(router, "tiny")
    assert answer.status_code == 200 and answer.json()["model"] == "tiny"
    assert answer.json()["usage"]["completion_tokens"] == 4
    slots = httpx.get(router + "/slots", params={"model": "tiny"}, timeout=10).json()
    assert [s["id"] for s in slots] == [0, 1] and slots[0]["n_ctx"] == 1024
    loaded = {m["id"]: m for m in httpx.get(router + "/models", timeout=10).json()["data"]}
    assert loaded["tiny"]["meta"]["size"] > 0 and loaded["tiny"]["meta"]["n_ctx"] == 1024
    unloaded = httpx.post(router + "/models/unload", json={"model": "tiny"}, timeout=10)
    assert unloaded.json() == {"success": True}
    wait_for(router, "tiny", "unloaded")
    again = httpx.post(router + "/models/unload", json={"model": "tiny"}, timeout=10)
    assert error_of(again) == (400, "model is not running", INVALID)
    unknown = httpx.post(router + "/models/load", json={"model": "nope"}, timeout=10)
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found_error"


def test_loading_past_models_max_unloads_the_least_recently_used_idle_model(router: str) -> None:
    httpx.post(router + "/models/load", json={"model": "tiny"}, timeout=10).raise_for_status()
    wait_for(router, "tiny", "loaded")
    httpx.post(router + "/models/load", json={"model": "small"}, timeout=30).raise_for_status()
    wait_for(router, "small", "loaded")
    assert statuses(router) == {"small": "loaded", "tiny": "unloaded"}
    assert chat(router, "small").status_code == 200
