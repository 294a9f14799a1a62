"""Where one request's time goes inside the router, step by step (a profiling aid, not part of the product).

Runs ``macpool router`` with a timestamp taken at the start and end of each step of the request path, then,
when stopped (Ctrl-C), prints the median time between consecutive steps over the requests that took the
most common path. Meant for one client sending one request at a time (``bench overhead --levels 1`` or any
sequential client); with concurrent requests the steps of different requests interleave and the table
means nothing.

    .venv/bin/python docs/profiles/router_spans.py --redis-url redis://127.0.0.1:6379/0 --port 8080

Every argument is passed to ``macpool router``. Findings: docs/profiles/router-findings.md.
"""

from __future__ import annotations

import atexit
import collections
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

import macpool.corked as corked
import router.admission as admission
import router.app as app
import router.forward as forward

MARKS: list[tuple[str, int]] = []


def mark(label: str) -> None:
    MARKS.append((label, time.perf_counter_ns()))


def timed_async(owner: Any, name: str, label: str) -> None:
    original: Callable[..., Awaitable[Any]] = getattr(owner, name)

    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        mark(label + ">")
        try:
            return await original(*args, **kwargs)
        finally:
            mark(label + "<")

    setattr(owner, name, wrapper)


def timed(owner: Any, name: str, label: str) -> None:
    original: Callable[..., Any] = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        mark(label + ">")
        try:
            return original(*args, **kwargs)
        finally:
            mark(label + "<")

    setattr(owner, name, wrapper)


def instrument() -> None:
    arrived = HttpToolsProtocol.data_received

    def data_received(self: HttpToolsProtocol, data: bytes) -> None:
        if data.startswith(b"POST"):
            mark("request bytes")
        arrived(self, data)

    HttpToolsProtocol.data_received = data_received  # type: ignore[method-assign]
    written = corked.CorkedTransport.write

    def write(self: corked.CorkedTransport, data: bytes) -> None:
        if self._held is not None:
            mark("head + first bytes written")
        written(self, data)

    corked.CorkedTransport.write = write  # type: ignore[method-assign]
    timed_async(app.Router, "proxy", "proxy")
    timed_async(app, "_read_body", "read body")
    timed(app.Router, "_call", "build call")
    timed(app, "_inspect", "parse json")
    timed(app, "prefix_hashes", "prefix hashes")
    timed_async(forward.Forwarder, "handle", "handle")
    timed_async(admission.Admission, "_try", "reserve")
    timed(admission.Admission, "_lease", "lease")
    timed(forward.Forwarder, "_upstream_headers", "upstream headers")
    timed_async(forward.Forwarder, "_post", "send upstream, wait for the agent's head")
    timed_async(forward.Relay, "__call__", "relay")


def report() -> None:
    requests: list[list[tuple[str, int]]] = []
    for label, at in MARKS:
        if label == "request bytes":
            requests.append([])
        if requests:
            requests[-1].append((label, at))
    requests = requests[len(requests) // 10 :]  # the first tenth warms up
    paths = collections.Counter(tuple(label for label, _ in r) for r in requests)
    if not paths:
        print("no request seen", file=sys.stderr)
        return
    path, count = paths.most_common(1)[0]
    same = [r for r in requests if tuple(label for label, _ in r) == path]
    print(f"{count} of {len(requests)} requests took this path; median microseconds", file=sys.stderr)
    for i in range(1, len(path)):
        step = statistics.median((r[i][1] - r[i - 1][1]) / 1000 for r in same)
        total = statistics.median((r[i][1] - r[0][1]) / 1000 for r in same)
        line = f"{path[i - 1]:>28} -> {path[i]:<28} {step:8.1f}  (since arrival {total:8.1f})"
        print(line, file=sys.stderr)


if __name__ == "__main__":
    instrument()
    atexit.register(report)
    from router.cli import main

    sys.exit(main(sys.argv[1:]))
