"""The corked transport: a response's head leaves with the bytes after it, never later than the loop step."""

from __future__ import annotations

import asyncio
from typing import cast

import httpx
import uvicorn
from starlette.types import Receive, Scope, Send

from macpool.corked import CorkedProtocol, CorkedTransport
from macpool.redis_server import free_port


class Recorder:
    """The few transport methods CorkedTransport uses, recording each send."""

    def __init__(self) -> None:
        self.sends: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        assert not self.closed
        self.sends.append(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


def corked() -> tuple[CorkedTransport, Recorder]:
    recorder = Recorder()
    return CorkedTransport(cast(asyncio.Transport, recorder), asyncio.get_running_loop()), recorder


def test_head_and_first_bytes_go_out_together() -> None:
    asyncio.run(_head_and_first_bytes_go_out_together())


async def _head_and_first_bytes_go_out_together() -> None:
    transport, sent = corked()
    transport.write(b"HTTP/1.1 200 OK\r\n\r\n")
    assert sent.sends == []
    transport.write(b"5\r\nhello\r\n")
    assert sent.sends == [b"HTTP/1.1 200 OK\r\n\r\n5\r\nhello\r\n"]
    transport.write(b"0\r\n\r\n")  # not a head: straight out
    assert sent.sends[-1] == b"0\r\n\r\n" and len(sent.sends) == 2


def test_a_head_alone_leaves_at_the_end_of_the_step() -> None:
    asyncio.run(_a_head_alone_leaves_at_the_end_of_the_step())


async def _a_head_alone_leaves_at_the_end_of_the_step() -> None:
    transport, sent = corked()
    transport.write(b"HTTP/1.1 200 OK\r\n\r\n")
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert sent.sends == [b"HTTP/1.1 200 OK\r\n\r\n"]


def test_close_writes_what_is_held_and_nothing_goes_to_a_closed_transport() -> None:
    asyncio.run(_close_writes_what_is_held_and_nothing_goes_to_a_closed_transport())


async def _close_writes_what_is_held_and_nothing_goes_to_a_closed_transport() -> None:
    transport, sent = corked()
    transport.write(b"HTTP/1.1 204 No Content\r\n\r\n")
    transport.close()
    assert sent.sends == [b"HTTP/1.1 204 No Content\r\n\r\n"] and sent.closed
    transport, sent = corked()
    transport.write(b"HTTP/1.1 200 OK\r\n\r\n")
    sent.closed = True  # the peer went away meanwhile
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert sent.sends == []


def test_write_now_keeps_the_order() -> None:
    asyncio.run(_write_now_keeps_the_order())


async def _write_now_keeps_the_order() -> None:
    transport, sent = corked()
    interim, refusal = b"HTTP/1.1 100 Continue\r\n\r\n", b"HTTP/1.1 503 Service Unavailable\r\n\r\n"
    transport.write(interim)
    transport.write_now(refusal)
    assert sent.sends == [interim + refusal]


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    if scope["path"] == "/stream":
        for i in range(3):
            await send({"type": "http.response.body", "body": b"part %d\n" % i, "more_body": True})
            await asyncio.sleep(0.01)
    await send({"type": "http.response.body", "body": b"end\n", "more_body": False})


def test_a_real_server_answers_byte_for_byte() -> None:
    asyncio.run(_a_real_server_answers_byte_for_byte())


async def _a_real_server_answers_byte_for_byte() -> None:
    port = free_port()
    config = uvicorn.Config(app, port=port, http=CorkedProtocol, lifespan="off", log_level="warning")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            for _ in range(100):
                if server.started:
                    break
                await asyncio.sleep(0.05)
            for _ in range(3):  # keep-alive: the next response's head is corked again
                reply = await client.get("/stream")
                assert reply.status_code == 200 and reply.text == "part 0\npart 1\npart 2\nend\n"
            reply = await client.get("/plain", headers={"Connection": "close"})
            assert reply.text == "end\n" and reply.headers["connection"] == "close"
    finally:
        server.should_exit = True
        await task
