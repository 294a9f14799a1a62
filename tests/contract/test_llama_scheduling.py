"""llama-server never refuses: a request beyond the slots is deferred; a client that leaves frees its slot."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import httpx

from tests.contract.conftest import Target
from tests.contract.test_llama_surface import parse_metrics


def slow_body(target: Target) -> dict[str, Any]:
    return {"prompt": "Tell a long story.", "stream": True, **target.slow_request}


async def wait_for(probe: Any, within: float, interval: float = 0.01) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if await probe():
            return True
        await asyncio.sleep(interval)
    return False


def test_busy_server_defers_and_stays_healthy(target: Target) -> None:
    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=target.url, timeout=120) as client:

            async def one() -> None:
                async with client.stream("POST", "/completion", json=slow_body(target)) as response:
                    assert response.status_code == 200
                    async for _ in response.aiter_bytes():
                        pass

            streams = [asyncio.create_task(one()) for _ in range(target.parallel + 1)]
            seen: dict[str, Any] = {}

            async def deferred() -> bool:
                metrics = parse_metrics((await client.get("/metrics")).text)
                if metrics["llamacpp:requests_deferred"] >= 1:
                    seen["health"] = (await client.get("/health")).status_code
                    seen["fail"] = (await client.get("/slots", params={"fail_on_no_slot": 1})).status_code
                    return True
                return False

            try:
                assert await wait_for(deferred, within=30), "no request was ever deferred"
                assert seen["health"] == 200
                assert seen["fail"] == 503
                await asyncio.gather(*streams)
            finally:
                for task in streams:
                    task.cancel()
                await asyncio.gather(*streams, return_exceptions=True)

    asyncio.run(scenario())


async def all_idle(client: httpx.AsyncClient) -> bool:
    slots = (await client.get("/slots")).json()
    return not any(s["is_processing"] for s in slots)


def test_disconnect_frees_the_slot(target: Target) -> None:
    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=target.url, timeout=60) as client:
            async with client.stream("POST", "/completion", json=slow_body(target)) as response:
                async for _ in response.aiter_bytes():
                    break  # one chunk: the slot is generating; now hang up
            closed = time.monotonic()
            assert await wait_for(lambda: all_idle(client), within=5)
            assert time.monotonic() - closed < 1.0

    asyncio.run(scenario())


def test_disconnect_while_waiting_non_streaming(target: Target) -> None:
    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=target.url, timeout=60) as client:
            body = {**slow_body(target), "stream": False}
            with contextlib.suppress(httpx.ReadTimeout):
                await client.post("/completion", json=body, timeout=httpx.Timeout(60, read=0.3))
            closed = time.monotonic()
            if target.kind == "llama-server":
                # llama-server checks a non-streaming client's socket only when its wait for results times
                # out (1 s without a result for ANY task): polling /slots faster than that, or another slot
                # streaming, postpones the check (docs/llama-server.md). So look only every 1.5 s.
                assert await wait_for(lambda: all_idle(client), within=8, interval=1.5)
                return
            assert await wait_for(lambda: all_idle(client), within=5)
            assert time.monotonic() - closed < 1.0

    asyncio.run(scenario())
