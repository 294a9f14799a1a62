"""Child processes for the demo, benchmarks and tests: start, wait until serving, stop with a bound."""

from __future__ import annotations

import contextlib
import os
import signal
import ssl
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

import httpx


class ProcessError(RuntimeError):
    """A child process failed to start or to become ready."""


def macpool_argv(*args: str) -> list[str]:
    """Run a macpool subcommand with this interpreter (works without the console script on PATH)."""
    return [sys.executable, "-m", "macpool.cli", *args]


class Child:
    """One child process in its own process group, so stopping it stops what it started too."""

    def __init__(
        self,
        argv: list[str],
        name: str = "",
        env: dict[str, str] | None = None,
        log_path: Path | None = None,
    ) -> None:
        self.argv = argv
        self.name = name or Path(argv[0]).name
        self.env = {**os.environ, **(env or {})}
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None
        self.terminated = False  # SIGTERM sent: a second one would skip the child's graceful shutdown
        self.signalled = False  # any signal sent through this object: an exit is then no surprise

    @property
    def pid(self) -> int:
        if self.process is None:
            raise ProcessError(f"{self.name} is not running")
        return self.process.pid

    def start(self) -> Child:
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        try:
            self.process = subprocess.Popen(
                self.argv, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        finally:
            if self.log_path and not isinstance(out, int):
                out.close()
        return self

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def wait_http(
        self, url: str, timeout: float = 20.0, status: int = 200, verify: ssl.SSLContext | bool = True
    ) -> None:
        """Poll ``url`` until it answers ``status`` (an https:// one checked with ``verify``); fail early if
        the process died."""
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            if not self.alive():
                code = self.returncode()
                raise ProcessError(f"{self.name} exited with {code} before serving {url}{self._tail()}")
            try:
                response = httpx.get(url, timeout=1.0, verify=verify)
                if response.status_code == status:
                    return
                last = f"HTTP {response.status_code}"
            except httpx.HTTPError as exc:
                last = type(exc).__name__
            time.sleep(0.05)
        raise ProcessError(f"{self.name} not ready at {url} within {timeout}s (last: {last}){self._tail()}")

    def returncode(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def signal(self, sig: int) -> None:
        if self.alive():
            self.signalled = True
            os.killpg(self.pid, sig)
            self.terminated = self.terminated or sig == signal.SIGTERM

    def kill(self) -> None:
        """SIGKILL the whole group (fault injection)."""
        if self.process is not None and self.process.poll() is None:
            self.signalled = True
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(5)

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM (unless already sent), wait up to ``timeout``, then SIGKILL the group."""
        if self.process is None:
            return None
        self.signalled = True
        if self.process.poll() is None:
            try:
                if not self.terminated:
                    os.killpg(self.process.pid, signal.SIGTERM)
                    self.terminated = True
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(5)
            except ProcessLookupError:
                pass
        # leftovers of the group (a supervised grandchild) must not survive either
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        return self.process.returncode

    def _tail(self) -> str:
        if not self.log_path or not self.log_path.exists():
            return ""
        text = self.log_path.read_text(errors="replace")[-1500:]
        return f"\n--- {self.name} log tail ---\n{text}"

    def __enter__(self) -> Child:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
