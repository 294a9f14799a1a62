"""Shared pieces of the performance benches (overhead, relay, reject, peers, scale).

- ``FastUpstream``: a tiny HTTP/1.1 server (asyncio protocol + httptools) that answers OpenAI-shaped chat
  completions as fast as possible: SSE events written one per write, optionally paced, or a short JSON body.
  It can pose as ``N`` pool nodes (``/n{i}/v1/...``) and write their heartbeats, tracks in-flight requests per
  node and counts every time a node held more than its capacity (over-admission). The simulator models a
  Mac's physics; this upstream exists so that the *router* is what a relay benchmark measures.
  Run it as ``python -m bench.perfkit upstream --port P ...``.
- ``raw_load``: a closed-loop HTTP/1.1 load client on raw asyncio protocols (keep-alive, no JSON parsing),
  cheap enough that one core drives a router core to saturation. It records status, time to the first SSE
  event, latency and the number of SSE events and body reads of every request.
- ``Stack``: the real processes of one run (Redis-protocol server, upstreams, simulators, agents, routers,
  peers) on the process harness (``macpool.stack``), optionally pinned to a CPU with ``taskset``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar, cast

import httptools
import psutil

from macpool.contract import NodeDoc, heartbeat_ttl_ms, now_ms
from macpool.stack import Proc as Proc
from macpool.stack import Stack as ProcStack
from macpool.stack import free_port
from macpool.stack import wait_nodes as wait_nodes
from macpool.store import Store

MODEL = "sim"
_MAX_TOKENS = re.compile(rb'"max_tokens":\s*(\d+)')
LOOP = "127.0.0.1"

# --- statistics --------------------------------------------------------------------------------------


def pct(values: Sequence[float], p: float) -> float | None:
    """The ``p``-th percentile (nearest rank) of ``values``, or None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(p / 100.0 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def ms(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value * 1000.0, digits)


def med(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def shares(total: int, parts: int) -> list[int]:
    """``total`` (clients, streams) in ``parts`` shares as equal as can be."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


# --- the fast upstream ------------------------------------------------------------------------------


def sse_event(text: str = "tok", finish: str | None = None) -> bytes:
    chunk = {
        "id": "chatcmpl-bench",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": MODEL,
        "choices": [
            {"index": 0, "delta": {"content": text} if finish is None else {}, "finish_reason": finish}
        ],
    }
    return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"


def _chunk_frame(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def completion_body(tokens: int) -> bytes:
    return json.dumps(
        {
            "id": "chatcmpl-bench",
            "object": "chat.completion",
            "created": 0,
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "tok " * tokens},
                    "finish_reason": "length",
                }
            ],
            "usage": {"prompt_tokens": 8, "completion_tokens": tokens, "total_tokens": 8 + tokens},
        },
        separators=(",", ":"),
    ).encode()


@dataclass
class UpstreamConfig:
    events: int = 100  # content events per stream
    interval_s: float = 0.0  # pause after each event (0: yield to the loop every event)
    first_delay_s: float = 0.0  # before the response head
    capacity: int = 0  # per node; 0 = unlimited (no over-admission accounting)
    nodes: int = 1
    tokens: int = 16  # non-streaming completion size
    events_from_body: bool = False  # a request's ``max_tokens`` sets its number of events


@dataclass
class NodeStats:
    in_flight: int = 0
    max_in_flight: int = 0
    over_capacity: int = 0  # requests that arrived while the node already held ``capacity``
    served: int = 0


class FastUpstream:
    def __init__(self, config: UpstreamConfig) -> None:
        self.config = config
        self.stats: dict[str, NodeStats] = {}
        self.event = _chunk_frame(sse_event())
        done = _chunk_frame(b"data: [DONE]\n\n")
        self.tail = _chunk_frame(sse_event(finish="length")) + done + b"0\r\n\r\n"
        self.json_body = completion_body(config.tokens)

    def node(self, name: str) -> NodeStats:
        stats = self.stats.get(name)
        if stats is None:
            stats = self.stats[name] = NodeStats()
        return stats

    def stats_json(self) -> dict[str, Any]:
        nodes = {k: vars(v) for k, v in sorted(self.stats.items())}
        return {
            "nodes": nodes,
            "capacity": self.config.capacity,
            "max_in_flight": max((v.max_in_flight for v in self.stats.values()), default=0),
            "over_capacity": sum(v.over_capacity for v in self.stats.values()),
            "served": sum(v.served for v in self.stats.values()),
        }


class _ServerConn(asyncio.Protocol):
    def __init__(self, server: FastUpstream) -> None:
        self.server = server
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.body: list[bytes] = []
        self.closed = False
        self.writable = asyncio.Event()
        self.writable.set()
        self.counted: NodeStats | None = None  # the node this connection's request is counted against

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.writable.set()
        self.finish()  # the request ends when its connection does, not at the stream's next write

    def finish(self) -> None:
        if self.counted is not None:
            self.counted.in_flight -= 1
            self.counted = None

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self.transport is not None:
                self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        method = self.parser.get_method()
        path = self.url.split(b"?", 1)[0]
        body = b"".join(self.body)
        self.url, self.body = b"", []
        asyncio.get_running_loop().create_task(self.handle(method, path, body))

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.closed:
            self.transport.write(data)

    def respond(self, status: str, body: bytes, content_type: bytes = b"application/json") -> None:
        self.write(
            b"HTTP/1.1 "
            + status.encode()
            + b"\r\ncontent-type: "
            + content_type
            + b"\r\ncontent-length: "
            + str(len(body)).encode()
            + b"\r\n\r\n"
            + body
        )

    async def handle(self, method: bytes, path: bytes, body: bytes) -> None:
        if method == b"GET" and path in (b"/health", b"/v1/health"):
            self.respond("200 OK", b'{"status":"ok"}')
            return
        if method == b"GET" and path.endswith(b"/models"):
            data = {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "bench"}]}
            self.respond("200 OK", json.dumps(data).encode())
            return
        if method == b"GET" and path == b"/stats":
            self.respond("200 OK", json.dumps(self.server.stats_json()).encode())
            return
        if method == b"POST" and path == b"/reset":
            self.server.stats.clear()
            self.respond("200 OK", b"{}")
            return
        if method != b"POST" or not path.endswith(b"completions"):
            self.respond("404 Not Found", b'{"error":{"message":"not found","code":404}}')
            return
        parts = path.split(b"/")
        name = parts[1].decode() if len(parts) > 2 and parts[1].startswith(b"n") else "n"
        config = self.server.config
        stats = self.server.node(name)
        if config.capacity and stats.in_flight >= config.capacity:
            stats.over_capacity += 1
        stats.in_flight += 1
        stats.max_in_flight = max(stats.max_in_flight, stats.in_flight)
        self.counted = stats
        try:
            if config.first_delay_s:
                await asyncio.sleep(config.first_delay_s)
            if b'"stream":true' in body or b'"stream": true' in body:
                events = config.events
                if config.events_from_body:
                    found = _MAX_TOKENS.search(body)
                    events = int(found.group(1)) if found else events
                await self.stream(config, events)
            else:
                self.respond("200 OK", self.server.json_body)
            stats.served += 1
        finally:
            self.finish()

    async def stream(self, config: UpstreamConfig, events: int) -> None:
        self.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        event = self.server.event
        interval = config.interval_s
        for _ in range(events):
            if self.closed:
                return
            self.write(event)
            if not self.writable.is_set():
                await self.writable.wait()
            await asyncio.sleep(interval)
        self.write(self.server.tail)


async def _heartbeats(
    redis_url: str, upstream: FastUpstream, port: int, prefix: str, stop: asyncio.Event
) -> None:
    from redis.asyncio import Redis

    config = upstream.config
    redis = Redis.from_url(redis_url)
    store = Store(redis)
    started = now_ms()
    names = [f"{prefix}{i}" for i in range(config.nodes)]
    try:
        while not stop.is_set():
            for i, name in enumerate(names):
                doc = NodeDoc(
                    node_id=name,
                    url=f"http://{LOOP}:{port}/n{i}",
                    models=[MODEL],
                    capacity=config.capacity or 1_000_000,
                    total_slots=config.capacity or 1_000_000,
                    state="ready",
                    reason="bench upstream",
                    agent_version="bench",
                    started_at_ms=started,
                    updated_at_ms=now_ms(),
                )
                await store.heartbeat(doc, heartbeat_ttl_ms(1.0))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
    finally:
        with contextlib.suppress(Exception):
            for name in names:
                await store.deregister(name)
        await redis.aclose()


async def serve_upstream(port: int, config: UpstreamConfig, redis_url: str | None, prefix: str) -> None:
    loop = asyncio.get_running_loop()
    upstream = FastUpstream(config)
    server = await loop.create_server(lambda: _ServerConn(upstream), LOOP, port, backlog=4096)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    beats = asyncio.create_task(_heartbeats(redis_url, upstream, port, prefix, stop)) if redis_url else None
    try:
        await stop.wait()
    finally:
        server.close()
        if beats is not None:
            stop.set()
            await beats


def upstream_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.perfkit upstream")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--events", type=int, default=100)
    p.add_argument("--interval-ms", type=float, default=0.0)
    p.add_argument("--first-delay-ms", type=float, default=0.0)
    p.add_argument("--capacity", type=int, default=0)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--redis-url", help="write heartbeats for the nodes (/n0 .. /n{N-1}) into this pool")
    p.add_argument("--node-prefix", default="fast-")
    p.add_argument("--events-from-body", action="store_true", help="a request's max_tokens = its events")
    a = p.parse_args(argv)
    config = UpstreamConfig(
        a.events,
        a.interval_ms / 1000.0,
        a.first_delay_ms / 1000.0,
        a.capacity,
        a.nodes,
        a.tokens,
        a.events_from_body,
    )
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve_upstream(a.port, config, a.redis_url, a.node_prefix))
    return 0


# --- the raw load client ----------------------------------------------------------------------------


@dataclass
class Rec:
    status: int  # 0: connection failed
    latency_s: float
    ttft_s: float | None  # first SSE event (streams) / first body byte
    events: int = 0  # "data: " occurrences in the body
    reads: int = 0  # body pieces received (how coalesced the events arrived)
    retry_after: bool = False
    reason: str = ""


class _ClientConn(asyncio.Protocol):
    def __init__(self, tally: list[int] | None = None) -> None:
        self.tally = tally if tally is not None else [0, 0]
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.done: asyncio.Future[Rec] | None = None
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._reset(0.0)

    def _reset(self, started: float) -> None:
        self.started = started
        self.first: float | None = None
        self.events = 0
        self.reads = 0
        self.carry = b""
        self.header = b""
        self.retry_after = False
        self.reason = ""
        self.keep_alive = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.lost.done():
            self.lost.set_result(None)
        if self.done is not None and not self.done.done():
            self.done.set_result(Rec(0, time.perf_counter() - self.started, None))

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self.transport is not None:
                self.transport.close()

    def on_header(self, name: bytes, value: bytes) -> None:
        lname = name.lower()
        if lname == b"retry-after":
            self.retry_after = True
        elif lname == b"x-macpool-reason":
            self.reason = value.decode()

    def on_body(self, body: bytes) -> None:
        if self.first is None:
            self.first = time.perf_counter()
        self.reads += 1
        joined = self.carry + body
        found = joined.count(b"data: ")
        self.events += found
        self.tally[0] += found
        self.tally[1] += 1
        self.carry = joined[-5:]

    def on_message_complete(self) -> None:
        now = time.perf_counter()
        # only valid here: once the message is complete the parser resets and reports False
        self.keep_alive = self.parser.should_keep_alive()
        ttft = None if self.first is None else self.first - self.started
        rec = Rec(
            self.parser.get_status_code(),
            now - self.started,
            ttft,
            self.events,
            self.reads,
            self.retry_after,
            self.reason,
        )
        if self.done is not None and not self.done.done():
            self.done.set_result(rec)

    async def request(self, raw: bytes) -> Rec:
        assert self.transport is not None
        self._reset(time.perf_counter())
        self.done = asyncio.get_running_loop().create_future()
        self.transport.write(raw)
        return await self.done


def build_request(path: str, body: bytes, headers: dict[str, str] | None = None) -> bytes:
    head = f"POST {path} HTTP/1.1\r\nhost: {LOOP}\r\ncontent-type: application/json\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    head += f"content-length: {len(body)}\r\n\r\n"
    return head.encode() + body


def chat_json(stream: bool, max_tokens: int = 16, prompt_tokens: int = 16, salt: str = "") -> bytes:
    from simulator import tokens as sim_tokens

    return json.dumps(
        {
            "model": MODEL,
            "messages": sim_tokens.chat_messages(prompt_tokens, salt=salt or "bench"),
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": stream,
        }
    ).encode()


async def raw_load(
    port: int,
    make_request: Callable[[int], bytes],
    concurrency: int,
    duration_s: float | None = None,
    requests: int | None = None,
    host: str = LOOP,
    warmup_s: float = 0.0,
    tally: list[int] | None = None,
    request_timeout: float = 120.0,
    stagger_s: float = 0.0,
) -> list[Rec]:
    """``concurrency`` keep-alive connections in a closed loop; records requests started after warm-up.

    ``tally`` (``[events, body reads]``) is incremented live, for callers that sample rates over a window.
    ``stagger_s`` spreads the connections' first requests evenly over that many seconds: streams of equal
    length started together would otherwise end together and arrive again as one burst, every time.
    """
    loop = asyncio.get_running_loop()
    records: list[Rec] = []
    start = time.perf_counter()
    measure_from = start + warmup_s
    deadline = None if duration_s is None else measure_from + duration_s
    budget = [requests if requests is not None else -1]

    async def connect() -> _ClientConn:
        _, conn = await loop.create_connection(lambda: _ClientConn(tally), host, port)
        return conn

    async def worker(index: int) -> None:
        conn: _ClientConn | None = None
        if stagger_s:
            await asyncio.sleep(stagger_s * index / concurrency)
        try:
            while True:
                now = time.perf_counter()
                if deadline is not None and now >= deadline:
                    return
                if budget[0] == 0:
                    return
                if budget[0] > 0:
                    budget[0] -= 1
                if conn is None or conn.lost.done():
                    try:
                        conn = await connect()
                    except OSError:
                        records.append(Rec(0, 0.0, None))
                        await asyncio.sleep(0.01)
                        continue
                try:
                    rec = await asyncio.wait_for(conn.request(make_request(index)), request_timeout)
                except TimeoutError:
                    rec = Rec(0, request_timeout, None)
                    if conn.transport is not None:
                        conn.transport.close()
                if now >= measure_from:
                    records.append(rec)
                if not conn.keep_alive and conn.transport is not None:
                    conn.transport.close()
                    conn = None
        finally:
            if conn is not None and conn.transport is not None:
                conn.transport.close()

    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    return records


def run_load(*args: Any, **kwargs: Any) -> tuple[list[Rec], float]:
    """``raw_load`` on a fresh uvloop (when present); returns the records and the measured wall seconds."""
    try:
        import uvloop

        runner: Callable[[Any], Any] = uvloop.run
    except ImportError:
        runner = asyncio.run
    started = time.perf_counter()
    records: list[Rec] = runner(raw_load(*args, **kwargs))
    wall = time.perf_counter() - started - float(kwargs.get("warmup_s", 0.0))
    return records, wall


_T = TypeVar("_T")


def take_turns(names: Sequence[str], rounds: int, measure: Callable[[str], _T]) -> list[dict[str, _T]]:
    """``measure`` each of ``names`` in turn, ``rounds`` times, the order reversed every other round: a drift
    of the machine during the run falls on every path alike, where measuring each path's whole share in one
    go let it fall on one. One dict (name -> result) per round."""
    turns: list[dict[str, _T]] = []
    for turn in range(max(rounds, 1)):
        order = list(names) if turn % 2 == 0 else list(reversed(names))
        turns.append({name: measure(name) for name in order})
    return turns


def summarize(records: list[Rec]) -> dict[str, Any]:
    ok = [r for r in records if r.status == 200]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    lat = [r.latency_s for r in ok]
    return {
        "requests": len(records),
        "ok": len(ok),
        "errors": len(records) - len(ok),
        "ttft_p50_ms": ms(pct(ttft, 50)),
        "ttft_p99_ms": ms(pct(ttft, 99)),
        "latency_p50_ms": ms(pct(lat, 50)),
        "latency_p99_ms": ms(pct(lat, 99)),
    }


async def measured_chat_load(
    port: int, pid: int, stream: bool, concurrency: int, warmup: float, duration: float
) -> tuple[list[Rec], float, float]:
    """Closed-loop chat requests at ``port`` for ``duration`` s after ``warmup`` s: the records, and the CPU
    seconds process ``pid`` used and the wall seconds that passed over the measured window."""
    raw = build_request("/v1/chat/completions", chat_json(stream=stream))
    load = asyncio.create_task(
        raw_load(port, lambda _: raw, concurrency, duration_s=duration, warmup_s=warmup)
    )
    await asyncio.sleep(warmup)
    cpu0, t0 = cpu_seconds(pid), time.perf_counter()
    records = await load
    return records, cpu_seconds(pid) - cpu0, time.perf_counter() - t0


# --- processes ---------------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """user + system CPU seconds of a process (all its threads)."""
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of a process and all its descendants (nginx's workers, LiteLLM's server process)."""
    try:
        root = psutil.Process(pid)
        family = [root, *root.children(recursive=True)]
    except psutil.Error:  # ended already: nothing left to count
        return 0.0
    total = 0.0
    for process in family:
        with contextlib.suppress(psutil.Error):  # a descendant that ended meanwhile
            times = process.cpu_times()
            total += times.user + times.system
    return total


def cpus() -> list[int]:
    """The CPUs this process may run on (every CPU where the system does not say: macOS)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def pinned(argv: list[str], cpu: int | None) -> list[str]:
    if cpu is None or shutil.which("taskset") is None:
        return argv
    return ["taskset", "-c", str(cpu), *argv]


def pin_self(cpu: int | None) -> None:
    """Keep this process (the load client) off the router's core."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})


def ensure_deb(command: str, package: str, install: bool) -> str:
    """The path of ``command``, installing Debian's ``package`` (apt-get) first when it is missing."""

    def found() -> str | None:
        return shutil.which(command) or next(
            (str(p) for p in (Path("/usr/sbin") / command, Path("/usr/bin") / command) if p.exists()), None
        )

    path = found()
    if path is None and install and shutil.which("apt-get"):
        print(f"installing {package} (apt-get install -y {package}) ...", file=sys.stderr, flush=True)
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        if subprocess.run(["apt-get", "install", "-y", "-q", package], env=env, check=False).returncode:
            subprocess.run(["apt-get", "update", "-q"], env=env, check=False)
            subprocess.run(["apt-get", "install", "-y", "-q", package], env=env, check=False)
        path = found()
    if path is None:
        raise RuntimeError(f"{command} is not installed; `apt-get install -y {package}` did not install it")
    return path


def core_plan() -> tuple[int | None, int | None]:
    """(router core, everything-else core) on a machine with >= 2 cores, else (None, None)."""
    available = cpus()
    if len(available) < 2:
        return None, None
    return available[0], available[1]


def run_and_report(
    run: Callable[[Stack, Callable[[str], None]], dict[str, Any]],
    table: Callable[[dict[str, Any]], str],
    logs: Path | None,
    json_path: Path | None,
    details: tuple[str, ...],
) -> int:
    """A bench command's tail: run it on a fresh Stack (its logs kept in ``logs`` if given), print the table
    and the one-line summary (the result without ``details``), write the whole result to ``json_path``."""
    if logs:
        logs.mkdir(parents=True, exist_ok=True)
    with Stack(logs=logs, keep_logs=True) if logs else Stack() as stack:
        result = run(stack, lambda line: print(line, file=sys.stderr, flush=True))
    print(table(result))
    print(json.dumps({k: v for k, v in result.items() if k not in details}))
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=2) + "\n")
    return 0


