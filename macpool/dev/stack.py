"""One process harness for the demo, the benchmarks and the tests: a pool of real processes on loopback.

``Stack`` starts a Redis-protocol server (or takes a given URL), simulators, agents, routers and any other
server on free ports, each in its own process group with its log in one folder; waits until each serves
and until a router sees its nodes; and stops them all with a bound: router first, Redis last, a second
Ctrl-C or SIGTERM kills what is left at once. Used as a context manager in the main thread, it turns
SIGTERM into ``SystemExit`` so that the processes are stopped then too.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import ssl
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import httpx

from macpool.dev.procs import Child, ProcessError, macpool_argv
from macpool.dev.redis_server import RedisServer, free_port

LOOPBACK = "127.0.0.1"
STOP_TIMEOUT_S = 10.0
PORT_ATTEMPTS = 3  # a server whose port was taken before it bound it starts again on another


@dataclass
class Proc:
    """A started process and where it serves."""

    child: Child
    url: str
    port: int
    ready_url: str | None = None
    verify: ssl.SSLContext | bool = True  # how an https:// process is checked (its CA, a client certificate)

    @property
    def name(self) -> str:
        return self.child.name

    @property
    def pid(self) -> int:
        return self.child.pid

    @property
    def log_path(self) -> Path | None:
        return self.child.log_path


@dataclass
class Stack:
    """The processes of one pool, in start order; ``stop`` (or leaving the ``with``) ends them all.

    ``logs`` is the folder of the per-process logs (a new temporary one by default; removed on a clean exit
    unless ``keep_logs``). ``stop_timeout`` bounds each process's graceful stop. ``clean_env`` drops every
    ``MACPOOL_*`` variable of this shell from the children's environment, so that they are exactly what
    their arguments say.
    """

    logs: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="macpool-stack-")))
    keep_logs: bool = False
    clean_env: bool = False
    stop_timeout: float = STOP_TIMEOUT_S
    procs: list[Proc] = field(default_factory=list)
    redis_servers: list[RedisServer] = field(default_factory=list)
    _closed: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _previous_sigterm: Any = None

    # --- starting ------------------------------------------------------------------------------------

    def redis(self, url: str = "", password: str | None = None) -> str:
        """``url`` when given, else the URL of a new embedded Redis-protocol server on a free port."""
        if url:
            return url
        with self._lock:  # a stop from another thread waits for a starting server, then stops it
            self._check_open()
            server = RedisServer(password=password)
            self.redis_servers.append(server)
            server.start()
        return server.url

    def spawn(
        self,
        name: str,
        argv: list[str],
        port: int,
        *,
        ready: str | None = "/health",
        wait: bool = True,
        timeout: float = 60.0,
        env: dict[str, str] | None = None,
        host: str = LOOPBACK,
        log_path: Path | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> Proc:
        """Start ``argv`` (which serves HTTP on ``host``:``port``, or HTTPS checked with ``tls``); unless
        ``wait`` is false, return once ``ready`` answers 200 (``ready=None``: do not wait at all). Its output
        goes to ``log_path``, by default ``<name>.log`` in ``logs``."""
        with self._lock:
            self._check_open()
            log_path = log_path or self._log_path(name, port)
            child = Child(argv, name=name, env=env, log_path=log_path)
            if self.clean_env:
                inherited = {k: v for k, v in os.environ.items() if not k.startswith("MACPOOL_")}
                child.env = {**inherited, **(env or {})}
            url = f"{'http' if tls is None else 'https'}://{host}:{port}"
            ready_url = None if ready is None else url + ready
            proc = Proc(child, url, port, ready_url, True if tls is None else tls)
            self.procs.append(proc)
            child.start()
        if wait:
            self.wait_serving(proc, timeout=timeout)
        return proc

    def macpool(
        self,
        name: str,
        *args: str,
        port: int | None = None,
        prefix: Sequence[str] = (),
        **options: Any,
    ) -> Proc:
        """Start ``macpool <args> --port P`` (``prefix`` goes before the interpreter, e.g. ``taskset -c 1``);
        ``options`` as for ``spawn``."""
        def start(at: int) -> Proc:
            return self.spawn(name, [*prefix, *macpool_argv(*args, "--port", str(at))], at, **options)

        return start(port) if port is not None else self.on_free_port(start)

    def on_free_port(self, start: Callable[[int], Proc]) -> Proc:
        """``start(port)`` on a free port, and on another when a process took that one first (``start``
        waits until its process serves, or an exit for that reason goes unseen)."""
        for _ in range(PORT_ATTEMPTS - 1):
            port = free_port()
            try:
                return start(port)
            except ProcessError as exc:
                # another process bound the port between free_port and the child's bind: try a new one
                if "address already in use" not in str(exc).lower():
                    raise
                with self._lock:
                    self.procs = [p for p in self.procs if p.port != port]
        return start(free_port())

    def sim(self, name: str, *args: str, **options: Any) -> Proc:
        """A simulated Mac: ``macpool sim <args>``."""
        return self.macpool(name, "sim", *args, **options)

    def agent(
        self, name: str, upstream: str, redis_url: str, node_id: str, *args: str, **options: Any
    ) -> Proc:
        """A node agent in front of ``upstream``, heartbeating ``node_id`` into ``redis_url``."""
        return self.macpool(
            name, "agent", "run", "--upstream", upstream, "--redis-url", redis_url, "--node-id", node_id,
            *args, **options,
        )

    def router(self, name: str, redis_url: str, *args: str, **options: Any) -> Proc:
        """A router on ``redis_url``."""
        return self.macpool(name, "router", "--redis-url", redis_url, *args, **options)

    def autoscale(self, name: str, redis_url: str, *args: str, **options: Any) -> Proc:
        """``macpool autoscale`` on ``redis_url``; it serves no HTTP, so it is started, not waited for."""
        argv = macpool_argv("autoscale", "--redis-url", redis_url, *args)
        return self.spawn(name, argv, 0, ready=None, **options)

    # --- waiting -------------------------------------------------------------------------------------

    def wait_serving(self, *procs: Proc, timeout: float = 60.0) -> None:
        """Until each of ``procs`` (default: every process started so far) answers its ready path."""
        for proc in procs or tuple(self.procs):
            if proc.ready_url is None:
                continue
            try:
                proc.child.wait_http(proc.ready_url, timeout=timeout, verify=proc.verify)
            except ProcessError as exc:
                raise ProcessError(f"{proc.name} did not start (log: {proc.log_path}): {exc}") from None

    def wait_nodes(
        self, router_url: str, count: int, *, timeout: float = 60.0, exact: bool = False,
        key: str | None = None, verify: ssl.SSLContext | bool = True,
    ) -> dict[str, Any]:
        """``wait_nodes`` below, failing early when one of this stack's processes has exited."""
        return wait_nodes(router_url, count, timeout=timeout, exact=exact, stack=self, key=key, verify=verify)

    @property
    def stopped(self) -> bool:
        return self._closed

    def dead(self) -> list[Proc]:
        """The processes that exited on their own (not stopped or signalled through their ``Child``)."""
        return [p for p in list(self.procs) if not p.child.signalled and p.child.returncode() is not None]

    # --- stopping ------------------------------------------------------------------------------------

    def stop(self, timeout: float | None = None) -> None:
        """SIGTERM to every process at once (last started first: the router takes no new work while the
        agents leave the pool), wait up to ``timeout`` (default ``stop_timeout``) for each, then SIGKILL its
        group; Redis last. Interrupted (a second Ctrl-C or SIGTERM), it kills everything at once."""
        timeout = self.stop_timeout if timeout is None else timeout
        with self._lock:
            self._closed = True
            procs = list(reversed(self.procs))
            servers = list(self.redis_servers)
        try:
            for proc in procs:
                proc.child.signal(signal.SIGTERM)
            for proc in procs:
                proc.child.stop(timeout=timeout)
            for server in servers:
                server.close()
        except BaseException:
            self.kill()
            raise

    def kill(self) -> None:
        """SIGKILL every process group and Redis, without waiting for anything graceful."""
        self._closed = True
        for proc in list(self.procs):
            with contextlib.suppress(ProcessLookupError, PermissionError, ProcessError):
                proc.child.kill()
        for server in list(self.redis_servers):
            with contextlib.suppress(OSError):
                server.kill()
                server.close()

    def __enter__(self) -> Stack:
        if threading.current_thread() is threading.main_thread() and (
            signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        ):
            self._previous_sigterm = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            self.stop()
        finally:
            if self._previous_sigterm is not None:
                signal.signal(signal.SIGTERM, self._previous_sigterm)
                self._previous_sigterm = None
        if exc_type is None and not self.keep_logs:  # a failed run's logs stay for its error message
            shutil.rmtree(self.logs, ignore_errors=True)

    # --- helpers -------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ProcessError("the stack was stopped while starting")

    def _log_path(self, name: str, port: int) -> Path:
        self.logs.mkdir(parents=True, exist_ok=True)
        taken = {p.log_path for p in self.procs}
        path = self.logs / f"{name}.log"
        return path if path not in taken else self.logs / f"{name}-{port}.log"


