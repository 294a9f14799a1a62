"""One Redis client from one URL: a single server, a Sentinel deployment or a Cluster, through redis-py's own
support for each.

- ``redis://[[user]:password@]host[:port][/db]``, ``rediss://...``, ``unix:///path[?db=N]``: one server.
- ``redis+sentinel://[[user]:password@]host:26379[,host2:26379...]/service[/db]``: the primary that the
  sentinels name for ``service``; the password is the data nodes' (sentinels are asked without one). A
  failover is followed by itself: a connection to the old primary fails and the next one asks the sentinels.
- ``redis+cluster://[[user]:password@]host:port[,host2:port...]``: a Redis Cluster, found from any of them.

Reconnects after a failure back off exponentially with jitter, so that many routers and agents losing one
primary do not all hit the next one at the same instant.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import unquote, urlsplit

from redis.asyncio import BlockingConnectionPool, Redis, RedisCluster
from redis.asyncio.cluster import ClusterNode
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

Kind = Literal["server", "sentinel", "cluster"]
AnyRedis = Redis | RedisCluster
SCHEMES: dict[str, Kind] = {
    "redis": "server", "rediss": "server", "unix": "server", "redis+sentinel": "sentinel",
    "rediss+sentinel": "sentinel", "redis+cluster": "cluster", "rediss+cluster": "cluster",
}
RETRIES = 3  # a command that lost its connection is tried again this often, backing off with jitter


@dataclass(frozen=True)
class RedisTarget:
    """Where a Redis URL points: ``kind``, its hosts, the Sentinel service name and the database."""

    url: str
    kind: Kind
    hosts: tuple[tuple[str, int], ...] = ()
    service: str = ""
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls: bool = False

    @property
    def redacted(self) -> str:
        """The URL without its password, for logs."""
        parts = urlsplit(self.url)
        if parts.password is None:
            return self.url
        user = parts.username or ""
        return parts._replace(netloc=f"{user}:***@{parts.netloc.rsplit('@', 1)[1]}").geturl()


def parse(url: str) -> RedisTarget:
    """The target of ``url``; ValueError naming what is wrong with it."""
    parts = urlsplit(url)
    kind = SCHEMES.get(parts.scheme)
    if kind is None:
        raise ValueError("expected redis://, rediss://, unix://, redis+sentinel:// or redis+cluster://")
    tls = parts.scheme.startswith("rediss")
    password = unquote(parts.password) if parts.password else None
    username = unquote(parts.username) if parts.username else None
    if kind == "server":
        if parts.scheme != "unix":
            _ = parts.port  # ValueError for a port that is not a number in range
            database = parts.path.strip("/")
            if database and not database.isdigit():
                raise ValueError(f"the database {database!r} is not a number (redis://host:6379/0)")
        return RedisTarget(url, kind, tls=tls, username=username, password=password)
    port = 26379 if kind == "sentinel" else 6379
    hosts = tuple(_host(h, port) for h in parts.netloc.rsplit("@", 1)[-1].split(","))
    path = [p for p in parts.path.split("/") if p]
    if kind == "cluster":
        if path:
            raise ValueError("a Redis Cluster has one database: redis+cluster://host:port[,host:port]")
        return RedisTarget(url, kind, hosts, username=username, password=password, tls=tls)
    if not path or len(path) > 2:
        raise ValueError("expected redis+sentinel://[:password@]host:26379[,host:26379]/service[/db]")
    if len(path) == 2 and not path[1].isdigit():
        raise ValueError(f"the database {path[1]!r} is not a number (redis+sentinel://host:26379/mymaster/0)")
    db = int(path[1]) if len(path) == 2 else 0
    return RedisTarget(url, kind, hosts, path[0], db, username, password, tls)


def _host(text: str, default_port: int) -> tuple[str, int]:
    host, _, port = text.rpartition(":") if ":" in text else (text, "", "")
    if not host:
        raise ValueError(f"no host in {text!r}")
    if port and not port.isdigit():
        raise ValueError(f"the port {port!r} of {text!r} is not a number")
    return host, int(port) if port else default_port


def retry() -> Retry:
    """Commands whose connection was found closed are tried again on a new one, backing off with jitter (no
    thundering herd). Not a timeout: the command may have run."""
    return Retry(ExponentialWithJitterBackoff(base=0.05, cap=1.0), RETRIES,
                 supported_errors=(RedisConnectionError,))


@dataclass
class Connection:
    """A client for one target; for Sentinel, also the sentinels (:meth:`check_primary`)."""

    target: RedisTarget
    client: AnyRedis
    sentinel: Sentinel | None = None
    primary: str = field(default="", init=False)  # host:port of the primary last named by the sentinels

    async def check_primary(self, log: logging.Logger) -> None:
        """Ask the sentinels which primary they name now (``primary``; nothing to ask for a single server or
        a cluster); a change since the last call is logged, so a failover shows in the logs of every process
        that follows it."""
        if self.sentinel is None:
            return
        host, port = await self.sentinel.discover_master(self.target.service)
        now = f"{host}:{port}"
        if self.primary and now != self.primary:
            log.warning("redis failover: the primary of %s moved from %s to %s", self.target.service,
                        self.primary, now, extra={"redis_primary": now})
        elif not self.primary:
            log.info("redis primary of %s is %s", self.target.service, now, extra={"redis_primary": now})
        self.primary = now

    async def aclose(self) -> None:
        await self.client.aclose()
        if self.sentinel is not None:
            for sentinel in self.sentinel.sentinels:
                await sentinel.aclose()


def connect(url: str, max_connections: int = 100, **options: Any) -> Connection:
    """A client for ``url`` (any form above); ``options`` are redis-py connection options (timeouts,
    ``decode_responses``)."""
    target = parse(url)
    options.setdefault("retry", retry())
    if target.kind == "server":
        pool = BlockingConnectionPool.from_url(url, max_connections=max_connections, **options)
        return Connection(target, Redis.from_pool(pool))
    options.pop("timeout", None)  # (the blocking pool's wait: a single server's only)
    if target.kind == "cluster":
        nodes = [ClusterNode(host, port) for host, port in target.hosts]
        client = RedisCluster(startup_nodes=nodes, max_connections=max_connections, ssl=target.tls,
                              username=target.username, password=target.password, **options)
        return Connection(target, client)
    sentinel_options = {k: v for k, v in options.items() if k.startswith("socket_") or k == "retry"}
    sentinel = Sentinel(list(target.hosts), sentinel_kwargs=sentinel_options, db=target.db, ssl=target.tls,
                        max_connections=max_connections, username=target.username, password=target.password,
                        **options)
    return Connection(target, sentinel.master_for(target.service), sentinel)
