"""The shipped deploy/haproxy/haproxy.cfg, run by a real HAProxy in front of a real router on loopback: it
guards what the router's server leaves unbounded (docs/reliability.md, "Which layer guards what") - a
slowloris client, a client that sends nothing, an oversized head - and passes the rest through."""

from __future__ import annotations

import json
import re
import shutil
import socket
import time
from pathlib import Path

import httpx
import pytest

from macpool.dev.redis_server import free_port
from tests.conftest import Server, SpawnFactory
from tests.raw_http import connect, exchange, filler, head, read_reply

pytestmark = pytest.mark.slow

CFG = Path(__file__).resolve().parents[2] / "deploy" / "haproxy" / "haproxy.cfg"
HEAD_TIMEOUT_S = 2  # the copy's `timeout http-request` (the shipped 10 s, shortened for the test)


def haproxy_binary() -> str:
    found = shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin:/usr/local/sbin")
    if found is None:
        pytest.skip("HAProxy is not installed (apt-get install haproxy; `macpool dev test` installs it on "
                    "Debian when run as root)")
    return found


def loopback_copy(tmp_path: Path, listen: int, router: int) -> Path:
    """The shipped cfg, listening on 127.0.0.1:``listen`` in front of the one router on ``router``: every
    server line is replaced, so nothing is ever sent beyond loopback."""
    text = CFG.read_text()
    text, binds = re.subn(r"(?m)^(\s*)bind \S+", rf"\1bind 127.0.0.1:{listen}", text)
    text = re.sub(r"(?m)^\s*server .*\n", "", text)
    server = f"    server router-1 127.0.0.1:{router} check inter 2s fall 2 rise 2\n"
    text, backends = re.subn(r"(?m)^(backend routers\n)", lambda m: m.group(1) + server, text)
    text, timeouts = re.subn(r"(?m)^(\s*)timeout http-request \S+",
                             rf"\1timeout http-request {HEAD_TIMEOUT_S}s", text)
    assert (binds, backends, timeouts) == (1, 1, 1), "the shipped cfg changed shape: update this test"
    assert not re.search(r"(?m)^\s*server (?!router-1 127\.0\.0\.1:)", text)
    path = tmp_path / "haproxy.cfg"
    path.write_text(text)
    return path


@pytest.fixture
def proxy(spawn: SpawnFactory, redis_url: str, tmp_path: Path) -> Server:
    """A router with no nodes (every request it admits is a 503 no_nodes) behind the shipped HAProxy."""
    binary = haproxy_binary()
    router = spawn("router", "--redis-url", redis_url, name="router")
    listen = free_port()
    cfg = loopback_copy(tmp_path, listen, router.port)
    return spawn(argv=[binary, "-db", "-f", str(cfg)], port=listen, name="haproxy")


def test_a_slowloris_client_and_a_silent_one_are_cut_off(proxy: Server) -> None:
    trickling = connect(proxy.port)
    silent = connect(proxy.port)
    try:
        trickling.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\n")
        trickling.settimeout(0.1)
        started = time.monotonic()
        answer = b""
        while time.monotonic() - started < HEAD_TIMEOUT_S + 5:
            try:
                trickling.sendall(b"X-Slow: y\r\n")  # a header line every 0.3 s: the head never ends
                chunk = trickling.recv(4096)
            except TimeoutError:
                time.sleep(0.2)
                continue
            except OSError:
                break
            if not chunk:
                break
            answer += chunk
        elapsed = time.monotonic() - started
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert HEAD_TIMEOUT_S - 0.5 < elapsed < HEAD_TIMEOUT_S + 3, elapsed
        # meanwhile, and after, everyone else is served
        assert httpx.get(proxy.url + "/health", timeout=5).status_code == 200
        silent.settimeout(HEAD_TIMEOUT_S + 3)
        said = b""
        while chunk := silent.recv(4096):  # a 408 as well, then the end of the connection
            said += chunk
        assert said.startswith(b"HTTP/1.1 408"), said
    finally:
        trickling.close()
        silent.close()


def test_oversized_heads_are_refused_before_the_router(proxy: Server) -> None:
    port = proxy.port
    reply = exchange(port, head("/v1/models", "X-Big: " + "b" * 28_000))
    assert reply.status == 431 and reply.error()["code"] == "headers_too_large"
    reply = exchange(port, head("/v1/models", *filler(129)))
    assert reply.status == 431 and reply.error()["code"] == "headers_too_large"
    reply = exchange(port, head("/v1/models?" + "q" * 8192))
    assert reply.status == 414 and reply.error()["code"] == "url_too_long"
    # past HAProxy's buffer: its own 400, the connection closed
    reply = exchange(port, head("/v1/models", "X-Big: " + "b" * 200_000), then_closed=True)
    assert reply.status == 400
    # within the bounds: the router's answer
    reply = exchange(port, head("/v1/models", *filler(100), "X-Big: " + "b" * 22_000))
    assert reply.status == 200 and json.loads(reply.body)["object"] == "list"


H2C = ("Connection: Upgrade, HTTP2-Settings", "Upgrade: h2c", "HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA")
WEBSOCKET = ("Connection: Upgrade", "Upgrade: websocket", "Sec-WebSocket-Version: 13",
             "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==")


@pytest.mark.parametrize("offer", [H2C, WEBSOCKET], ids=["h2c", "websocket"])
def test_an_upgrade_offer_reaches_the_router_as_plain_http_1_1(proxy: Server, offer: tuple[str, ...]) -> None:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    request = head("/v1/chat/completions", *offer, f"Content-Length: {len(body)}", method="POST")
    with connect(proxy.port) as sock:
        sock.sendall(request)
        time.sleep(0.1)
        sock.sendall(body)  # the body in a write of its own (Ktor's clients)
        reply = read_reply(sock)
        # the router read the body (a lost one would be a 400 invalid_json) and had no node for it
        assert reply.status == 503 and reply.error()["code"] == "no_nodes", reply
        sock.sendall(head("/health"))
        assert read_reply(sock).status == 200


def test_the_router_alone_leaves_heads_unbounded(spawn: SpawnFactory, redis_url: str) -> None:
    """What the cfg is for: without HAProxy, the router's server takes a large head and waits for a silent
    client (the layer table in docs/reliability.md says so)."""
    router = spawn("router", "--redis-url", redis_url, name="router")
    reply = exchange(router.port, head("/v1/models", "X-Big: " + "b" * 200_000))
    assert reply.status == 200
    with socket.create_connection(("127.0.0.1", router.port), timeout=1.0) as silent, \
            pytest.raises(TimeoutError):
        silent.recv(1)