def wait_nodes(
    router_url: str, count: int, *, timeout: float = 60.0, exact: bool = False, stack: Stack | None = None,
    key: str | None = None, verify: ssl.SSLContext | bool = True,
) -> dict[str, Any]:
    """Until the router at ``router_url`` sees ``count`` ready nodes (``exact``: exactly that many); returns
    its ``/api/pool`` document (read with ``key``, the router's read or admin key, when given; an https://
    router checked with ``verify``). With ``stack``, fails early when one of its processes has exited and
    gives up when it is stopped."""
    headers = {"Authorization": f"Bearer {key}"} if key else None
    deadline = time.monotonic() + timeout
    seen: object = None
    while time.monotonic() < deadline and not (stack is not None and stack.stopped):
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, TypeError):
            doc: dict[str, Any] = httpx.get(router_url + "/api/pool", headers=headers, timeout=5,
                                            verify=verify).json()
            seen = int(doc["pool"]["nodes_ready"])
            if seen == count or (seen > count and not exact):
                return doc
        dead = stack.dead() if stack is not None else []
        if dead:
            names = ", ".join(f"{p.name} (exit {p.child.returncode()}, log: {p.log_path})" for p in dead)
            raise ProcessError(f"waiting for {count} ready nodes at {router_url}: {names} exited")
        time.sleep(0.1)
    logs = f" (logs: {stack.logs})" if stack is not None else ""
    raise ProcessError(f"router {router_url} saw {seen} of {count} ready nodes within {timeout}s{logs}")


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


__all__ = ["LOOPBACK", "Proc", "ProcessError", "Stack", "free_port", "wait_nodes"]
