"""llama-server never refuses: a request beyond the slots is deferred; a client that leaves frees its slot; a
prompt's generations start together."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable
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


class Generations:
    """A streamed /completion read in the background, noting which generations (by index) have sent tokens."""

    def __init__(self, client: httpx.AsyncClient, body: dict[str, Any]) -> None:
        self.started: set[int] = set()
        self.reader = asyncio.create_task(self._read(client, body))

    async def _read(self, client: httpx.AsyncClient, body: dict[str, Any]) -> None:
        async with client.stream("POST", "/completion", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    self.started.add(json.loads(line[len("data: "):])["index"])

    async def wait_started(self, n: int = 1) -> None:
        async def probe() -> bool:
            return len(self.started) >= n or self.reader.done()

        await wait_for(probe, within=10)
        assert len(self.started) >= n, self.reader.exception() if self.reader.done() else self.started

    async def close(self) -> None:
        """Hang up: the server cancels whatever has not finished."""
        self.reader.cancel()
        await asyncio.gather(self.reader, return_exceptions=True)


async def busy_slots(client: httpx.AsyncClient) -> int:
    return sum(slot["is_processing"] for slot in (await client.get("/slots")).json())


async def deferred(client: httpx.AsyncClient) -> float:
    return parse_metrics((await client.get("/metrics")).text)["llamacpp:requests_deferred"]


async def reaches(read: Callable[[], Awaitable[float]], value: float) -> bool:
    async def probe() -> bool:
        return await read() == value

    return await wait_for(probe, within=10)


Scenario = Callable[[httpx.AsyncClient, Callable[..., Generations]], Awaitable[None]]


def run_streams(target: Target, scenario: Scenario) -> None:
    """Run ``scenario(client, start)``: ``start(**fields)`` opens a slow stream (with ``fields`` added to its
    body); every stream it opened is closed at the end, whatever happened."""

    async def main() -> None:
        async with httpx.AsyncClient(base_url=target.url, timeout=120) as client:
            streams: list[Generations] = []

            def start(**fields: Any) -> Generations:
                streams.append(Generations(client, {**slow_body(target), **fields}))
                return streams[-1]

            try:
                await scenario(client, start)
            finally:
                for stream in streams:
                    await stream.close()

    asyncio.run(main())


async def a_pair_deferred(client: httpx.AsyncClient, start: Callable[..., Generations]) -> Generations:
    """Start a request of n = 2 and wait until the server has deferred it."""
    pair = start(n=2)
    assert await reaches(lambda: deferred(client), 1)
    return pair


def test_a_prompts_generations_start_together(target: Target) -> None:
    # n = 2 beside a busy slot: neither generation takes the idle slot; both start once the busy one is freed
    async def scenario(client: httpx.AsyncClient, start: Callable[..., Generations]) -> None:
        busy = start()
        await busy.wait_started()
        pair = await a_pair_deferred(client, start)
        assert await busy_slots(client) == 1
        assert not pair.started and not busy.reader.done()
        await busy.close()
        await pair.wait_started(2)
        assert await busy_slots(client) == 2

    run_streams(target, scenario)


def test_a_single_request_overtakes_waiting_generations(target: Target) -> None:
    # llama-server launches a new request at once if it fits, whatever waits in its deferred queue
    async def scenario(client: httpx.AsyncClient, start: Callable[..., Generations]) -> None:
        busy = start()
        await busy.wait_started()
        pair = await a_pair_deferred(client, start)
        single = start()
        await single.wait_started()  # in the idle slot the pair is waiting for
        assert not pair.started and not busy.reader.done()
        assert await deferred(client) == 1
        await busy.close()
        await single.close()
        await pair.wait_started(2)

    run_streams(target, scenario)


def test_a_freed_slot_offers_only_the_front_of_the_queue(target: Target) -> None:
    # llama-server retries only its deferred queue's front task when a slot is freed; one that still does not
    # fit goes to the back, and the single request now in front waits beside the idle slot
    async def scenario(client: httpx.AsyncClient, start: Callable[..., Generations]) -> None:
        first, second = start(), start()
        await first.wait_started()
        await second.wait_started()
        pair = await a_pair_deferred(client, start)
        single = start()
        assert await reaches(lambda: deferred(client), 2)
        await second.close()
        assert await reaches(lambda: busy_slots(client), 1)
        assert await deferred(client) == 2
        assert not single.started and not pair.started and not first.reader.done()
        await first.close()
        await single.wait_started()
        assert await deferred(client) == 1 and not pair.started
        await single.close()
        await pair.wait_started(2)

    run_streams(target, scenario)
