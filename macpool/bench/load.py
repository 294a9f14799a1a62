"""Load drivers shared by every benchmark: closed-loop streaming clients that record each request.

``closed_loop`` runs ``concurrency`` clients, each sending its next request as soon as the previous one ends,
and returns one ``RequestRecord`` per request (status, TTFT, latency, tokens, Retry-After). ``SimClock``
reads a simulator's clock (``/sim/stats``) so callers can report in simulated time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import random
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from macpool.bench.sse import Events
from macpool.sim import tokens

BodyFactory = Callable[[int], dict[str, Any]]


@dataclass
class RequestRecord:
    """One request as the client saw it (wall-clock seconds)."""

    client: int
    status: int  # HTTP status; 0 when the connection failed
    started: float  # time.monotonic() when sent
    ttft_s: float | None  # first content token
    latency_s: float  # until the body ended (or the failure)
    tokens: int  # generated tokens (usage when reported, else content chunks)
    retry_after: str | None = None
    error: str | None = None
    reason: str | None = None  # X-Macpool-Reason of a refusal (pool_full, queue_timeout, ...)

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


def chat_body(
    prompt_tokens: int, max_tokens: int, model: str | None = None, spread: float = 0.0
) -> BodyFactory:
    """Streaming chat requests of ``prompt_tokens`` tokens (simulator's rule), each unique (no cache hits).

    With ``spread``, each request asks for a length drawn uniformly within ``max_tokens`` x (1 +/- spread),
    as answers vary in use: closed-loop clients whose answers all have one length stay in step, prefill
    together and queue behind each other's prompts, which no placement causes or cures."""
    run = secrets.token_hex(4)  # unique across runs too: a repeated prompt would hit the slot cache
    serial = itertools.count()
    lengths = random.Random(run)
    low, high = max(1, round(max_tokens * (1 - spread))), round(max_tokens * (1 + spread))

    def make(client: int) -> dict[str, Any]:
        body: dict[str, Any] = {
            "messages": tokens.chat_messages(prompt_tokens, salt=f"{run}-c{client}-r{next(serial)}"),
            "max_tokens": lengths.randint(low, high) if spread else max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if model:
            body["model"] = model
        return body

    return make


def _chunk_tokens(payload: dict[str, Any]) -> tuple[int, int | None]:
    """(content tokens in this chunk, completion_tokens if the chunk reports usage)."""
    usage = payload.get("usage")
    reported = usage.get("completion_tokens") if isinstance(usage, dict) else None
    choices = payload.get("choices")
    if isinstance(choices, list) and choices:
        choice = choices[0]
        delta = choice.get("delta") or {}
        text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
        return (1 if text else 0), reported
    if "content" in payload and not payload.get("stop"):  # llama.cpp native
        return (1 if payload["content"] else 0), None
    return 0, reported


async def stream_request(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], client_id: int = 0
) -> RequestRecord:
    """Send one streaming request and read it to the end."""
    started = time.monotonic()
    ttft: float | None = None
    counted = 0
    reported: int | None = None
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return RequestRecord(
                    client_id, response.status_code, started, None, time.monotonic() - started, 0,
                    retry_after=response.headers.get("retry-after"),
                    error=response.text[:200] if response.status_code not in (429, 503) else None,
                    reason=response.headers.get("x-macpool-reason"),
                )
            async for doc in Events(response):
                n, usage = _chunk_tokens(doc)
                if n and ttft is None:
                    ttft = time.monotonic() - started
                counted += n
                reported = usage if usage is not None else reported
        return RequestRecord(
            client_id, 200, started, ttft, time.monotonic() - started,
            reported if reported is not None else counted,
        )
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return RequestRecord(
            client_id, 0, started, ttft, time.monotonic() - started, counted, error=type(exc).__name__
        )


@dataclass
class ClosedLoop:
    """``concurrency`` clients in a closed loop against ``url + path``."""

    url: str
    concurrency: int
    make_body: BodyFactory
    path: str = "/v1/chat/completions"
    requests_per_client: int | None = 1
    duration_s: float | None = None  # wall seconds after which clients send no new request
    reject_pause_s: float = 0.05  # a rejected client waits this long (or Retry-After, if shorter)
    pause_statuses: tuple[int, ...] = (429, 503)  # the answers that mean "rejected"
    # a request answered after refusals is timed from its first try, as its user waits: a router that
    # refuses at once and one that queues are then compared on the same clock
    from_first_try: bool = False
    headers: dict[str, str] = field(default_factory=dict)
    on_record: Callable[[RequestRecord], None] | None = None

    async def run(self) -> list[RequestRecord]:
        records: list[RequestRecord] = []
        deadline = None if self.duration_s is None else time.monotonic() + self.duration_s
        n = self.concurrency
        limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n)
        timeout = httpx.Timeout(600.0, connect=10.0)
        async with httpx.AsyncClient(
            base_url=self.url, limits=limits, timeout=timeout, headers=self.headers
        ) as client:

            async def one_client(client_id: int) -> None:
                sent = 0
                first_try: float | None = None
                while True:
                    if self.requests_per_client is not None and sent >= self.requests_per_client:
                        return
                    if deadline is not None and time.monotonic() >= deadline:
                        return
                    record = await stream_request(client, self.path, self.make_body(client_id), client_id)
                    if self.from_first_try:
                        record, first_try = retimed(record, first_try, self.pause_statuses)
                    sent += 1
                    records.append(record)
                    if self.on_record is not None:
                        self.on_record(record)
                    if record.status in self.pause_statuses:
                        await asyncio.sleep(self._pause(record.retry_after))

            await asyncio.gather(*(one_client(i) for i in range(self.concurrency)))
        return records

    def _pause(self, retry_after: str | None) -> float:
        try:
            hinted = float(retry_after) if retry_after else self.reject_pause_s
        except ValueError:
            hinted = self.reject_pause_s
        return min(hinted, self.reject_pause_s)


def retimed(
    record: RequestRecord, first_try: float | None, pause_statuses: tuple[int, ...]
) -> tuple[RequestRecord, float | None]:
    """The record timed from the first of the refused tries before it, and the first try still open."""
    if record.status in pause_statuses:
        return record, record.started if first_try is None else first_try
    if first_try is None:
        return record, None
    waited = record.started - first_try
    ttft = None if record.ttft_s is None else record.ttft_s + waited
    timed = dataclasses.replace(record, started=first_try, ttft_s=ttft, latency_s=record.latency_s + waited)
    return timed, None


class SimClock:
    """A simulator's clock and memory, or nothing if the target is not a simulator."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client
        self.is_sim = False
        self.speed = 1.0

    async def probe(self) -> bool:
        try:
            response = await self.client.get("/sim/stats")
            self.is_sim = response.status_code == 200 and "sim_time_s" in response.json()
            if self.is_sim:
                self.speed = float(response.json()["speed"])
        except (httpx.HTTPError, ValueError):
            self.is_sim = False
        return self.is_sim

    async def stats(self) -> dict[str, Any]:
        response = await self.client.get("/sim/stats")
        data: dict[str, Any] = response.json()
        return data

    async def reset(self) -> dict[str, Any]:
        data: dict[str, Any] = (await self.client.post("/sim/reset")).json()
        return data

    async def memory(self) -> dict[str, Any] | None:
        try:
            response = await self.client.get("/sim/memory")
        except httpx.HTTPError:
            return None
        if response.status_code != 200:
            return None
        data: dict[str, Any] = response.json()
        return data
