"""The request path's Lua scripts, run on one pipelined Redis connection per router; and the pool's events.

Every admitted request makes two Redis calls (the reservation and the release, router/admission.py). Through
redis-py each takes a connection from the pool, writes, waits for its reply on that connection alone and
hands the connection back: ~55-70 us of router CPU per call, most of it redis-py's plumbing around one write
and one read. Here every call is written to one connection as soon as it is made, and the replies, which
Redis sends in the order of the calls, are matched to their callers in that order (hiredis parses them):
concurrent calls share the connection and its reads, and a call costs a write and its share of a read.

Same behaviour as the redis-py client it stands in for: a call whose reply does not come within the
client's socket timeout fails with ``redis.exceptions.TimeoutError`` (the connection is dropped: the replies
on it can no longer be matched); a connection that dies fails its calls with ``ConnectionError``, and a
call that met a dead connection is retried once on a new one (a restarted Redis); a script Redis does not
know (restarted empty) is sent with EVAL. TLS (``rediss://``) connections go through redis-py's own script
calls instead.

The pool's events channel (every release publishes one message to every router) is read the same way: one
connection subscribed to it, each message handed on as it is parsed (``subscribe``), where redis-py's pub/sub
loop cost an idle router 18-20 us of CPU per message.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar

import hiredis
from redis.asyncio import Redis
from redis.asyncio.connection import Connection, UnixDomainSocketConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

Arg = str | int | float | bytes
_P = TypeVar("_P", bound="_Link")
log = logging.getLogger("macpool.router")


class ScriptCall(Protocol):
    def __call__(self, *, args: Sequence[Arg]) -> Awaitable[Any]: ...


def _pack(args: Sequence[Arg]) -> bytes:
    """One command in RESP: an array of bulk strings."""
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg if isinstance(arg, bytes) else str(arg).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


class _Link(asyncio.Protocol):
    """One connection: calls written in order, replies matched to them in order."""

    def __init__(self, timeout: float | None) -> None:
        self.timeout = timeout
        self.reader = hiredis.Reader()
        self.waiting: deque[tuple[asyncio.Future[Any], float]] = deque()  # (reply, deadline) in call order
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's transports are not subclasses

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        while self.waiting:
            reply = self.reader.gets()
            if reply is False:
                return
            future, _ = self.waiting.popleft()
            if not future.done():  # a caller that was cancelled meanwhile: its reply is dropped
                future.set_result(reply)
        if self.reader.gets() is not False:  # a reply nobody asked for: the next ones could not be matched
            self._fail(RedisConnectionError("Redis sent a reply to no call"))

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(RedisConnectionError("the connection to Redis was lost"))

    def call(self, args: Sequence[Arg]) -> asyncio.Future[Any]:
        if self.lost or self.transport is None or self.transport.is_closing():
            self.lost = True  # (a failed write closes the transport before connection_lost is called)
            raise RedisConnectionError("the connection to Redis was lost")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        deadline = time.monotonic() + self.timeout if self.timeout else 0.0
        self.waiting.append((future, deadline))
        self.transport.write(_pack(args))
        if self.timeout and self._timer is None:
            self._timer = loop.call_later(self.timeout, self._check)
        return future

    def _check(self) -> None:
        """Give the connection up if the oldest reply is overdue (one timer, re-armed when it fires)."""
        self._timer = None
        if not self.waiting or self.timeout is None:
            return
        left = self.waiting[0][1] - time.monotonic()
        if left > 0:
            self._timer = asyncio.get_running_loop().call_later(left, self._check)
            return
        self._fail(RedisTimeoutError("Redis did not answer within the socket timeout"))

    def _fail(self, error: Exception) -> None:
        self.lost = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self.waiting:
            future, _ = self.waiting.popleft()
            if not future.done():
                future.set_exception(error)
        if self.transport is not None:
            self.transport.abort()

    def close(self) -> None:
        self._fail(RedisConnectionError("the connection to Redis was closed"))


class Pipelined:
    """One pipelined connection to the Redis server that ``redis`` (a redis-py client) points at."""

    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        pool = redis.connection_pool
        self.kwargs = pool.connection_kwargs
        self.supported = raw_capable(redis)
        self._link: _Link | None = None
        self._connecting: asyncio.Future[_Link] | None = None
        self._closed = False

    def register(self, text: str) -> ScriptCall:
        """One Lua script's call, ``await call(args=[...])``, as redis-py's ``register_script`` returns."""
        script = self.redis.register_script(text)
        return _Script(self, text, script.sha) if self.supported else script

    async def command(self, *args: Arg) -> Any:
        """Send one command; its reply (a ``ResponseError`` reply is raised)."""
        link = self._link
        try:
            if link is None or link.lost:
                link = await self._connection()
            reply = await link.call(args)
        except RedisConnectionError:
            # the connection died (Redis restarted, or closed an idle connection): once more on a new one
            reply = await (await self._connection()).call(args)
        if isinstance(reply, hiredis.ReplyError):
            message = str(reply)
            raise NoScriptError(message) if message.startswith("NOSCRIPT") else ResponseError(message)
        return reply

    async def _connection(self) -> _Link:
        link = self._link
        if link is not None and not link.lost:
            return link
        if self._closed:
            raise RedisConnectionError("the router's Redis connection is closed")
        # one attempt at a time, and the calls made meanwhile share its outcome: a Redis that hangs the
        # connection costs them one connect timeout together, not one each in turn
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._connect())
            self._connecting.add_done_callback(self._connected)
        return await asyncio.shield(self._connecting)  # a caller that gives up leaves the attempt to the rest

    def _connected(self, attempt: asyncio.Future[_Link]) -> None:
        self._connecting = None
        if attempt.cancelled() or attempt.exception() is not None:  # (the exception is its callers')
            return
        self._link = attempt.result()
        if self._closed:
            self._link.close()

    async def _connect(self) -> _Link:
        return await _open(self.redis, lambda: _Link(self.kwargs.get("socket_timeout")))

    def close(self) -> None:
        """Close the connection (its calls fail) and refuse new calls."""
        self._closed = True
        if self._link is not None:
            self._link.close()
            self._link = None


def raw_capable(redis: Redis) -> bool:
    """Whether this module can talk to ``redis``'s server itself: TCP or a unix socket (a subclass of
    redis-py's connections, TLS say, is left to redis-py)."""
    kind = redis.connection_pool.connection_class
    return kind is UnixDomainSocketConnection or kind is Connection


