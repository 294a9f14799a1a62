"""Fuzzing the router's HTTP surface with hypothesis, against a real router, agent and simulator.

Zero 5xx produced by the router itself (a 503 with ``X-Macpool-Reason`` is the pool's honest answer; a 5xx
relayed from a node carries ``X-Macpool-Node``), no crash, no leaked slot, nothing internal in a body.
"""

from __future__ import annotations

import json
import socket
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from macpool.apis import APIS
from tests.raw_http import parse_head
from tests.reliability.conftest import Node, Rig, assert_clean, wait_until

pytestmark = pytest.mark.slow

MAX_BODY = 65536
PROXIED = list(APIS)
FUZZ = settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


pytestmark = pytest.mark.in_process  # none of these tests is about a process


@pytest.fixture
def target(rig: Rig) -> tuple[Rig, Node, str]:
    node = rig.node("fz", cap=2, speed=50)
    router = rig.router("--max-body-bytes", str(MAX_BODY), "--queue-size", "2", "--queue-timeout", "0.2")
    rig.wait_ready(router, nodes=1)
    return rig, node, router.url


def check(status: int | None, headers: dict[str, str], body: bytes, node: Node) -> None:
    """The router's own answers are never 5xx (503 pool answers aside) and never leak internals."""
    if status is None:
        return  # the server refused to parse it and closed the connection: fine
    relayed = "x-macpool-node" in headers
    if status >= 500 and not relayed:
        assert status == 503 and "x-macpool-reason" in headers, (status, headers, body[:300])
    assert_clean(body, node.agent.url, node.sim.url)
    json_body = body and headers.get("content-type", "").startswith("application/json")
    if not relayed and status >= 400 and json_body:
        document = json.loads(body)
        error = document["error"]
        assert {"message", "type", "code"} <= set(error)
        assert document.get("type", "error") == "error"  # Anthropic's, on its paths


def after(rig: Rig, node: Node, url: str) -> None:
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    wait_until(lambda: rig.reservations(node.node_id) == 0, 10, "no reservation left")
    wait_until(lambda: node.status()["in_flight"] == 0, 10, "the agent idle")


json_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True), st.text(max_size=40)
)
json_any = st.recursive(
    json_leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
messages = st.one_of(
    json_any,
    st.lists(
        st.fixed_dictionaries(
            {
                "role": st.sampled_from(["user", "system", "x", ""]),
                "content": st.one_of(st.text(max_size=60), json_any),
            }
        ),
        max_size=3,
    ),
)
payloads = st.fixed_dictionaries(
    {},
    optional={
        "model": json_any,
        "messages": messages,
        "prompt": st.one_of(st.text(max_size=60), json_any),
        "input": st.one_of(st.text(max_size=60), json_any),
        "stream": json_any,
        "system": st.one_of(st.text(max_size=60), json_any),
        "instructions": st.one_of(st.text(max_size=60), json_any),
        "tools": json_any,
        "max_tokens": st.one_of(st.integers(-5, 6), json_any),
        "max_output_tokens": st.one_of(st.integers(-5, 6), json_any),
        "n_predict": st.one_of(st.integers(-5, 6), json_any),
    },
)


def _truncate(data: tuple[dict[str, Any], int]) -> bytes:
    text = json.dumps(data[0]).encode()
    return text[: data[1] % (len(text) + 1)]


def _nested(depth: int) -> bytes:
    return b'{"messages": ' + b"[" * depth + b"]" * depth + b"}"


valid_chats = st.fixed_dictionaries(
    {
        "messages": st.lists(
            st.fixed_dictionaries({"role": st.just("user"), "content": st.text(max_size=80)}),
            min_size=1,
            max_size=2,
        ),
        "max_tokens": st.integers(1, 4),
        "stream": st.booleans(),
    },
    optional={
        "model": st.text(max_size=10),
        "temperature": json_any,
        "x-extra": json_any,
        "n_probs": json_any,
    },
)

bodies = st.one_of(
    valid_chats.map(lambda p: json.dumps(p).encode()),
    payloads.map(lambda p: json.dumps(p).encode()),
    st.tuples(payloads, st.integers(0, 10_000)).map(_truncate),
    st.binary(max_size=300),
    st.integers(1, 200_000).map(_nested),
    st.integers(MAX_BODY - 10, MAX_BODY * 4).map(lambda n: b'{"prompt": "' + b"a" * n + b'"}'),
    st.binary(min_size=1, max_size=40).map(lambda b: b'{"model": "' + b + b"\xff\xfe" + b'"}'),
    st.sampled_from([b"", b"null", b"[]", b'"x"', b"1e999999", b'{"stream": true}', b"{" * 5000]),
)


def test_fuzz_bodies(target: tuple[Rig, Node, str]) -> None:
    rig, node, url = target
    with httpx.Client(base_url=url, timeout=30) as client:

        @FUZZ
        @given(
            path=st.sampled_from(PROXIED),
            body=bodies,
            content_type=st.sampled_from(
                ["application/json", "text/plain", "", "application/json; charset=latin-1"]
            ),
        )
        def run(path: str, body: bytes, content_type: str) -> None:
            headers = {"content-type": content_type} if content_type else {}
            reply = client.post(path, content=body, headers=headers)
            check(reply.status_code, dict(reply.headers), reply.content, node)
            sent.append(reply.status_code)

        sent: list[int] = []
        run()
        assert len(sent) >= 50, len(sent)  # hypothesis really ran the examples
        print(f"fuzzed bodies: {len(sent)} requests, statuses {sorted(set(sent))}")
    after(rig, node, url)


def raw_exchange(
    port: int, data: bytes, timeout: float = 10.0, hang_up: bool = False
) -> tuple[int | None, dict[str, str], bytes]:
    """Send raw bytes; (status or None if the server closed without answering, headers, body).

    ``hang_up``: close our side once sent (a client gone before its answer: the server may take the request
    for abandoned); else wait, as a client does, for the answer and the server's close (Connection: close).
    """
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        try:
            sock.sendall(data)
            if hang_up:
                sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        chunks = []
        try:
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        except (ConnectionResetError, TimeoutError):
            pass
    raw = b"".join(chunks)
    if not raw.startswith(b"HTTP/1.1 "):
        return None, {}, raw
    head, _, body = raw.partition(b"\r\n\r\n")
    lines, headers = parse_head(head)
    if headers.get("transfer-encoding") == "chunked":
        body = _dechunk(body)
    return int(lines[0].split()[1]), headers, body


def _dechunk(body: bytes) -> bytes:
    out = []
    while body:
        size_line, _, rest = body.partition(b"\r\n")
        size = int(size_line.split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out.append(rest[:size])
        body = rest[size + 2 :]
    return b"".join(out)


header_name = st.text(
    st.characters(min_codepoint=33, max_codepoint=126, exclude_characters=":"), min_size=1, max_size=30
)
header_value = st.one_of(
    st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=200),
    st.binary(max_size=50).map(lambda b: b.decode("latin-1")),
    st.integers(1, 70_000).map(lambda n: "v" * n),
)
paths = st.one_of(
    st.sampled_from(
        [
            *PROXIED,
            "/v1/models",
            "/health",
            "/ready",
            "/metrics",
            "/api/pool",
            "/admin/nodes/fz/drain",
            "/admin/nodes/x/undrain",
            "/",
            "/v1",
            "/v1/chat/completions/",
            "//v1/models",
            "/%00",
            "/v1/../admin/nodes/fz/drain",
            "/" + "a" * 9000,
        ]
    ),
    st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=60).map(lambda t: "/" + t),
)