class Stack:
    """Every process of one benchmark run, on the process harness (``macpool.stack``): the bench's own
    upstream, and simulators, agents and routers pinned to a CPU with ``taskset`` where a bench asks."""

    def __init__(self, logs: Path | None = None, keep_logs: bool = False) -> None:
        self.procs = ProcStack(keep_logs=keep_logs) if logs is None else ProcStack(logs, keep_logs=keep_logs)

    @property
    def logs(self) -> Path:
        return self.procs.logs

    @property
    def keep_logs(self) -> bool:
        return self.procs.keep_logs

    @keep_logs.setter
    def keep_logs(self, keep: bool) -> None:
        self.procs.keep_logs = keep

    def start_redis(self) -> str:
        return self.procs.redis()

    def spawn(
        self,
        name: str,
        argv: list[str],
        port: int,
        ready: str = "/health",
        timeout: float = 60.0,
        env: dict[str, str] | None = None,
    ) -> Proc:
        return self.procs.spawn(name, argv, port, ready=ready, timeout=timeout, env=env)

    def upstream(
        self,
        name: str,
        config: UpstreamConfig,
        redis_url: str | None = None,
        prefix: str = "fast-",
        cpu: int | None = None,
    ) -> Proc:
        port = free_port()
        argv = [
            sys.executable, "-m", "bench.perfkit", "upstream", "--port", str(port),
            "--events", str(config.events), "--interval-ms", str(config.interval_s * 1000),
            "--first-delay-ms", str(config.first_delay_s * 1000), "--capacity", str(config.capacity),
            "--nodes", str(config.nodes), "--tokens", str(config.tokens), "--node-prefix", prefix,
        ]
        if redis_url:
            argv += ["--redis-url", redis_url]
        if config.events_from_body:
            argv.append("--events-from-body")
        return self.spawn(name, pinned(argv, cpu), port)

    def sim(self, name: str, machine: Path, parallel: int, speed: float, cpu: int | None = None) -> Proc:
        return self.procs.sim(
            name, "--machine", str(machine), "--parallel", str(parallel), "--speed", str(speed),
            "--alias", MODEL, prefix=pinned([], cpu),
        )

    def agent(
        self, name: str, upstream: str, redis_url: str, node_id: str, cap: int, cpu: int | None = None
    ) -> Proc:
        return self.procs.agent(
            name, upstream, redis_url, node_id, "--cap", str(cap), "--log-level", "warning",
            prefix=pinned([], cpu),
        )

    def router(self, name: str, redis_url: str, *extra: str, cpu: int | None = None) -> Proc:
        return self.procs.router(name, redis_url, "--log-level", "warning", *extra, prefix=pinned([], cpu))

    def close(self) -> None:
        self.procs.stop()

    def __enter__(self) -> Stack:
        self.procs.__enter__()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.procs.__exit__(exc_type, exc, tb)


