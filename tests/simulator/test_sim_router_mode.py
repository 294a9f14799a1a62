"""The simulator's router mode (several models on one Mac): one memory budget, loads and unloads."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from macpool.sim.machine import MachineError
from macpool.sim.router_models import parse_models
from tests.conftest import wait_until
from tests.inprocess import LocalStack

pytestmark = pytest.mark.in_process


def memory(url: str, model: str | None = None) -> dict[str, Any]:
    params = {"model": model} if model else None
    return dict(httpx.get(url + "/sim/memory", params=params, timeout=10).json())


def load(url: str, model: str) -> None:
    assert httpx.post(url + "/models/load", json={"model": model}, timeout=10).status_code == 200


def status_of(url: str, model: str) -> dict[str, Any]:
    listing = httpx.get(url + "/models", timeout=10).json()["data"]
    return dict(next(m["status"] for m in listing if m["id"] == model))


def wait_status(url: str, model: str, value: str) -> dict[str, Any]:
    wait_until(lambda: status_of(url, model)["value"] == value, 10, f"{model} {value}")
    return status_of(url, model)


def test_models_share_the_macs_memory_and_a_load_past_it_fails(local_stack: LocalStack) -> None:
    # an M4 Pro whose llama-server fails a start that does not fit (overcommit: fail): the 14B model with
    # 8 slots of 8K (20.9 GB) and the 32B one (19 GB) do not both fit under its 36 GB wired limit
    url = local_stack.sim("mac", "--preset", "m4pro-48g-14b-q4", "--speed", "50", "--no-models-autoload",
                          "--models-max", "0",
                          "--models", "a=m4pro-48g-14b-q4,b=m4max-64g-32b-q4").url
    load(url, "a")
    wait_status(url, "a", "loaded")
    held_a = memory(url)["models"]["a"]["pinned_gb"]
    assert held_a == pytest.approx(8.4 + 0.5 + 8 * 8192 * 0.1875 / 1024)
    load(url, "b")
    failed = wait_status(url, "b", "unloaded")
    assert failed["failed"] is True and failed["exit_code"] == 1  # as llama-server reports a child that died
    assert memory(url)["pinned_gb"] == pytest.approx(held_a)
    # room made: it loads
    assert httpx.post(url + "/models/unload", json={"model": "a"}, timeout=10).status_code == 200
    wait_status(url, "a", "unloaded")  # the answer comes at once; the child's exit a moment later
    load(url, "b")
    wait_status(url, "b", "loaded")
    assert memory(url)["pinned_gb"] == pytest.approx(19.0)
    assert memory(url)["models"]["b"]["loads"] == 2


def test_each_model_pages_with_what_the_others_hold(local_stack: LocalStack) -> None:
    url = local_stack.sim("mac", "--preset", "m5max-128g-14b-q4", "--speed", "50",
                          "--models", "a=m5max-128g-14b-q4,b=m4max-64g-32b-q4").url
    load(url, "a")
    load(url, "b")
    wait_status(url, "a", "loaded")
    wait_status(url, "b", "loaded")
    mac = memory(url)
    assert mac["state"] == "healthy" and mac["pinned_gb"] == pytest.approx(8.33 + 19.0)
    httpx.post(url + "/sim/pressure", json={"external_gb": 10}, timeout=10).raise_for_status()
    mac = memory(url)
    assert mac["pinned_gb"] > mac["wired_limit_gb"] and mac["state"] == "paging"
    # each model's own server sees the Mac as a whole: it pages too
    wait_until(lambda: memory(url, "a")["state"] == "paging", 10, "a's server paging")
    assert memory(url, "a")["external_gb"] == pytest.approx(19.0 + 10)


def test_concurrent_requests_for_an_unloaded_model_load_it_once(local_stack: LocalStack) -> None:
    url = local_stack.sim("mac", "--preset", "m5max-128g-14b-q4", "--speed", "20", "--load-seconds", "2",
                          "--models", "a=m5max-128g-14b-q4,b=m2pro-32g-8b-q4").url

    async def burst() -> list[int]:
        async with httpx.AsyncClient(timeout=30) as client:
            body = {"model": "b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            replies = await asyncio.gather(*(client.post(url + "/v1/chat/completions", json=body)
                                             for _ in range(4)))
        return [r.status_code for r in replies]

    assert asyncio.run(burst()) == [200] * 4
    assert memory(url)["models"]["b"]["loads"] == 1


def test_an_unload_cuts_the_requests_in_flight_and_frees_the_memory(local_stack: LocalStack) -> None:
    url = local_stack.sim("mac", "--preset", "m5max-128g-14b-q4", "--speed", "1",
                          "--models", "a=m5max-128g-14b-q4").url
    load(url, "a")
    wait_status(url, "a", "loaded")

    async def cut() -> tuple[bytes, str]:
        body = {"model": "a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2000,
                "stream": True}
        received = b""
        async with (httpx.AsyncClient(timeout=30) as client,
                    client.stream("POST", url + "/v1/chat/completions", json=body) as reply):
            try:
                async for chunk in reply.aiter_bytes():
                    received += chunk
                    if received.count(b"data: ") == 3:
                        unloaded = await client.post(url + "/models/unload", json={"model": "a"})
                        assert unloaded.status_code == 200
            except httpx.HTTPError as exc:
                return received, type(exc).__name__
        return received, "ended"

    received, how = asyncio.run(cut())
    assert b"[DONE]" not in received and how == "RemoteProtocolError", (how, received[-200:])
    assert memory(url)["models"]["a"] == {"status": "unloaded", "pinned_gb": 0.0, "loads": 1}


def test_models_flag_is_checked() -> None:
    assert parse_models("a=p1, b=p2") == {"a": "p1", "b": "p2"}
    for bad in ("a", "=p", "a=p,a=q", ","):
        with pytest.raises(MachineError):
            parse_models(bad)
