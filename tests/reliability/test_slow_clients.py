"""Slow clients: slowloris headers, trickled bodies, readers that never read: no slot past the bounds."""

from __future__ import annotations

import contextlib
import json
import socket
import time

import httpx
import pytest

from tests.reliability.conftest import Node, Rig, chat, wait_until

pytestmark = pytest.mark.slow

IDLE_S = 2.0


pytestmark = pytest.mark.in_process  # none of these tests is about a process


@pytest.fixture
def setup(rig: Rig) -> tuple[Rig, Node, str]:
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


def test_a_trickled_body_is_answered_408_within_the_read_timeout(rig: Rig) -> None:
    """Bodies still trickling in (a byte every 0.2 s) when --request-read-timeout has passed get an
    OpenAI-shaped 408 and their connections end; none held a slot. (Slowloris headers and silent connections
    are the fronting proxy's: tests/operator/test_operator_haproxy.py.)"""
    node = rig.node("cut", cap=1, speed=50)
    router = rig.router("--request-read-timeout", "1.5")
    rig.wait_ready(router, nodes=1)
    body = json.dumps(chat("", 2, False)).encode()
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Length: {len(body)}\r\n\r\n".encode()
    socks = [socket.create_connection(("127.0.0.1", _port(router.url)), timeout=10) for _ in range(3)]
    answers: dict[int, bytes] = {}
    closed_after: dict[int, float] = {}
    started = time.monotonic()
    try:
        for sock in socks:
            sock.sendall(head + body[:5])
            sock.settimeout(0.1)
        sent = 5
        while len(closed_after) < len(socks) and time.monotonic() - started < 15:
            for i, sock in enumerate(socks):
                if i in closed_after:
                    continue
                try:
                    if sent < len(body) - 1:
                        sock.sendall(body[sent : sent + 1])
                    chunk = sock.recv(4096)
                    answers[i] = answers.get(i, b"") + chunk
                    if chunk == b"":
                        closed_after[i] = time.monotonic() - started
                except TimeoutError:
                    pass
                except OSError:
                    closed_after[i] = time.monotonic() - started
            sent += 1
            assert rig.reservations(node.node_id) == 0
            time.sleep(0.1)
    finally:
        for sock in socks:
            sock.close()
    assert sorted(closed_after) == [0, 1, 2], f"still open: {set(range(3)) - set(closed_after)}"
    assert max(closed_after.values()) < 6.0, closed_after
    for answer in answers.values():
        assert answer.startswith(b"HTTP/1.1 408"), answer
        error = json.loads(answer.partition(b"\r\n\r\n")[2])["error"]
        assert error["code"] == "request_timeout" and error["type"] == "timeout_error"
    assert rig.reservations(node.node_id) == 0
    assert _served(router.url)
