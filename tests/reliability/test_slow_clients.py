"""Slow clients: slowloris headers, trickled bodies, readers that never read: no slot past the bounds."""

from __future__ import annotations

import contextlib
import json
import socket
import time

import httpx
import pytest

from macpool.stack import Stack
from tests.reliability.conftest import Node, Rig, chat, wait_until

pytestmark = pytest.mark.slow

IDLE_S = 2.0


@pytest.fixture
def setup(stack: Stack, redis_url: str) -> tuple[Rig, Node, str]:
    rig = Rig(stack, redis_url)
    # a long context so a stream can outlast every socket buffer between the simulator and the client
    node = rig.node("slow", cap=2, speed=50, sim_args=("--ctx-size", "262144"))
    router = rig.router("--idle-timeout", str(IDLE_S), "--first-byte-timeout", "10")
    rig.wait_ready(router, nodes=1)
    return rig, node, router.url


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _served(url: str) -> bool:
    reply = httpx.post(url + "/v1/chat/completions", json=chat("", 2, False), timeout=30)
    return reply.status_code == 200


def test_slowloris_and_trickled_bodies_hold_no_slot(setup: tuple[Rig, Node, str]) -> None:
    rig, node, url = setup
    body = json.dumps(chat("", 2, False)).encode()
    socks = []
    try:
        for i in range(6):
            sock = socket.create_connection(("127.0.0.1", _port(url)), timeout=10)
            if i % 2:  # headers that never end
                sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\n")
            else:  # a body that trickles in
                head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Length: {len(body)}\r\n\r\n"
                sock.sendall(head.encode() + body[:5])
            socks.append(sock)
        for step in range(6):
            for i, sock in enumerate(socks):
                with contextlib.suppress(OSError):  # cut off by the server: fine
                    sock.sendall(b"X-Slow-%d: y\r\n" % step if i % 2 else body[5 + step : 6 + step])
            # no slot is taken before the whole request is in, and everyone else is served meanwhile
            assert rig.reservations(node.node_id) == 0
            assert node.status()["in_flight"] == 0
            assert _served(url)
            time.sleep(0.5)
    finally:
        for sock in socks:
            sock.close()
    wait_until(lambda: rig.reservations(node.node_id) == 0, 5, "no reservation")


def test_reader_that_never_reads_is_cut_off(setup: tuple[Rig, Node, str]) -> None:
    """A client that stops reading a stream loses its slot once the router cannot send for IDLE_S."""
    rig, node, url = setup
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", _port(url)))
    body = json.dumps(chat("", 60000, True)).encode()
    head = "POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
    sock.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
    try:
        wait_until(lambda: rig.reservations(node.node_id) == 1, 10, "the stream admitted")
        started = time.monotonic()
        # never read: once every buffer on the way is full, the router gives the slot back
        wait_until(lambda: rig.reservations(node.node_id) == 0, 90, "the stalled reader's slot freed")
        print(f"a reader that never reads lost its slot after {time.monotonic() - started:.1f}s")
        wait_until(lambda: node.stats()["processing"] == 0, 10, "the node stopped generating")
        assert node.status()["in_flight"] == 0
        assert _served(url)
    finally:
        sock.close()


def test_requests_read_too_slowly_are_cut_off(stack: Stack, redis_url: str) -> None:
    """Slowloris headers, a trickled body and a silent connection are closed by --request-read-timeout."""
    rig = Rig(stack, redis_url)
    node = rig.node("cut", cap=1, speed=50)
    router = rig.router("--request-read-timeout", "1.5")
    rig.wait_ready(router, nodes=1)
    body = json.dumps(chat("", 2, False)).encode()
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Length: {len(body)}\r\n\r\n".encode()
    openings = [b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\n", head + body[:5], b""]
    socks = [socket.create_connection(("127.0.0.1", _port(router.url)), timeout=10) for _ in openings]
    closed_after: dict[int, float] = {}
    started = time.monotonic()
    try:
        for sock, opening in zip(socks, openings, strict=True):
            sock.sendall(opening)
            sock.settimeout(0.1)
        while len(closed_after) < len(socks) and time.monotonic() - started < 15:
            for i, sock in enumerate(socks):
                if i in closed_after:
                    continue
                try:
                    if i < 2:  # keep trickling: one more header line, or one more body byte
                        sock.sendall(b"X-Slow: y\r\n" if i == 0 else b" ")
                    if sock.recv(4096) == b"":
                        closed_after[i] = time.monotonic() - started
                except TimeoutError:
                    pass
                except OSError:
                    closed_after[i] = time.monotonic() - started
            time.sleep(0.2)
    finally:
        for sock in socks:
            sock.close()
    assert sorted(closed_after) == [0, 1, 2], f"still open: {set(range(3)) - set(closed_after)}"
    assert max(closed_after.values()) < 6.0, closed_after
    assert rig.reservations(node.node_id) == 0
    assert _served(router.url)
    log = router.child.log_path.read_text() if router.child.log_path else ""
    assert log.count("no whole request within 1.5 s (--request-read-timeout)") == 3, log
