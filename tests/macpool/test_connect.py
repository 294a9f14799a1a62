"""Redis URLs (macpool/store/connect.py): each form, and what is wrong with a bad one."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from urllib.parse import quote

import pytest

from macpool.dev.redis_server import ClusterDeployment
from macpool.store import Keys
from macpool.store.connect import Tls, connect, parse


def test_each_url_form_names_its_target() -> None:
    one = parse("rediss://user:pw@h:6380/2")
    assert (one.kind, one.tls, one.username, one.password) == ("server", Tls(), "user", "pw")
    assert parse("redis://h:6379/0").tls is None
    watched = parse("redis+sentinel://:s3cret@s1:26379,s2/mymaster/3")
    assert (watched.kind, watched.hosts, watched.service, watched.db) == (
        "sentinel", (("s1", 26379), ("s2", 26379)), "mymaster", 3)
    assert watched.password == "s3cret" and "s3cret" not in watched.redacted
    cluster = parse("redis+cluster://c1:7000,c2:7001")
    assert (cluster.kind, cluster.hosts) == ("cluster", (("c1", 7000), ("c2", 7001)))


@pytest.fixture
def pem(tmp_path: Path) -> dict[str, str]:
    """Three files where a URL's TLS parameters name a CA, a certificate and a key (parse only checks that
    they are files)."""
    files = {name: tmp_path / f"{name}.pem" for name in ("ca", "cert", "key")}
    for path in files.values():
        path.write_text("-----BEGIN CERTIFICATE-----\n")
    return {name: str(path) for name, path in files.items()}


@pytest.mark.parametrize("scheme", ["rediss", "rediss+sentinel", "rediss+cluster"])
def test_every_kind_takes_the_same_tls_parameters(scheme: str, pem: dict[str, str]) -> None:
    service = "/mymaster" if "sentinel" in scheme else ""
    query = f"ssl_ca_certs={pem['ca']}&ssl_certfile={pem['cert']}&ssl_keyfile={pem['key']}"
    target = parse(f"{scheme}://:pw@h1:7000{service}?{query}")
    assert target.tls == Tls(pem["ca"], pem["cert"], pem["key"], check_hostname=True)
    options = target.data_options()
    assert (options["ssl"], options["ssl_ca_certs"], options["ssl_check_hostname"]) == (True, pem["ca"], True)
    lab = parse(f"{scheme}://h1:7000{service}?ssl_ca_certs={pem['ca']}&ssl_check_hostname=false")
    assert lab.tls == Tls(pem["ca"], check_hostname=False)


def test_a_single_servers_url_reaches_redis_py_without_the_tls_parameters(pem: dict[str, str]) -> None:
    target = parse(f"rediss://:pw@h:6380/1?socket_timeout=3&ssl_ca_certs={pem['ca']}&ssl_check_hostname=no")
    assert target.server_url == "rediss://:pw@h:6380/1?socket_timeout=3"
    assert target.tls == Tls(pem["ca"], check_hostname=False)
    assert parse("unix:///tmp/redis.sock?db=2").server_url == "unix:///tmp/redis.sock?db=2"


def test_the_sentinels_credentials_are_their_own() -> None:
    target = parse("redis+sentinel://app:data-pw@s1,s2/mymaster?sentinel_username=watch&sentinel_password=s-pw")
    assert (target.username, target.password) == ("app", "data-pw")
    assert (target.sentinel_username, target.sentinel_password) == ("watch", "s-pw")
    assert {k: target.data_options()[k] for k in ("username", "password")} == {
        "username": "app", "password": "data-pw"}
    assert target.sentinel_options() == {"username": "watch", "password": "s-pw"}  # no TLS: no ssl options
    assert "data-pw" not in target.redacted and "s-pw" not in target.redacted
    assert target.redacted == ("redis+sentinel://app:***@s1,s2/mymaster?sentinel_username=watch"
                               "&sentinel_password=***")


@pytest.mark.parametrize(("url", "said"), [
    ("http://h:6379", "expected redis://"),
    ("redis+sentinel://s1:26379", "service"),
    ("redis+sentinel://s1:26379/mymaster/x", "database 'x' is not a number"),
    ("redis+sentinel://s1:port/mymaster", "port 'port'"),
    ("redis+cluster://c1:7000/1", "one database"),
    ("redis://h?ssl_ca_certs=/etc/ssl/ca.pem", "ssl_ca_certs is a TLS parameter"),
    ("rediss://h?ssl_cert_reqs=none", "ssl_cert_reqs is not taken"),
    ("rediss://h?ssl_ca_certs=/no/such/ca.pem", "ssl_ca_certs: no such file '/no/such/ca.pem'"),
    ("rediss://h?ssl_check_hostname=maybe", "ssl_check_hostname='maybe': true or false"),
    ("redis://h?sentinel_password=x", "sentinel_password is a Sentinel URL's parameter"),
    ("redis+cluster://c1?db=1", "the parameter db is not taken by a cluster URL"),
    ("redis+sentinel://s1/m?sentinel_username=a", "sentinel_username without sentinel_password"),
    ("redis+sentinel://s1/m?sentinel_password=a&sentinel_password=b", "sentinel_password is given twice"),
    ("redis://h/0?db", "without a value"),
])
def test_a_bad_url_says_what_is_wrong(url: str, said: str) -> None:
    with pytest.raises(ValueError, match=re.escape(said)):
        parse(url)


def test_a_keyfile_needs_its_certificate(pem: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="ssl_keyfile without ssl_certfile"):
        parse(f"rediss://h?ssl_keyfile={pem['key']}")


@pytest.mark.parametrize(("url", "password"), [
    ("redis://app:{}@h:6379/0", "pw#Secret/Part"),  # an unencoded "#": the rest is a fragment
    ("redis://:{}@h:6379/0", "pw/Secret"),  # "/": a path
    ("redis+sentinel://:{}@s1:26379/mymaster", "pw?Secret=Part"),  # "?": a parameter
    ("redis+sentinel://:{}@s1/mymaster", "pw:Secret#Part"),  # a host "" and a port "pw", were it read
    ("rediss+cluster://app:{}@c1:7000", "Secret#Part"),
])
def test_a_password_cut_short_by_a_reserved_character_is_never_quoted(url: str, password: str) -> None:
    with pytest.raises(ValueError, match="percent-encode") as raised:
        parse(url.format(password))
    for piece in ("pw", "Secret", "Part"):
        assert piece not in str(raised.value)
    assert parse(url.format(quote(password, safe=""))).password == password


def test_a_cluster_url_reaches_the_pool_keys_in_one_slot() -> None:
    keys = Keys()

    async def scenario(url: str) -> list[object]:
        connection = connect(url, decode_responses=True)
        try:
            client = connection.client
            await client.set(keys.node("a"), "1")
            await client.set(keys.in_flight, "2")
            # one script over two keys of the pool: refused (CROSSSLOT) unless they share a slot
            script = client.register_script("return {redis.call('GET', KEYS[1]), redis.call('GET', KEYS[2])}")
            return list(await script(keys=[keys.node("a"), keys.in_flight]))
        finally:
            await connection.aclose()

    with ClusterDeployment() as cluster:
        assert asyncio.run(scenario(cluster.url)) == ["1", "2"]
