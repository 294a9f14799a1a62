"""Redis URLs over TLS (macpool/store/connect.py) against real TLS servers: a single server, a Sentinel
deployment with passwords, a Cluster. Every certificate comes from a CA made for the test (tests/tls.py);
every server takes TLS only and asks clients for a certificate of that CA."""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterUnreachableError

from macpool.dev.redis_server import (
    ClusterDeployment,
    RedisServer,
    SentinelDeployment,
    SentinelServer,
    TlsFiles,
)
from macpool.store import Keys
from macpool.store.connect import connect
from tests.tls import Ca, make_ca, require_tls_server

log = logging.getLogger(__name__)
DATA_PASSWORD, SENTINEL_PASSWORD = "data-Pw-7c1e", "sentinel-Pw-e2b9"


@pytest.fixture
def ca(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> Ca:
    require_tls_server(tmp_path_factory)
    return make_ca(tmp_path / "ca")


@pytest.fixture
def files(ca: Ca) -> TlsFiles:
    """The pool's certificate, for 127.0.0.1 and localhost: servers and clients show it alike."""
    return ca.issue("pool")


async def _settled() -> None:
    """Until no transport is open. A TLS connection whose AUTH or HELLO failed is closed by redis-py without
    waiting (``disconnect(nowait=True)``): its TLS goodbye is still under way when the client is closed, and
    a loop closed before it ends leaves the socket to the garbage collector (a ResourceWarning)."""
    for _ in range(500):
        if not any(_open(o) for o in gc.get_objects()):
            return
        await asyncio.sleep(0.01)


def _open(thing: object) -> bool:
    try:
        return isinstance(thing, asyncio.Transport) and not thing.is_closing()
    except ReferenceError:  # a weak proxy whose object is gone
        return False


async def _round_trip(url: str) -> str | None:
    """SET then GET through a client of ``url``."""
    connection = connect(url, decode_responses=True, socket_connect_timeout=2.0, socket_timeout=2.0)
    try:
        await connection.client.set("tls-probe", "ok")
        value: str | None = await connection.client.get("tls-probe")
        return value
    finally:
        await connection.aclose()
        await _settled()


def _refused(url: str) -> str:
    """The error of a client of ``url`` that must not get through."""
    with pytest.raises(RedisConnectionError) as raised:
        asyncio.run(_round_trip(url))
    return str(raised.value)


def test_a_tls_server_takes_a_client_of_its_ca(files: TlsFiles) -> None:
    with RedisServer(password=DATA_PASSWORD, tls=files) as server:
        assert server.url.startswith("rediss://")
        assert asyncio.run(_round_trip(server.url)) == "ok"
        # without the client certificate the server hangs up
        assert _refused(server.url.split("&ssl_certfile")[0])
        # plain text to the TLS port gets nothing back
        assert _refused(server.url.replace("rediss://", "redis://").split("?")[0])


def test_a_client_refuses_a_server_of_another_ca(files: TlsFiles, tmp_path: Path) -> None:
    other = make_ca(tmp_path / "other", "another CA")
    with RedisServer(tls=files) as server:
        said = _refused(server.url.replace(str(files.ca), str(other.path)))
    assert "certificate verify failed" in said


def test_a_client_refuses_a_certificate_for_another_host(ca: Ca) -> None:
    elsewhere = ca.issue("elsewhere", hosts=("redis.elsewhere.test",))
    with RedisServer(tls=elsewhere) as server:
        said = _refused(server.url)
        assert "127.0.0.1" in said or "hostname" in said.lower(), said
        # an IP-only lab may turn the check off; the chain is still checked
        assert asyncio.run(_round_trip(server.url + "&ssl_check_hostname=false")) == "ok"


@pytest.fixture
def sentinel(files: TlsFiles) -> Iterator[SentinelDeployment]:
    with SentinelDeployment(replicas=1, sentinels=3, password=DATA_PASSWORD,
                            sentinel_password=SENTINEL_PASSWORD, tls=files) as deployment:
        yield deployment


async def _primary(url: str) -> str:
    """The primary the sentinels of ``url`` name."""
    connection = connect(url, socket_connect_timeout=2.0, socket_timeout=2.0)
    try:
        await connection.check_primary(log)
        return connection.primary
    finally:
        await connection.aclose()
        await _settled()


def test_sentinel_with_passwords_over_tls(sentinel: SentinelDeployment) -> None:
    url = sentinel.url
    assert url.startswith("rediss+sentinel://") and f"sentinel_password={SENTINEL_PASSWORD}" in url
    assert asyncio.run(_round_trip(url)) == "ok"
    assert sentinel.primary.call("GET", "tls-probe") == "ok"
    assert asyncio.run(_primary(url)) == f"127.0.0.1:{sentinel.primary.port}"
    # the sentinels ask for their own password, and only theirs
    for wrong in (url.replace(f"&sentinel_password={SENTINEL_PASSWORD}", ""),
                  url.replace(SENTINEL_PASSWORD, DATA_PASSWORD)):
        assert "No master found" in _refused(wrong)


def _sentinel_url(ports: list[int], service: str, files: TlsFiles, sentinel_password: str) -> str:
    hosts = ",".join(f"127.0.0.1:{port}" for port in ports)
    return (f"rediss+sentinel://:{DATA_PASSWORD}@{hosts}/{service}/0?{files.query()}"
            f"&sentinel_password={sentinel_password}")


def test_a_sentinel_without_the_password_or_the_certificate_is_not_trusted(
        sentinel: SentinelDeployment, files: TlsFiles, ca: Ca, tmp_path: Path) -> None:
    # two impostors, each naming a primary of its own for the same service: one whose certificate is of
    # another CA, one of the right CA that does not take the sentinels' password
    rogue = make_ca(tmp_path / "rogue", "rogue CA").issue("rogue")
    impostors: list[tuple[RedisServer, SentinelServer]] = []
    try:
        for own, password in ((rogue, SENTINEL_PASSWORD), (ca.issue("stray"), "another-password")):
            primary = RedisServer(password=DATA_PASSWORD, tls=own).start()
            impostors.append((primary, SentinelServer(primary.port, sentinel.service, quorum=1,
                                                      password=DATA_PASSWORD, sentinel_password=password,
                                                      tls=own).start()))
        # each, trusted, would send the client to its own primary
        for (primary, impostor), own, password in zip(impostors, (rogue, files),
                                                      (SENTINEL_PASSWORD, "another-password"), strict=True):
            trusting = _sentinel_url([impostor.port], sentinel.service, own, password)
            assert asyncio.run(_primary(trusting)) == f"127.0.0.1:{primary.port}"
        # listed first, they are asked first, and skipped
        ports = [impostor.port for _, impostor in impostors] + [s.port for s in sentinel.sentinels]
        url = _sentinel_url(ports, sentinel.service, files, SENTINEL_PASSWORD)
        assert asyncio.run(_primary(url)) == f"127.0.0.1:{sentinel.primary.port}"
        assert asyncio.run(_round_trip(url)) == "ok"
        for primary, _ in impostors:
            assert primary.call("DBSIZE") == 0
    finally:
        for primary, impostor in impostors:
            impostor.close()
            primary.close()


def test_a_tls_cluster_reaches_the_pool_keys(files: TlsFiles, tmp_path: Path) -> None:
    keys = Keys()

    async def scenario(url: str) -> list[object]:
        connection = connect(url, decode_responses=True)
        try:
            await connection.client.set(keys.node("a"), "1")
            await connection.client.set(keys.in_flight, "2")
            return [await connection.client.get(keys.node("a")), await connection.client.get(keys.in_flight)]
        finally:
            await connection.aclose()

    with ClusterDeployment(tls=files) as cluster:
        assert cluster.url.startswith("rediss+cluster://")
        assert asyncio.run(scenario(cluster.url)) == ["1", "2"]
        other = make_ca(tmp_path / "other", "another CA")
        with pytest.raises(RedisClusterUnreachableError, match="certificate verify failed"):
            asyncio.run(scenario(cluster.url.replace(str(files.ca), str(other.path))))