# A machine for overhead runs: the seed box's decode speed, but memory so roomy that hundreds of
# concurrent short requests never page (the bench measures the proxy, not the Mac).
FAST_MACHINE: dict[str, Any] = {
    "name": "bench-fast",
    "description": "roomy machine for proxy-overhead benchmarks",
    "model_name": "model-bench.gguf",
    "total_gb": 4096,
    "wired_limit_gb": 4000,
    "weights_gb": 1.0,
    "base_gb": 0.1,
    "seq_overhead_gb": 0.001,
    "kv_mb_per_token": 0.001,
    "decode_t0_ms": 9.24,
    "decode_t1_ms": 0.05,
    "prefill_tok_s": 100000,
    "paging_scale_gb": 3.5,
    "paging_exponent": 1.3,
    "collapse_overflow_gb": 8.0,
    "ctx_per_slot": 2048,
    "default_parallel": 8,
    "typical_prompt_tokens": 64,
    "typical_output_tokens": 16,
    "default_n_predict": 16,
}


def write_machine(folder: Path) -> Path:
    path = folder / "bench-fast.json"
    path.write_text(json.dumps(FAST_MACHINE))
    return path


def dump(data: dict[str, Any], path: Path | None) -> None:
    text = json.dumps(data, indent=2)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    print(text)


