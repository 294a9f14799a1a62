"""Run llama-server on loopback, wait for it to be healthy, restart it on crash, stop it on every exit path.

llama-server runs in its own process group (so stopping it stops anything it started) and, on Linux,
with a parent-death signal, so even a ``kill -9`` of the agent leaves no orphan behind. It is spawned
with ``subprocess.Popen`` rather than the event loop's subprocess API: uvloop's spawn ignores
``close_fds`` and hands every inheritable descriptor of the agent down to llama-server.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_exponential_jitter

from macpool.dev.redis_server import free_port

log = logging.getLogger("macpool.agent")

STABLE_AFTER_S = 30.0  # a run this long starts the restart backoff again from its first, short wait
# llama-server flags whose value is a credential: /status needs no token, so it never shows them
# (--api-key-file names a path, which is no secret)
SECRET_FLAGS = frozenset({"--api-key", "--hf-token", "-hft"})
REDACTED = "<redacted>"


def redacted(argv: list[str]) -> list[str]:
    """``argv`` with the values of :data:`SECRET_FLAGS` replaced (``--api-key K`` and ``--api-key=K``)."""
    shown: list[str] = []
    value_next = False
    for arg in argv:
        name, equals, _ = arg.partition("=")
        if value_next:
            shown.append(REDACTED)
        elif equals and name in SECRET_FLAGS:
            shown.append(f"{name}={REDACTED}")
        else:
            shown.append(arg)
        value_next = arg in SECRET_FLAGS  # even as a value: hiding one argument too many leaks nothing
    return shown


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL me when the agent dies (Linux only)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class _Crashed(Exception):
    """llama-server exited on its own soon after it started."""

    def __init__(self, code: int) -> None:
        super().__init__(f"llama-server exited with {code}")


def _log_restart(state: RetryCallState) -> None:
    exc = state.outcome.exception() if state.outcome is not None else None
    delay = state.next_action.sleep if state.next_action is not None else 0.0
    log.warning("%s; restarting in %.1fs", exc, delay)


class Supervisor:
    """One supervised llama-server: ``on_healthy`` once it answers /health 200, ``on_exit`` when it exits.

    With ``model`` it serves that one GGUF; with ``preset`` (several models, node_agent/models.py) it runs
    in router mode over the models of that preset file, loading none until the agent asks.
    """

    def __init__(
        self,
        command: list[str],
        model: Path | None,
        parallel: int,
        ctx_per_slot: int,
        extra_args: list[str],
        log_path: Path | None = None,
        backoff_max: float = 30.0,
        on_healthy: Callable[[], None] | None = None,
        on_exit: Callable[[], None] | None = None,
        on_url: Callable[[str], None] | None = None,
        preset: Path | None = None,
    ) -> None:
        self.command = command
        self.preset = preset
        self.model = model
        self.parallel = parallel
        self.ctx_per_slot = ctx_per_slot
        self.extra_args = extra_args
        self.log_path = log_path
        self.backoff_max = backoff_max
        self.on_healthy = on_healthy
        self.on_exit = on_exit
        self.on_url = on_url
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self._exited: asyncio.Future[int] | None = None
        self.restarts = 0
        self._stopping = False
        self._resizing = False
        self._started_at = 0.0
        self.load_s: float | None = None  # from its last start until it answered /health

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def describe(self) -> dict[str, object]:
        pid = self.process.pid if self.process and self.process.returncode is None else None
        return {"pid": pid, "url": self.url, "restarts": self.restarts, "argv": redacted(self.argv())}

    def argv(self) -> list[str]:
        where = [*self.command, "--host", "127.0.0.1", "--port", str(self.port)]
        if self.preset is not None:
            # the agent alone decides what is loaded: no autoload, and no LRU of llama-server's own
            return [*where, "--models-preset", str(self.preset), "--no-models-autoload", "--models-max", "0",
                    "--metrics", *self.extra_args]
        return [
            *where,
            "--parallel",
            str(self.parallel),
            "--ctx-size",
            str(self.parallel * self.ctx_per_slot),
            "--metrics",
            "-m",
            str(self.model),
            *self._alias(),
            *self.extra_args,
        ]

    def _alias(self) -> list[str]:
        """Serve the model as its file name without ``.gguf`` unless the operator names it (``-- --alias X``).

        llama-server's default model id is the path as given, which clients should not have to know.
        """
        if {"-a", "--alias"} & set(self.extra_args) or self.model is None:
            return []
        name = Path(str(self.model)).name
        return ["--alias", name.removesuffix(".gguf")]

    async def run(self, client: httpx.AsyncClient) -> None:
        """Start, watch and restart until cancelled; the process is stopped on every exit path. Restarts
        after a crash back off (with jitter) up to ``backoff_max``; after a stable run, from the shortest."""
        wait = wait_exponential_jitter(multiplier=0.5, max=self.backoff_max, jitter=0.5)
        try:
            while not self._stopping:
                async for attempt in AsyncRetrying(wait=wait, retry=retry_if_exception_type(_Crashed),
                                                   before_sleep=_log_restart):
                    with attempt:
                        await self._run_once(client)
        finally:
            await self.stop()

    async def _run_once(self, client: httpx.AsyncClient) -> None:
        """One llama-server, until it exits: returns when it is to start again at once (stopped on purpose,
        or after a stable run), raises _Crashed when it crashed soon after starting."""
        started = time.monotonic()
        await self._start()
        self._started_at = started
        code = await self._watch(client)
        if self._stopping:
            return
        if self._resizing:  # stopped on purpose: start again at once, with the new slot count
            self._resizing = False
            log.info("llama-server restarting with %d slots", self.parallel)
            return
        self.restarts += 1
        if self.on_exit:
            self.on_exit()
        if time.monotonic() - started > STABLE_AFTER_S:
            log.warning("llama-server exited with %s; restarting", code)
            return
        raise _Crashed(code)

    async def _start(self) -> None:
        out = open(self.log_path, "ab") if self.log_path else None  # noqa: SIM115, ASYNC230 (the child inherits it)
        try:
            if not _port_free(self.port):
                self.port = free_port()
            if self.on_url:
                self.on_url(self.url)
            # Popen on the loop's thread: it only forks and execs (the wait is in a thread), and the
            # parent-death signal fires when the thread that forked exits
            self.process = subprocess.Popen(  # noqa: ASYNC220
                self.argv(),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT if out else None,
                close_fds=True,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
            self._exited = _exit_code(self.process)
        finally:
            if out:
                out.close()
        log.info("llama-server started (pid %d) on %s", self.process.pid, self.url)

    async def _watch(self, client: httpx.AsyncClient) -> int:
        """Wait for /health 200 (``on_healthy`` then), then for the process to exit."""
        exited = self._exited
        assert exited is not None
        while not exited.done():
            try:
                response = await client.get(self.url + "/health", timeout=1.0)
                if response.status_code == 200:
                    self.load_s = time.monotonic() - self._started_at
                    log.info("llama-server is healthy (loaded in %.1fs)", self.load_s)
                    if self.on_healthy:
                        self.on_healthy()
                    break
            except httpx.HTTPError:
                pass
            await asyncio.wait({exited}, timeout=0.2)
        return await asyncio.shield(exited)  # stop() waits for it too

    def resize(self, parallel: int) -> None:
        """Restart llama-server with ``parallel`` slots: stop it (SIGTERM); ``run`` starts it again."""
        self.parallel = parallel
        process = self.process
        if process is None or process.returncode is not None:
            return
        self._resizing = True
        _killpg(process.pid, signal.SIGTERM)

    async def stop(self, grace: float = 5.0) -> None:
        """SIGTERM the process group, then SIGKILL after ``grace`` seconds. Safe to call more than once."""
        self._stopping = True
        process, exited = self.process, self._exited
        if process is None or exited is None:
            return
        if not exited.done():
            _killpg(process.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(asyncio.shield(exited), grace)
            except TimeoutError:
                _killpg(process.pid, signal.SIGKILL)
                await asyncio.shield(exited)
        _killpg(process.pid, signal.SIGKILL)  # anything left in its group

    def kill_now(self) -> None:
        """Synchronous last resort (forced exit): SIGKILL the group (and restart nothing)."""
        self._stopping = True
        if self.process is not None:
            _killpg(self.process.pid, signal.SIGKILL)


def _exit_code(process: subprocess.Popen[bytes]) -> asyncio.Future[int]:
    """The process's exit code, from a thread blocked in waitpid: the same on every event loop."""
    loop = asyncio.get_running_loop()
    exited: asyncio.Future[int] = loop.create_future()

    def settle(code: int) -> None:
        if not exited.done():
            exited.set_result(code)

    def wait() -> None:
        code = process.wait()
        with contextlib.suppress(RuntimeError):  # the loop is already closed: nobody is waiting
            loop.call_soon_threadsafe(settle, code)

    threading.Thread(target=wait, name=f"wait-llama-server-{process.pid}", daemon=True).start()
    return exited


def _killpg(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def _port_free(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: TIME_WAIT is fine
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
