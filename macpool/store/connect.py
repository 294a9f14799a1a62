"""One Redis client from one URL: a single server, a Sentinel deployment or a Cluster, through redis-py's own
support for each.

- ``redis://[[user]:password@]host[:port][/db]``, ``rediss://...``, ``unix:///path[?db=N]``: one server.
- ``redis+sentinel://[[user]:password@]host:26379[,host2:26379...]/service[/db]``: the primary that the
  sentinels name for ``service``; the password is the data nodes'. The sentinels' own are the parameters
  ``sentinel_username`` and ``sentinel_password``. A failover is followed by itself: a connection to the
  old primary fails and the next one asks the sentinels.
- ``redis+cluster://[[user]:password@]host:port[,host2:port...]``: a Redis Cluster, found from any of them.

``rediss``, ``rediss+sentinel`` and ``rediss+cluster`` are the same over TLS - to every data node and, for
Sentinel, to the sentinels too - verifying the server's certificate and its host name, with the parameters
``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile`` and ``ssl_check_hostname`` (the names redis-py reads).

Reconnects after a failure back off exponentially with jitter, so that many routers and agents losing one
primary do not all hit the next one at the same instant.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import unquote, urlencode, urlsplit

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
TLS_FILES = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")
SENTINEL_AUTH = ("sentinel_username", "sentinel_password")
BOOLEANS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}
# a URL's password wherever it is: the userinfo (up to the last "@", so that a password with an unencoded
# "/", "?" or "#" is masked whole) and any parameter named like one
_USERINFO_PASSWORD = re.compile(r"(//[^:/?#@]*:)[^@]*@")
_PARAMETER_PASSWORD = re.compile(r"([?&][^=&#]*password=)[^&#'\"\s]*", re.IGNORECASE)


def redact(text: str) -> str:
    """``text`` with the passwords of any URL in it masked; for a URL that does not parse too."""
    return _PARAMETER_PASSWORD.sub(r"\1***", _USERINFO_PASSWORD.sub(r"\1***@", text))


@dataclass(frozen=True)
class Tls:
    """How to check the servers of a ``rediss`` URL: the CA bundle (else the system's), the client
    certificate and key, and whether the server's certificate must name the host connected to."""

    ca_certs: str | None = None
    certfile: str | None = None
    keyfile: str | None = None
    check_hostname: bool = True

    def options(self) -> dict[str, Any]:
        """redis-py's connection options (``check_hostname`` explicit: redis-py 5 does not check by
        default)."""
        return {"ssl_ca_certs": self.ca_certs, "ssl_certfile": self.certfile, "ssl_keyfile": self.keyfile,
                "ssl_check_hostname": self.check_hostname}


@dataclass(frozen=True)
class RedisTarget:
    """Where a Redis URL points: ``kind``, its hosts, the Sentinel service name and the database, the
    credentials of the data nodes and of the sentinels, and TLS (None: none)."""

    url: str
    kind: Kind
    hosts: tuple[tuple[str, int], ...] = ()
    service: str = ""
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls: Tls | None = None
    sentinel_username: str | None = None
    sentinel_password: str | None = None
    server_url: str = ""  # a single server's URL for redis-py: without the parameters read here

    @property
    def redacted(self) -> str:
        """The URL without its passwords, for logs."""
        return redact(self.url)

    def tls_options(self) -> dict[str, Any]:
        """redis-py's TLS options for a connection (none without TLS)."""
        return self.tls.options() if self.tls is not None else {}

    def data_options(self) -> dict[str, Any]:
        """redis-py's options for a client of the data nodes: credentials and TLS."""
        return {"username": self.username, "password": self.password, **self._ssl()}

    def sentinel_options(self) -> dict[str, Any]:
        """redis-py's options for a client of a sentinel: the sentinels' own credentials, the same TLS."""
        return {"username": self.sentinel_username, "password": self.sentinel_password, **self._ssl()}

    def _ssl(self) -> dict[str, Any]:
        return {"ssl": True, **self.tls_options()} if self.tls is not None else {}


def parse(url: str) -> RedisTarget:
    """The target of ``url``; ValueError naming what is wrong with it, never a password."""
    parts = urlsplit(url)
    kind = SCHEMES.get(parts.scheme)
    if kind is None:
        raise ValueError("expected redis://, rediss://, unix://, redis[s]+sentinel:// or redis[s]+cluster://")
    if "@" in parts.path + parts.query + parts.fragment:
        # the userinfo ended early: a password's "/", "?" or "#" cut it, and what is left of it would be read
        # as a host, a path or a parameter (and so be quoted in an error)
        raise ValueError("an '@' after the host: percent-encode '/', '?', '#' and '@' in a password "
                         "(%2F, %3F, %23, %40), and '@' in a parameter (%40)")
    if parts.fragment:
        raise ValueError("a '#' in the URL: percent-encode it in a password (%23)")
    params = _params(parts.query, kind, parts.scheme)
    tls = _tls(params) if parts.scheme.startswith("rediss") else None
    password = unquote(parts.password) if parts.password else None
    username = unquote(parts.username) if parts.username else None
    if kind == "server":
        if parts.scheme != "unix":
            _ = parts.port  # ValueError for a port that is not a number in range
            database = parts.path.strip("/")
            if database and not database.isdigit():
                raise ValueError(f"the database {database!r} is not a number (redis://host:6379/0)")
        rest = [(k, v) for k, v in params.items() if k not in (*TLS_FILES, "ssl_check_hostname")]
        server_url = url if len(rest) == len(params) else parts._replace(query=urlencode(rest)).geturl()
        return RedisTarget(url, kind, tls=tls, username=username, password=password, server_url=server_url)
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
    if "sentinel_username" in params and "sentinel_password" not in params:
        raise ValueError("sentinel_username without sentinel_password")
    return RedisTarget(url, kind, hosts, path[0], db, username, password, tls,
                       params.get("sentinel_username"), params.get("sentinel_password"))


def _params(query: str, kind: Kind, scheme: str) -> dict[str, str]:
    """The URL's parameters, each once: TLS's (on ``rediss`` URLs), the sentinels' credentials (on Sentinel
    URLs); a single server's others are redis-py's (``db``, ``socket_timeout``, ...)."""
    params: dict[str, str] = {}
    for item in filter(None, query.split("&")):
        name, equals, value = item.partition("=")
        name = unquote(name)
        if not equals:
            raise ValueError("a URL parameter without a value: name=value, '&' between two")
        if name in params:
            raise ValueError(f"the parameter {name} is given twice")
        params[name] = unquote(value)
    for name in params:
        tls = name in (*TLS_FILES, "ssl_check_hostname")
        if tls and not scheme.startswith("rediss"):
            raise ValueError(f"{name} is a TLS parameter: the scheme is rediss, rediss+sentinel or "
                             "rediss+cluster")
        if name.startswith("ssl_") and not tls:
            raise ValueError(f"the parameter {name} is not taken: TLS takes {', '.join(TLS_FILES)} and "
                             "ssl_check_hostname")
        if name in SENTINEL_AUTH and kind != "sentinel":
            raise ValueError(f"{name} is a Sentinel URL's parameter (redis[s]+sentinel://)")
        if not tls and name not in SENTINEL_AUTH and kind != "server":
            raise ValueError(f"the parameter {name} is not taken by a {kind} URL")
    return params


def _tls(params: dict[str, str]) -> Tls:
    for name in TLS_FILES:
        if name in params and not Path(params[name]).is_file():
            raise ValueError(f"{name}: no such file {params[name]!r}")
    if "ssl_keyfile" in params and "ssl_certfile" not in params:
        raise ValueError("ssl_keyfile without ssl_certfile: the key of which client certificate?")
    check = params.get("ssl_check_hostname", "true").lower()
    if check not in BOOLEANS:
        raise ValueError(f"ssl_check_hostname={check!r}: true or false")
    return Tls(params.get("ssl_ca_certs"), params.get("ssl_certfile"), params.get("ssl_keyfile"),
               BOOLEANS[check])


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
        pool = BlockingConnectionPool.from_url(target.server_url, max_connections=max_connections,
                                               **target.tls_options(), **options)
        return Connection(target, Redis.from_pool(pool))
    options.pop("timeout", None)  # (the blocking pool's wait: a single server's only)
    if target.kind == "cluster":
        nodes = [ClusterNode(host, port) for host, port in target.hosts]
        client = RedisCluster(startup_nodes=nodes, max_connections=max_connections, **target.data_options(),
                              **options)
        return Connection(target, client)
    # a sentinel that does not take the sentinels' password or (TLS) present a certificate of the CA for its
    # host name fails discovery, and the next sentinel is asked: it is never trusted with the primary
    sentinel_options = {k: v for k, v in options.items() if k.startswith("socket_") or k == "retry"}
    sentinel = Sentinel(list(target.hosts), sentinel_kwargs=sentinel_options | target.sentinel_options(),
                        db=target.db, max_connections=max_connections, **target.data_options(), **options)
    return Connection(target, sentinel.master_for(target.service), sentinel)