@contextlib.contextmanager
def cpu_window(pid: int) -> Iterator[dict[str, float]]:
    """CPU seconds a process used and the wall seconds elapsed inside the block."""
    out: dict[str, float] = {}
    cpu0, wall0 = cpu_seconds(pid), time.perf_counter()
    try:
        yield out
    finally:
        out["cpu_s"] = cpu_seconds(pid) - cpu0
        out["wall_s"] = time.perf_counter() - wall0


def plot(folder: Path, out: Path) -> None:
    """One figure from the JSON files the benches wrote into ``folder`` (whichever exist)."""
    from macpool import plotting

    plt = plotting.pyplot()

    def load(name: str) -> dict[str, Any] | None:
        path = folder / f"{name}.json"
        return json.loads(path.read_text()) if path.exists() else None

    overhead, peers, relay = load("overhead"), load("peers"), load("relay")
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    ax = axes[0]
    if overhead:
        levels = sorted(overhead["levels"], key=int)
        xs = [int(x) for x in levels]
        for key, label in (("ttft_added", "router + agent"), ("router_only_ttft_added", "router only")):
            for q, style in (("p50", "-o"), ("p99", "--o")):
                ys = [overhead["levels"][lv].get(f"{key}_{q}_ms") for lv in levels]
                ax.plot(
                    xs, [max(y, 0.01) if y is not None else None for y in ys], style, label=f"{label} {q}"
                )
        ax.axhline(1.0, color="green", lw=0.8, ls=":", label="target p50 1 ms")
        ax.axhline(5.0, color="red", lw=0.8, ls=":", label="target p99 5 ms")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel("added TTFT (ms)")
        ax.set_title("bench overhead: added TTFT vs direct")
        ax.legend(fontsize=7)
    ax = axes[1]
    if peers:
        levels = sorted(peers["ttft"], key=int)
        width = 0.25
        for i, name in enumerate(("macpool", "nginx", "litellm")):
            raw = [peers["ttft"][lv][name].get("ttft_added_p50_ms") for lv in levels]
            bar_x = [j + (i - 1) * width for j in range(len(levels))]
            ys = [float("nan") if y is None else max(y, 0.01) for y in raw]
            ax.bar(bar_x, ys, width, label=name, color=f"C{i}")
            for x, y in zip(bar_x, raw, strict=True):
                label = "n/a" if y is None else ("<=0" if y <= 0 else "")
                if label:
                    ax.text(x, 0.012, label, ha="center", va="bottom", fontsize=7, rotation=90)
        ax.set_xticks(range(len(levels)), [f"{lv} streams" for lv in levels])
        ax.set_yscale("log")
        ax.set_ylabel("added TTFT p50 (ms)")
        ax.set_title("bench peers: added TTFT (same run, same nodes)")
        ax.legend(fontsize=8)
    ax = axes[2]
    bars: dict[str, float] = {}
    if peers:
        for name, row in peers["relay"].items():
            if row.get("chunks_per_cpu_s"):
                bars[f"{name}\n(peers)"] = row["chunks_per_cpu_s"]
    if relay and relay.get("chunks_per_s"):
        bars["macpool\n(relay)"] = relay["chunks_per_s"]
    if bars:
        ax.bar(list(bars), list(bars.values()), color=["C0", "C1", "C2", "C0"][: len(bars)])
        ax.axhline(20_000, color="red", lw=0.8, ls=":", label="target 20,000/s per core")
        ax.set_yscale("log")
        ax.set_ylabel("SSE chunks per CPU-second")
        ax.set_title("relay rate per proxy core")
        ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> int:
    if argv and argv[0] == "upstream":
        return upstream_main(argv[1:])
    if argv and argv[0] == "plot" and len(argv) == 3:
        plot(Path(argv[1]), Path(argv[2]))
        return 0
    print(
        "usage: python -m bench.perfkit upstream --port P [...] | plot RESULTS_DIR OUT.png", file=sys.stderr
    )
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
