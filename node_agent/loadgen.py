"""A small closed-loop load driver for calibrate: ``c`` clients, each sending its next request when one ends.

Figures are measured on the server's clock where it has one: the simulator reports ``sim_time_s`` in
``/sim/stats`` (its time runs ``--speed`` times faster than ours); a real llama-server runs on wall time.
Generated tokens come from llama-server's own ``llamacpp:tokens_predicted_total`` counter.
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from .heartbeat import parse_metrics


@dataclass
class LevelResult:
    concurrency: int
    throughput_tok_s: float
    p50_latency_s: float
    ttft_p50_s: float
    peak_pinned_gb: float | None
    wired_limit_gb: float | None
    state: str | None
    completed: int
    errors: int


@dataclass
class Clock:
    """Server time: simulated seconds when the target is the simulator, else wall seconds."""

    client: httpx.AsyncClient
    base: str
    simulated: bool = False
    speed: float = 1.0

    async def detect(self) -> None:
        try:
            response = await self.client.get(self.base + "/sim/stats", timeout=5)
            if response.status_code == 200 and "sim_time_s" in response.json():
                self.simulated = True
                self.speed = float(response.json().get("speed", 1.0)) or 1.0
        except (httpx.HTTPError, ValueError):
            self.simulated = False

    async def now(self) -> float:
        if self.simulated:
            response = await self.client.get(self.base + "/sim/stats", timeout=5)
            return float(response.json()["sim_time_s"])
        return time.monotonic()

    def to_server(self, wall_seconds: float) -> float:
        return wall_seconds * self.speed if self.simulated else wall_seconds


async def tokens_predicted(client: httpx.AsyncClient, base: str) -> float:
    response = await client.get(base + "/metrics", timeout=5)
    response.raise_for_status()
    return parse_metrics(response.text).get("llamacpp:tokens_predicted_total", 0.0)


async def memory(client: httpx.AsyncClient, base: str) -> dict[str, Any] | None:
    try:
        response = await client.get(base + "/sim/memory", timeout=5)
    except httpx.HTTPError:
        return None
    return response.json() if response.status_code == 200 else None


@dataclass
class Level:
    """One concurrency level: warm up until every client finished one request, then measure a window."""

    client: httpx.AsyncClient
    base: str
    clock: Clock
    concurrency: int
    prompt_tokens: int
    max_tokens: int
    model: str | None
    window_requests: int
    headers: dict[str, str] = field(default_factory=dict)
    _ids: itertools.count[int] = field(default_factory=itertools.count)
    latencies: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    errors: int = 0
    measuring: bool = False

    def _body(self) -> dict[str, Any]:
        # a distinct first block per request, so no slot's prompt cache skips the prefill
        tag = f"{next(self._ids):08d}"[-8:]
        text = (tag + " calibrate " * self.prompt_tokens)[: self.prompt_tokens * 4]
        body: dict[str, Any] = {
            "prompt": text,
            "max_tokens": self.max_tokens,
            "stream": True,
            "ignore_eos": True,
        }
        if self.model:
            body["model"] = self.model
        return body

    async def _one(self) -> None:
        started = time.monotonic()
        first: float | None = None
        async with self.client.stream(
            "POST", self.base + "/v1/completions", json=self._body(), headers=self.headers
        ) as response:
            if response.status_code != 200:
                await response.aread()
                raise httpx.HTTPStatusError("bad status", request=response.request, response=response)
            async for _ in response.aiter_raw():
                if first is None:
                    first = time.monotonic()
        if self.measuring:
            self.latencies.append(self.clock.to_server(time.monotonic() - started))
            self.ttfts.append(self.clock.to_server((first or time.monotonic()) - started))

    async def _worker(self, warmed: asyncio.Event, counter: list[int]) -> None:
        while True:
            try:
                await self._one()
            except httpx.HTTPError:
                self.errors += 1
                await asyncio.sleep(0.05)
                continue
            counter[0] += 1
            if counter[0] >= self.concurrency:
                warmed.set()

    async def run(self) -> LevelResult:
        warmed = asyncio.Event()
        counter = [0]
        workers = [asyncio.create_task(self._worker(warmed, counter)) for _ in range(self.concurrency)]
        peak: float | None = None
        limit: float | None = None
        state: str | None = None
        try:
            await warmed.wait()
            self.measuring = True
            t0, tokens0 = await self.clock.now(), await tokens_predicted(self.client, self.base)
            while len(self.latencies) < self.window_requests:
                mem = await memory(self.client, self.base)
                if mem is not None:
                    pinned = float(mem["pinned_gb"])
                    if peak is None or pinned >= peak:
                        peak, state = pinned, str(mem.get("state"))
                    limit = float(mem["wired_limit_gb"])
                await asyncio.sleep(0.02)
            t1, tokens1 = await self.clock.now(), await tokens_predicted(self.client, self.base)
        finally:
            for worker in workers:
                worker.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
        return LevelResult(
            concurrency=self.concurrency,
            throughput_tok_s=(tokens1 - tokens0) / max(t1 - t0, 1e-9),
            p50_latency_s=statistics.median(self.latencies),
            ttft_p50_s=statistics.median(self.ttfts),
            peak_pinned_gb=peak,
            wired_limit_gb=limit,
            state=state,
            completed=len(self.latencies),
            errors=self.errors,
        )