async def subscribe(redis: Redis, channel: str, on_message: Callable[[bytes], None]) -> Subscription:
    """A new connection subscribed to ``channel``, each message's payload handed to ``on_message``."""
    subscription = await _open(redis, lambda: Subscription(on_message))
    try:
        subscription.send(("SUBSCRIBE", channel))
        async with asyncio.timeout(redis.connection_pool.connection_kwargs.get("socket_connect_timeout")):
            await subscription.subscribed
    except BaseException:
        subscription.close()
        raise
    return subscription


async def _open(redis: Redis, factory: Callable[[], _P]) -> _P:
    """A new connection to ``redis``'s server with ``factory``'s protocol, authenticated and on its db."""
    kwargs = redis.connection_pool.connection_kwargs
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(kwargs.get("socket_connect_timeout")):
            if redis.connection_pool.connection_class is UnixDomainSocketConnection:
                _, made = await loop.create_unix_connection(factory, kwargs["path"])
            else:
                _, made = await loop.create_connection(factory, kwargs.get("host", "localhost"),
                                                       kwargs.get("port", 6379))
            try:
                setup: list[asyncio.Future[Any]] = []
                password, username = kwargs.get("password"), kwargs.get("username")
                if password:
                    setup.append(made.call(("AUTH", username, password) if username else ("AUTH", password)))
                if kwargs.get("db"):
                    setup.append(made.call(("SELECT", kwargs["db"])))
                for reply in await asyncio.gather(*setup):
                    if isinstance(reply, hiredis.ReplyError):
                        raise RedisConnectionError(f"Redis refused the connection's setup: {reply}")
            except BaseException:  # refused, timed out, or the caller cancelled: the connection goes too
                made.close()
                raise
    except (OSError, TimeoutError) as exc:
        raise RedisConnectionError(f"could not connect to Redis: {type(exc).__name__}") from None
    return made


class Subscription(_Link):
    """A connection subscribed to a channel: each message's payload goes to ``on_message`` as it is parsed.

    redis-py's pub/sub loop (``get_message`` in a task) cost an idle router 18-20 us of CPU per message, and
    every release publishes one to every router; here a message costs its share of a read and one call.
    Replies to the connection's own commands (AUTH, SELECT, SUBSCRIBE) come first, in order, as on a link.
    """

    def __init__(self, on_message: Callable[[bytes], None]) -> None:
        super().__init__(None)
        self.on_message = on_message
        self.subscribed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()  # done when it ends

    def send(self, args: Sequence[Arg]) -> None:
        """A command whose reply is a push, not a reply to match (SUBSCRIBE)."""
        assert self.transport is not None
        self.transport.write(_pack(args))

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        while (reply := self.reader.gets()) is not False:
            if self.waiting:  # AUTH / SELECT, before any push
                future, _ = self.waiting.popleft()
                if not future.done():
                    future.set_result(reply)
            elif isinstance(reply, list) and len(reply) == 3 and reply[0] == b"message":
                try:
                    self.on_message(reply[2])
                except Exception:  # one bad message must not end the subscription
                    log.exception("pool events: a message could not be applied")
            elif isinstance(reply, list) and reply and reply[0] == b"subscribe":
                if not self.subscribed.done():
                    self.subscribed.set_result(None)
            elif isinstance(reply, hiredis.ReplyError):
                self._fail(RedisConnectionError(f"Redis refused the subscription: {reply}"))
                return

    def _fail(self, error: Exception) -> None:
        super()._fail(error)
        if not self.subscribed.done():
            self.subscribed.set_exception(error)
        if not self.closed.done():
            self.closed.set_result(None)


class _Script:
    def __init__(self, pipelined: Pipelined, text: str, sha: str) -> None:
        self.pipelined = pipelined
        self.text = text
        self.sha = sha

    async def __call__(self, *, args: Sequence[Arg]) -> Any:
        try:
            return await self.pipelined.command("EVALSHA", self.sha, 0, *args)
        except NoScriptError:  # Redis restarted empty (or flushed its scripts): EVAL loads it again
            return await self.pipelined.command("EVAL", self.text, 0, *args)

