"""Redis URLs (macpool/store/connect.py): each form, and what is wrong with a bad one."""

from __future__ import annotations

import asyncio

import pytest

from macpool.dev.redis_server import ClusterDeployment
from macpool.store import Keys
from macpool.store.connect import connect, parse


def test_each_url_form_names_its_target() -> None:
    one = parse("rediss://user:pw@h:6380/2")
    assert (one.kind, one.tls, one.username, one.password) == ("server", True, "user", "pw")
    watched = parse("redis+sentinel://:s3cret@s1:26379,s2/mymaster/3")
    assert (watched.kind, watched.hosts, watched.service, watched.db) == (
        "sentinel", (("s1", 26379), ("s2", 26379)), "mymaster", 3)
    assert watched.password == "s3cret" and "s3cret" not in watched.redacted
    cluster = parse("redis+cluster://c1:7000,c2:7001")
    assert (cluster.kind, cluster.hosts) == ("cluster", (("c1", 7000), ("c2", 7001)))


@pytest.mark.parametrize(("url", "said"), [
    ("http://h:6379", "expected redis://"),
    ("redis+sentinel://s1:26379", "service"),
    ("redis+sentinel://s1:26379/mymaster/x", "database 'x' is not a number"),
    ("redis+sentinel://s1:port/mymaster", "port 'port'"),
    ("redis+cluster://c1:7000/1", "one database"),
])
def test_a_bad_url_says_what_is_wrong(url: str, said: str) -> None:
    with pytest.raises(ValueError, match=said):
        parse(url)


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