def test_fuzz_surface(target: tuple[Rig, Node, str]) -> None:
    """Odd methods, paths and headers, sent as raw bytes (no client library smoothing them over)."""
    rig, node, url = target
    port = int(url.rsplit(":", 1)[1])

    @FUZZ
    @given(
        method=st.sampled_from(
            ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "TRACE", "FOO", "G\x01T"]
        ),
        path=paths,
        headers=st.lists(st.tuples(header_name, header_value), max_size=6),
        body=st.one_of(st.just(b""), st.just(b'{"max_tokens": 2, "prompt": "hi"}'), st.binary(max_size=100)),
        length=st.sampled_from(["exact", "none", "short", "long", "bogus", "chunked"]),
    )
    def run(method: str, path: str, headers: list[tuple[str, str]], body: bytes, length: str) -> None:
        lines = [f"{method} {path} HTTP/1.1", "Host: router", "Connection: close"]
        lines += [
            f"{name}: {value}"
            for name, value in headers
            if name.lower() not in ("content-length", "transfer-encoding", "host", "connection")
        ]
        payload = body
        if length == "exact":
            lines.append(f"Content-Length: {len(body)}")
        elif length == "short":
            lines.append(f"Content-Length: {max(len(body) - 3, 0)}")
        elif length == "long":
            lines.append(f"Content-Length: {len(body) + 5}")  # truncated body: the client hangs up early
        elif length == "bogus":
            lines.append("Content-Length: -1x")
        elif length == "chunked":
            lines.append("Transfer-Encoding: chunked")
            payload = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
        data = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1", errors="replace") + payload
        # a body shorter than its Content-Length: the client hangs up (else the server waits for the rest)
        status, reply_headers, reply_body = raw_exchange(port, data, hang_up=length == "long")
        if method == "HEAD":
            reply_body = b""
        check(status, reply_headers, reply_body, node)
        sent.append(status or 0)

    sent: list[int] = []
    run()
    assert len(sent) >= 50, len(sent)
    print(f"fuzzed surface: {len(sent)} requests, statuses {sorted(set(sent))}")
    # a single oversized header block and a flood of headers
    for data in (
        b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n",
        b"GET /health HTTP/1.1\r\n" + b"".join(b"X-%d: y\r\n" % i for i in range(5000)) + b"\r\n",
    ):
        status, reply_headers, reply_body = raw_exchange(port, data)
        check(status, reply_headers, reply_body, node)
    after(rig, node, url)
