"""The pool in this process: simulators, agents and routers served by uvicorn on free loopback ports, on one
event loop in a background thread.

For the tests where a separate process is not the point. A server here starts in milliseconds instead of an
interpreter's start, and the tests still talk HTTP over real sockets to the same applications, built from the
same command-line arguments, against the harness's real Redis. ``LocalStack`` has the starting and waiting
methods of the process harness (``Stack``), so ``tests.router.conftest.Pool`` runs on either.
What only a process shows (a kill, a signal, a restart, the CLI, log files, the real llama-server) stays on
the process harness.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
import uvicorn
from starlette.types import ASGIApp

from macpool.dev.stack import LOOPBACK, wait_nodes
from macpool.serving import server_config
from macpool.sim.cli import create as sim_app
from macpool.sim.cli import parse_settings as sim_settings
from macpool.sim.settings import Resolved
from node_agent.agent import Agent, bind_socket
from node_agent.cli import build_settings as agent_settings
from router.app import create_app as router_app
from router.app import with_cors
from router.cli import build_settings as router_settings

T = TypeVar("T")
STOP_TIMEOUT_S = 20.0  # an agent's shutdown alone is bounded at about 13 s of Redis, server and loop waits
_env_lock = threading.Lock()


@dataclass
class Served:
    """A server running in this process and where it serves (``url``, ``port``, as ``Proc``)."""

    name: str
    url: str
    port: int
    stop: Callable[[], None]  # begins its shutdown (on the loop, as a signal handler would)
    task: asyncio.Task[None]
    sock: socket.socket
    stopped: bool = False  # stopped by the test (``LocalStack.stop``), not on its own


class LocalStack:
    """Servers of one test on one event loop in a background thread; ``close`` (or leaving the ``with``)
    stops them all, then the loop."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="local-stack", daemon=True)
        self.thread.start()
        self.served: list[Served] = []
        self.llama_args: dict[str, list[str]] = {}  # a simulator's URL -> its shape as llama-server flags

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        """Run ``coro`` on the servers' loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    # --- starting ------------------------------------------------------------------------------------

    def serve(
        self, name: str, app: ASGIApp, *, port: int | None = None, ready: str | None = "/health",
        timeout: float = 30.0, keep_alive: int = 5, graceful_shutdown: int = 1, lifespan: str = "on",
    ) -> Served:
        """Serve ``app`` on loopback ``port`` (default: a free one); return once ``ready`` answers 200
        (None: once listening)."""
        sock = bind_socket(LOOPBACK, port or 0)
        port = sock.getsockname()[1]
        config = server_config(app, keep_alive=keep_alive, graceful_shutdown=graceful_shutdown,
                               lifespan=lifespan, log_level="warning", access_log=False)
        server = uvicorn.Server(config)

        async def start() -> asyncio.Task[None]:
            return asyncio.create_task(server.serve(sockets=[sock]), name=name)

        def stop() -> None:
            server.should_exit = True

        task = self.call(start())
        served = Served(name, f"http://{LOOPBACK}:{port}", port, stop, task, sock)
        self.served.append(served)
        self._wait(served, lambda: server.started, ready, timeout)
        return served

    def sim(self, name: str, *args: str, env: dict[str, str] | None = None, **options: Any) -> Served:
        """A simulated Mac, from ``macpool sim`` arguments; ``env``: MACPOOL_SIM_* variables; ``options``
        as for ``serve``."""
        with _environment(env):
            settings, _ = sim_settings(list(args))
        served = self.serve(name, sim_app(settings), **options)
        # an agent in this process cannot read a simulator's command line from the process on its port (it is
        # this one), as it reads a llama-server's: it is told it after --, as an operator tells an agent
        # attached to a llama-server it cannot see
        shape = Resolved(settings, settings.load_machine())
        cells = ["-np", str(shape.n_slots), "-c", str(shape.n_cells)]
        self.llama_args[served.url] = [*cells, "-kvu" if shape.kv_unified else "-no-kvu"]
        return served

    def router(
        self, name: str, redis_url: str, *args: str, env: dict[str, str] | None = None, **options: Any
    ) -> Served:
        """A router on ``redis_url``, from ``macpool router`` arguments; ``env``: MACPOOL_* variables."""
        with _environment(env):
            settings = router_settings(["--redis-url", redis_url, *args])
        app = with_cors(router_app(settings), settings.cors_origins)
        # at the end of a test, a connection the test left open is cut after 1 s (its shutdown timeout is
        # tested on a process): then the lifespan closes its Redis and upstream clients itself
        return self.serve(name, app, keep_alive=75, **options)

    def agent(
        self, name: str, upstream: str, redis_url: str, node_id: str, *args: str, **options: Any
    ) -> Served:
        """A node agent in front of ``upstream``, heartbeating ``node_id`` into ``redis_url``; in front of a
        simulator of this stack, told its llama-server arguments (``sim``)."""
        described = self.llama_args.get(upstream)
        if described and "--" not in args:
            args = (*args, "--", *described)
        argv = ("--upstream", upstream, "--redis-url", redis_url, "--node-id", node_id, *args)
        return self.agent_run(name, *argv, **options)

    def agent_run(
        self, name: str, *args: str, env: dict[str, str] | None = None, port: int | None = None,
        ready: str | None = "/health", timeout: float = 30.0,
    ) -> Served:
        """A node agent from ``macpool agent run`` arguments: its own lifecycle (startup, main loop, shutdown
        with its drain) without the signal handlers only a process has."""
        sock = bind_socket(LOOPBACK, port or 0)
        port = sock.getsockname()[1]
        with _environment(env):
            agent = Agent(agent_settings(["--host", LOOPBACK, "--port", str(port), *args]), sock)

        async def run() -> None:
            try:
                await agent.startup()
                await agent.main_loop()
            finally:
                await agent.shutdown()

        async def start() -> asyncio.Task[None]:
            return asyncio.create_task(run(), name=name)

        def stop() -> None:  # a signal, then a second one: no drain, as the process harness's SIGKILL
            agent.stop_requested.set()
            agent.force.set()

        task = self.call(start())
        served = Served(name, f"http://{LOOPBACK}:{port}", port, stop, task, sock)
        self.served.append(served)
        self._wait(served, lambda: agent.server is not None and agent.server.started, ready, timeout)
        return served

    def stop(self, served: Served) -> None:
        """Stop one server now: its port refuses connections from then on, as after its process ended."""

        async def stopped() -> None:
            served.stop()
            await asyncio.wait_for(asyncio.shield(served.task), STOP_TIMEOUT_S)

        served.stopped = True
        self.call(stopped(), timeout=STOP_TIMEOUT_S + 5)
        served.sock.close()

    # --- waiting -------------------------------------------------------------------------------------

    def wait_nodes(
        self, router_url: str, count: int, *, timeout: float = 30.0, exact: bool = False,
        key: str | None = None,
    ) -> dict[str, Any]:
        """Until the router at ``router_url`` sees ``count`` ready nodes; its ``/api/pool`` document."""
        self._check_running()
        return wait_nodes(router_url, count, timeout=timeout, exact=exact, key=key)

    def _wait(self, served: Served, listening: Callable[[], bool], ready: str | None, timeout: float) -> None:
        deadline = self.loop.time() + timeout
        with httpx.Client(timeout=2.0) as client:
            while self.loop.time() < deadline:
                self._check_running()
                if listening() and (ready is None or _answers(client, served.url + ready)):
                    return
                time.sleep(0.01)
        raise AssertionError(f"{served.name} did not serve within {timeout}s")

    def _check_running(self) -> None:
        """A server that ended on its own fails the test with its own error."""
        for served in self.served:
            if served.task.done() and not served.stopped:
                error = None if served.task.cancelled() else served.task.exception()
                raise AssertionError(f"{served.name} stopped on its own: {error!r}") from error

    # --- stopping ------------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop every server at once, as the process harness signals every process at once, and wait for
        each (bounded), then stop the loop; a server that failed fails the test."""
        try:
            self.call(self._stop_all(), timeout=STOP_TIMEOUT_S + 5)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(STOP_TIMEOUT_S)
            if not self.thread.is_alive():
                self.loop.close()
            for served in self.served:
                served.sock.close()

    async def _stop_all(self) -> None:
        for served in reversed(self.served):
            served.stop()
        tasks = [served.task for served in self.served]
        _, pending = await asyncio.wait(tasks, timeout=STOP_TIMEOUT_S) if tasks else (set(), set())
        rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        # where each task still running waits, taken before they are cancelled: what a stuck stop reports
        waiting = "\n".join(f" task {t.get_name()}:\n{_awaiting(t)}" for t in rest) if pending else ""
        for task in rest:  # what a stopped server left behind (a handler still streaming), and the stuck
            task.cancel()
        await asyncio.gather(*rest, return_exceptions=True)
        # as asyncio.run does: an async generator left unfinished (a stream a handler held) is closed here,
        # on a live loop, rather than by the garbage collector during some later test, its socket unclosed
        await asyncio.get_running_loop().shutdown_asyncgens()
        for served in self.served:
            if served.task in pending:
                raise AssertionError(f"{served.name} did not stop within {STOP_TIMEOUT_S}s; the tasks left "
                                     f"were waiting in:\n{waiting}")
            if served.task.cancelled():
                continue
            error = served.task.exception()
            if error is not None:
                raise AssertionError(f"{served.name} failed: {error!r}") from error

    def __enter__(self) -> LocalStack:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _awaiting(task: asyncio.Task[Any]) -> str:
    """Where a task waits: each coroutine of its await chain, innermost last (what a stuck stop reports)."""
    lines, awaited = [], task.get_coro()
    while awaited is not None and hasattr(awaited, "cr_frame"):
        frame = awaited.cr_frame
        if frame is not None:
            lines.append(f"  {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}")
        awaited = awaited.cr_await
    if awaited is not None:
        lines.append(f"  awaiting {awaited!r}")
    return "\n".join(lines)


def _answers(client: httpx.Client, url: str) -> bool:
    try:
        return client.get(url).status_code == 200
    except httpx.HTTPError:
        return False


@contextlib.contextmanager
def _environment(env: dict[str, str] | None) -> Iterator[None]:
    """``env`` in os.environ while a server's settings are built from it (they read it then, only)."""
    if not env:
        yield
        return
    with _env_lock:
        saved = {name: os.environ.get(name) for name in env}
        os.environ.update(env)
        try:
            yield
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
