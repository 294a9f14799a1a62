"""The request path's pipelined Redis connection (router/pipelined.py), against a real Redis server."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from macpool.contract import Keys
from macpool.redis_server import RedisServer, free_port
from router.app import redis_client
from router.pipelined import Pipelined, subscribe
from router.pool import PoolView
from router.settings import Settings

ECHO = "return {ARGV[1], redis.call('INCR', KEYS[1] or 'calls')}"


def pipelined(url: str) -> tuple[Redis, Pipelined]:
    client = redis_client(Settings(redis_url=url))
    return client, Pipelined(client)


@contextlib.asynccontextmanager
async def silent_server() -> AsyncIterator[tuple[int, list[asyncio.StreamWriter]]]:
    """A server that accepts connections and never answers (a hung Redis): its port, its connections."""
    accepted: list[asyncio.StreamWriter] = []
    silent = await asyncio.start_server(lambda r, w: accepted.append(w), "127.0.0.1", 0)
    try:
        yield silent.sockets[0].getsockname()[1], accepted
    finally:
        for writer in accepted:
            writer.close()
        silent.close()
        await silent.wait_closed()


def test_concurrent_calls_each_get_their_own_reply(redis_url: str) -> None:
    async def scenario() -> None:
        client, pipe = pipelined(redis_url)
        echo = pipe.register(ECHO)
        tags = [f"call-{i}" for i in range(300)]

        async def one(tag: str) -> bytes:
            await asyncio.sleep(random.random() / 100)
            reply = await echo(args=[tag])
            return bytes(reply[0])

        assert await asyncio.gather(*(one(tag) for tag in tags)) == [tag.encode() for tag in tags]
        # all of them on one connection, which Redis counts as one client
        clients = await client.client_list()
        assert sum(1 for c in clients if c["cmd"] in ("evalsha", "eval")) == 1
        pipe.close()
        await client.aclose()

    asyncio.run(scenario())


def test_a_cancelled_call_does_not_shift_the_replies_of_the_next(redis_url: str) -> None:
    async def scenario() -> None:
        client, pipe = pipelined(redis_url)
        echo = pipe.register("return ARGV[1]")
        assert await echo(args=["loaded"]) == b"loaded"
        await client.execute_command("CLIENT", "PAUSE", 300, "ALL")  # Redis holds every call meanwhile
        first = asyncio.ensure_future(echo(args=["first"]))
        await asyncio.sleep(0.05)  # written, not answered
        first.cancel()
        assert await echo(args=["second"]) == b"second"
        assert await echo(args=["third"]) == b"third"
        pipe.close()
        await client.aclose()

    asyncio.run(scenario())


def test_a_restarted_empty_redis_costs_no_call() -> None:
    """The dead connection is replaced and the scripts Redis no longer knows are loaded again."""
    server = RedisServer().start()
    restarted: RedisServer | None = None
    try:

        async def scenario() -> list[object]:
            nonlocal restarted
            client, pipe = pipelined(server.url)
            echo = pipe.register(ECHO)
            assert (await echo(args=["before"]))[0] == b"before"
            server.kill()
            restarted = RedisServer(port=server.port).start()
            answers = await asyncio.gather(*(echo(args=[str(i)]) for i in range(8)), return_exceptions=True)
            pipe.close()
            await client.aclose()
            return answers

        answers = asyncio.run(scenario())
        assert [bytes(a[0]) for a in answers] == [str(i).encode() for i in range(8)]  # type: ignore[index]
    finally:
        server.close()
        if restarted is not None:
            restarted.close()


def test_a_redis_that_never_answers_times_out_and_a_refused_connection_fails() -> None:
    async def scenario() -> None:
        async with silent_server() as (port, _):
            pipe = Pipelined(Redis.from_url(f"redis://127.0.0.1:{port}/0", socket_timeout=0.3))
            loop = asyncio.get_running_loop()
            started = loop.time()
            with pytest.raises(RedisTimeoutError):
                await pipe.register(ECHO)(args=["x"])
            assert 0.25 <= loop.time() - started < 3.0
            pipe.close()

        closed = Pipelined(Redis.from_url(f"redis://127.0.0.1:{free_port()}/0"))
        with pytest.raises(RedisConnectionError):
            await closed.register(ECHO)(args=["x"])

    asyncio.run(scenario())


def test_calls_waiting_for_a_connection_share_its_outcome() -> None:
    """A Redis that takes the connection but never completes its setup (as a blackholed host would hang):
    the calls made meanwhile fail together with the one attempt, not one connect timeout after another."""

    async def scenario() -> None:
        async with silent_server() as (port, connections):  # the setup (AUTH) is never answered
            pipe = Pipelined(Redis.from_url(f"redis://:pw@127.0.0.1:{port}/0", socket_connect_timeout=0.5))
            echo = pipe.register(ECHO)
            outcomes = await asyncio.gather(*(echo(args=[str(i)]) for i in range(10)), return_exceptions=True)
            assert all(isinstance(outcome, RedisConnectionError) for outcome in outcomes), outcomes
            # one attempt and one retry, shared by all ten (one after another: twenty, and ten seconds)
            assert len(connections) == 2
            pipe.close()

    asyncio.run(scenario())


def test_a_reply_to_no_call_drops_the_connection() -> None:
    """Replies are matched to calls by order only: one too many and the connection is not used again."""

    async def scenario() -> None:
        connections: list[asyncio.StreamWriter] = []

        async def talkative(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            connections.append(writer)
            await reader.readuntil(b"x\r\n")  # the call's last argument
            writer.write(b"$5\r\nfirst\r\n+EXTRA\r\n")
            with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
                await reader.read()

        server = await asyncio.start_server(talkative, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        pipe = Pipelined(Redis.from_url(f"redis://127.0.0.1:{port}/0", socket_timeout=2.0))
        echo = pipe.register(ECHO)
        assert await echo(args=["x"]) == b"first"
        # on a new connection: on the same one, replies would be matched one call late ("EXTRA" for this one)
        assert await echo(args=["x"]) == b"first"
        assert len(connections) == 2
        pipe.close()
        for writer in connections:
            writer.close()
        server.close()
        await server.wait_closed()

    asyncio.run(scenario())


def test_password_acl_user_and_database(tmp_path: Path) -> None:
    with RedisServer(password="pw-s3cret") as server:
        admin = redis.Redis(port=server.port, password="pw-s3cret")
        admin.acl_setuser("macpool", enabled=True, passwords=["+acl-pw"], keys=["*"], commands=["+@all"])

        async def scenario() -> None:
            for url in (f"redis://:pw-s3cret@127.0.0.1:{server.port}/3",
                        f"redis://macpool:acl-pw@127.0.0.1:{server.port}/3"):
                client, pipe = pipelined(url)
                echo = pipe.register("redis.call('SET', 'seen', ARGV[1]); return ARGV[1]")
                assert await echo(args=[url]) == url.encode()
                assert redis.Redis(port=server.port, password="pw-s3cret", db=3).get("seen") == url.encode()
                pipe.close()
                await client.aclose()
            client, pipe = pipelined(f"redis://:wrong@127.0.0.1:{server.port}/0")
            with pytest.raises(RedisConnectionError):
                await pipe.register(ECHO)(args=["x"])
            pipe.close()
            await client.aclose()

        asyncio.run(scenario())
        admin.close()


def test_unix_socket_script_errors_and_closing(tmp_path: Path) -> None:
    path = tmp_path / "redis.sock"
    with RedisServer(extra_args=["--unixsocket", str(path), "--unixsocketperm", "700"]):

        async def scenario() -> None:
            client, pipe = pipelined(f"unix://{path}?db=1")
            assert pipe.supported
            assert await pipe.register("return ARGV[1]")(args=["over unix"]) == b"over unix"
            with pytest.raises(ResponseError):
                await pipe.register("return redis.call('NOSUCHCOMMAND')")(args=[])
            pipe.close()
            with pytest.raises(RedisConnectionError):  # closed for good: no new connection
                await pipe.register("return 1")(args=[])
            await client.aclose()

        asyncio.run(scenario())


def test_tls_is_left_to_redis_py() -> None:
    client = redis_client(Settings(redis_url="rediss://127.0.0.1:6380/0"))
    pipe = Pipelined(client)
    assert not pipe.supported
    assert isinstance(pipe.register("return 1"), redis.commands.core.AsyncScript)



def test_a_subscription_hands_on_each_message_in_order_and_survives_a_bad_one() -> None:
    with RedisServer(password="pw-s3cret") as server:
        publisher = redis.Redis(port=server.port, password="pw-s3cret")

        async def scenario() -> None:
            client = redis_client(Settings(redis_url=f"redis://:pw-s3cret@127.0.0.1:{server.port}/2"))
            seen: list[bytes] = []
            done = asyncio.Event()

            def on_message(data: bytes) -> None:
                if data == b"bad":
                    raise ValueError("a message the router cannot apply")
                seen.append(data)
                if data == b"last":
                    done.set()

            subscription = await subscribe(client, "events", on_message)
            for payload in ("freed n1", "bad", "granted r1 n2", "last"):
                await asyncio.to_thread(publisher.publish, "events", payload)
            await asyncio.wait_for(done.wait(), 5)
            assert seen == [b"freed n1", b"granted r1 n2", b"last"]
            assert not subscription.closed.done()
            subscription.close()
            await asyncio.wait_for(subscription.closed, 1)
            with pytest.raises(RedisConnectionError):  # a wrong password: refused, not hanging
                await subscribe(redis_client(Settings(redis_url=f"redis://:no@127.0.0.1:{server.port}/0")),
                                "events", on_message)
            await client.aclose()

        asyncio.run(scenario())
        publisher.close()


def test_the_pool_view_hears_events_again_after_redis_restarts() -> None:
    """The events connection dies with Redis; the pool view subscribes again and hears the next release."""
    server = RedisServer().start()
    restarted: RedisServer | None = None
    try:

        async def scenario() -> None:
            nonlocal restarted
            client = redis_client(Settings(redis_url=server.url))
            view = PoolView(Settings(redis_url=server.url), client, Keys())
            freed: list[str] = []
            view.freed_listeners.append(freed.append)
            await view.start()
            publisher = redis.Redis.from_url(server.url)

            async def heard(node: str) -> None:
                for _ in range(100):  # published until heard: the subscription may still be connecting
                    await asyncio.to_thread(publisher.publish, Keys().events, f"freed {node}")
                    if node in freed:
                        return
                    await asyncio.sleep(0.1)
                raise AssertionError(f"the pool view never heard {node}: {freed}")

            await heard("before")
            server.kill()
            restarted = RedisServer(port=server.port).start()
            await heard("after")
            await view.stop()
            publisher.close()
            await client.aclose()

        asyncio.run(scenario())
    finally:
        server.close()
        if restarted is not None:
            restarted.close()
