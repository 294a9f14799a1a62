"""A small closed-loop load driver for calibrate: ``c`` clients, each sending its next request when one ends.

Figures are measured on the server's own clock: llama-server (and the simulator, in simulated time) ends
every stream with ``timings`` (``prompt_ms``, ``predicted_ms``, ``predicted_n``). A request's latency is
``prompt_ms + predicted_ms``, its TTFT ``prompt_ms``. A level's throughput is the server's own token count
over the measuring window (tokens generated so far, from ``/metrics`` and ``/slots``, or the simulator's
``/sim/stats`` in simulated time): a time average, steadier than any mean over a few completions. Without
those, it follows from Little's law, ``concurrency x mean tokens / mean latency``. Either way client overhead
and a simulator running faster than real time do not distort the curve. Levels never exceed the server's
slots (no queueing inside it).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import secrets
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from httpx_sse import EventSource

from macpool.loops import wait_event

from .heartbeat import decoded_so_far, parse_metrics
from .memory import MacProbe, ProbeError

MEMORY_EVERY_S = 0.1  # pinned-memory sampling period while a level is measured
FILLER = " calibrate "  # the prompt's text, after a tag that makes each prompt unique
CHARS_PER_TOKEN = 4.0  # when the server cannot say (no /tokenize)
WARMUP_ROUNDS = 2  # requests per client before measuring: the first round starts all prefills at once


@dataclass
class LevelResult:
    concurrency: int
    throughput_tok_s: float
    p50_latency_s: float
    ttft_p50_s: float
    peak_pinned_gb: float | None
    wired_limit_gb: float | None
    state: str | None
    completed: int  # requests measured
    errors: int  # failed requests, warm-up included
    succeeded: int = 0  # requests that completed, warm-up included
    last_error: str = ""  # what the last failed request said

    @property
    def error_rate(self) -> float:
        attempted = self.errors + max(self.succeeded, self.completed)
        return self.errors / attempted if attempted else 0.0


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

    def to_server(self, wall_seconds: float) -> float:
        return wall_seconds * self.speed if self.simulated else wall_seconds

    async def tokens(self) -> tuple[float, float] | None:
        """(tokens generated so far, server time): a counter that moves with every token, not per request."""
        try:
            if self.simulated:
                stats = (await self.client.get(self.base + "/sim/stats", timeout=5)).json()
                return float(stats["tokens_predicted_total"]), float(stats["sim_time_s"])
            metrics, slots = await asyncio.gather(
                self.client.get(self.base + "/metrics", timeout=5),
                self.client.get(self.base + "/slots", timeout=5),
            )
            now = time.monotonic()
            total = parse_metrics(metrics.text).get("llamacpp:tokens_predicted_total")
            if metrics.status_code != 200 or slots.status_code != 200 or total is None:
                return None
            return total + decoded_so_far(slots.json()), now
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return None


def final_timings(data: str) -> dict[str, Any] | None:
    """The ``timings`` object of an event's data (the stream's last event that carries one)."""
    try:
        timings = json.loads(data)["timings"]
    except (ValueError, KeyError, TypeError):
        return None
    return timings if isinstance(timings, dict) else None


async def chars_per_token(client: httpx.AsyncClient, base: str) -> float:
    """Characters of the prompt's filler text per token of the server's tokenizer (``/tokenize``), so that
    a prompt of ``n`` tokens is ``n`` tokens whatever the model: a prompt near the context must not pass it.
    """
    sample = FILLER * 200
    try:
        response = await client.post(base + "/tokenize", json={"content": sample}, timeout=10)
        count = len(response.json().get("tokens", [])) if response.status_code == 200 else 0
    except (httpx.HTTPError, ValueError, AttributeError):
        count = 0
    return len(sample) / count if count else CHARS_PER_TOKEN


async def memory(client: httpx.AsyncClient, base: str) -> dict[str, Any] | None:
    """Pinned memory and the wired limit: the simulator's figures, else this Mac's own (calibrate runs
    on the Mac it measures), else nothing (Linux with a real llama-server: no wired limit to approach)."""
    try:
        response = await client.get(base + "/sim/memory", timeout=5)
        if response.status_code == 200:
            data: dict[str, Any] = response.json()
            return data
    except httpx.HTTPError:
        return None
    if sys.platform != "darwin":
        return None
    try:
        sample = await MacProbe().sample()
    except (ProbeError, OSError):
        return None
    return {"pinned_gb": sample.pinned_gb, "wired_limit_gb": sample.wired_limit_gb, "state": sample.pressure}


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
    chars_per_token: float = CHARS_PER_TOKEN  # the server tokenizer's, on FILLER (chars_per_token below)
    _ids: itertools.count[int] = field(default_factory=itertools.count)
    _salt: str = field(default_factory=lambda: secrets.token_hex(5))  # unique across levels and runs
    latencies: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    generated: list[float] = field(default_factory=list)
    errors: int = 0
    succeeded: int = 0
    last_error: str = ""
    measuring: bool = False

    def _body(self) -> dict[str, Any]:
        # a distinct first block per request, so no slot's prompt cache skips the prefill
        tag = f"{self._salt}{next(self._ids):06d}"
        chars = max(1, round(self.prompt_tokens * self.chars_per_token))
        text = (tag + FILLER * (chars // len(FILLER) + 1))[:chars]
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
        last = ""  # the data of the last event that carried llama-server's timings
        body = self._body()
        for attempt in range(2):
            answered = False
            try:
                async with self.client.stream(
                    "POST", self.base + "/v1/completions", json=body, headers=self.headers
                ) as response:
                    answered = True
                    if response.status_code != 200:
                        await response.aread()
                        raise httpx.HTTPStatusError("bad status", request=response.request, response=response)
                    async for event in EventSource(response).aiter_sse():
                        if first is None:
                            first = time.monotonic()
                        if '"timings"' in event.data:
                            last = event.data
                break
            except httpx.RemoteProtocolError:
                # a kept-alive connection the server closed as the request went out (llama-server's HTTP
                # library ends a connection after a few requests): it never saw the request, so send it again
                if answered or attempt:
                    raise
        if not self.measuring:
            return
        timings = final_timings(last) if last else None
        if timings is not None:
            prompt_s, predicted_s = timings["prompt_ms"] / 1000, timings["predicted_ms"] / 1000
            self.latencies.append(prompt_s + predicted_s)
            self.ttfts.append(prompt_s)
            self.generated.append(float(timings.get("predicted_n", self.max_tokens)))
        else:  # no timings: the client's clock
            self.latencies.append(self.clock.to_server(time.monotonic() - started))
            self.ttfts.append(self.clock.to_server((first or time.monotonic()) - started))
            self.generated.append(float(self.max_tokens))

    async def _worker(self, index: int, warmed: asyncio.Event, counter: list[int]) -> None:
        await asyncio.sleep(0.05 * index)  # staggered starts: identical clients would stay in lockstep
        while True:
            try:
                await self._one()
            except httpx.HTTPStatusError as exc:
                self.errors += 1
                self.last_error = f"HTTP {exc.response.status_code}: {exc.response.text[:200]}"
                await asyncio.sleep(0.05)
                continue
            except httpx.HTTPError as exc:
                self.errors += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
                await asyncio.sleep(0.05)
                continue
            self.succeeded += 1
            counter[0] += 1
            if counter[0] >= WARMUP_ROUNDS * self.concurrency:
                warmed.set()

    def _failing(self) -> bool:
        """Enough failures to end the level early: its error rate is a knee signal, reported, not fatal."""
        return self.errors > max(20, 2 * self.window_requests)

    async def run(self) -> LevelResult:
        warmed = asyncio.Event()
        counter = [0]
        workers = [asyncio.create_task(self._worker(i, warmed, counter)) for i in range(self.concurrency)]
        peak: float | None = None
        limit: float | None = None
        state: str | None = None
        try:
            while not self._failing():
                if await wait_event(warmed, 0.05):
                    break
            self.measuring = True
            counted_from = await self.clock.tokens()
            sampled_at = 0.0
            while len(self.latencies) < self.window_requests and not self._failing():
                mem = None
                if time.monotonic() - sampled_at >= MEMORY_EVERY_S:
                    sampled_at = time.monotonic()
                    mem = await memory(self.client, self.base)
                if mem is not None:
                    pinned = float(mem["pinned_gb"])
                    if peak is None or pinned >= peak:
                        peak, state = pinned, str(mem.get("state"))
                    limit = float(mem["wired_limit_gb"])
                await asyncio.sleep(0.02)
            counted_to = await self.clock.tokens()
        finally:
            for worker in workers:
                worker.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
        # Little's law on the requests' own timings: immune to client overhead and to a lagging simulator
        throughput = 0.0
        if counted_from and counted_to and counted_to[1] > counted_from[1] and self.latencies:
            throughput = (counted_to[0] - counted_from[0]) / (counted_to[1] - counted_from[1])
        elif self.latencies:
            throughput = self.concurrency * statistics.mean(self.generated) / statistics.mean(self.latencies)
        return LevelResult(
            concurrency=self.concurrency,
            throughput_tok_s=throughput,
            p50_latency_s=statistics.median(self.latencies) if self.latencies else 0.0,
            ttft_p50_s=statistics.median(self.ttfts) if self.ttfts else 0.0,
            peak_pinned_gb=peak,
            wired_limit_gb=limit,
            state=state,
            completed=len(self.latencies),
            errors=self.errors,
            succeeded=self.succeeded,
            last_error=self.last_error,
        )
