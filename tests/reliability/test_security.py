"""Security with real processes: agent token, loopback-only upstreams, admin key, hashed client keys,
Redis password and ACL user, nothing internal in error bodies, headers sanitised both ways."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import redis
from rich.console import Console

import router.auth as auth
from macpool import demo
from macpool.dev import tiny_model
from macpool.dev.llama_build import find_llama_server
from macpool.dev.procs import macpool_argv
from macpool.dev.redis_server import RedisServer, free_port
from macpool.dev.stack import Stack
from router.top import TopView
from tests.conftest import Server, SpawnFactory
from tests.reliability.conftest import (
    ADMIN_KEY,
    AGENT_TOKEN,
    Rig,
    assert_clean,
    chat,
    wait_until,
)

pytestmark = pytest.mark.slow
JSON = {"Content-Type": "application/json"}


def test_agent_refuses_requests_without_the_token(rig: Rig) -> None:
    node = rig.node("sec", cap=2)
    body = chat("", 2, False)
    for headers in ({}, {"X-Macpool-Token": "wrong"}, {"Authorization": f"Bearer {AGENT_TOKEN}"}):
        for method, path in (
            ("POST", "/v1/chat/completions"),
            ("POST", "/completion"),
            ("GET", "/v1/models"),
        ):
            reply = httpx.request(
                method,
                node.agent.url + path,
                json=body if method == "POST" else None,
                headers=headers,
                timeout=10,
            )
            assert reply.status_code == 401, (path, headers, reply.text)
            assert reply.json()["error"]["code"] == "invalid_agent_token"
            assert_clean(reply.text, node.sim.url)
    assert node.stats()["completed"] == 0
    reply = httpx.post(
        node.agent.url + "/v1/chat/completions",
        json=body,
        headers={"X-Macpool-Token": AGENT_TOKEN},
        timeout=30,
    )
    assert reply.status_code == 200


def _listening(pid: int) -> set[str]:
    return {c.laddr.ip for c in psutil.Process(pid).net_connections(kind="inet") if c.status == "LISTEN"}


def _supervised_child(agent: Server) -> psutil.Process:
    def child() -> psutil.Process | None:
        children = [p for p in psutil.Process(agent.child.pid).children(recursive=True) if _listening(p.pid)]
        return children[0] if children else None

    found: psutil.Process = wait_until(child, 60, "the supervised server listening")
    return found


@pytest.mark.parametrize("server", ["sim", pytest.param("llama-server", marks=pytest.mark.llama_server)])
def test_supervised_upstream_listens_on_loopback_only(rig: Rig, server: str) -> None:
    model = tiny_model.ensure("tiny")
    if server == "sim":
        command = f"{sys.executable} -m macpool.cli sim --preset m5max-128g-14b-q4 --speed 20"
    else:
        binary = find_llama_server()
        if binary is None:
            pytest.skip("llama-server not built (macpool dev build-llama-server)")
        command = f"{binary} -t 1"  # in the command: the spawn fixture appends the agent's --port
    agent = rig.spawn(
        "agent",
        "run",
        "--llama-server",
        command,
        "--model",
        str(model),
        "--parallel",
        "1",
        "--ctx-per-slot",
        "256",
        "--redis-url",
        rig.redis_url,
        "--node-id",
        "sup",
        "--token",
        AGENT_TOKEN,
        "--host",
        "0.0.0.0",
        "--heartbeat-interval",
        "0.3",
        name=f"agent-sup-{server}",
    )
    child = _supervised_child(agent)
    assert _listening(child.pid) == {"127.0.0.1"}
    # the agent itself serves the LAN here (--host 0.0.0.0); its upstream is not reachable from outside
    port = int(child.cmdline()[child.cmdline().index("--port") + 1])
    outside = _non_loopback_address()
    if outside is not None:
        with pytest.raises(OSError), socket.create_connection((outside, port), timeout=2):
            pass


def _non_loopback_address() -> str | None:
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family == socket.AF_INET and not address.address.startswith("127."):
                return str(address.address)
    return None


@pytest.mark.in_process
def test_admin_endpoints_need_the_admin_key(rig: Rig, spawn: SpawnFactory) -> None:
    rig.node("adm", cap=2)
    router = rig.router()
    rig.wait_ready(router, nodes=1)
    url = router.url + "/admin/nodes/adm/drain"
    for headers in (
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": ADMIN_KEY},
        {"X-Macpool-Token": AGENT_TOKEN},
        {"Authorization": f"Bearer {AGENT_TOKEN}"},
    ):
        reply = httpx.post(url, headers=headers, timeout=10)
        assert reply.status_code == 401, (headers, reply.text)
        assert_clean(reply.text, ADMIN_KEY)
    assert rig.pool_doc(router)["pool"]["nodes_ready"] == 1
    reply = httpx.post(url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=10)
    assert reply.status_code == 200
    wait_until(lambda: rig.pool_doc(router)["pool"]["nodes_ready"] == 0, 10, "the node drained")
    # a router without an admin key has no admin API at all
    bare = spawn("router", "--redis-url", rig.redis_url, name="router-bare")
    reply = httpx.post(
        bare.url + "/admin/nodes/adm/undrain", headers={"Authorization": "Bearer x"}, timeout=10
    )
    assert reply.status_code == 401 and reply.json()["error"]["code"] == "admin_disabled"


def test_client_keys_are_hashed_and_compared_in_constant_time(
    rig: Rig, spawn: SpawnFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = tmp_path / "keys.txt"
    hashed = hashlib.sha256(b"sk-hashed-two").hexdigest()
    keys.write_text(f"# client keys\nsk-plain-one\n\n{hashed}\n")
    router = spawn("router", "--redis-url", rig.redis_url, "--api-keys-file", str(keys), name="router-keys")
    for key, status in (
        ("sk-plain-one", 200),
        ("sk-hashed-two", 200),
        (hashed, 401),
        ("sk-plain-on", 401),
        ("Basic c2stcGxhaW4tb25l", 401),
        (None, 401),
    ):
        headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions")):
            reply = httpx.request(
                method,
                router.url + path,
                headers=headers,
                timeout=10,
                json=chat("", 2, False) if method == "POST" else None,
            )
            expected = status if method == "GET" or status == 401 else 503  # no nodes: past auth
            assert reply.status_code == expected, (key, path, reply.text)
            assert_clean(reply.text, "sk-plain-one", hashed)
    # what the router keeps: 32-byte SHA-256 digests, never the plaintext
    loaded = auth.load_api_keys(keys)
    assert [k.digest for k in loaded] == [hashlib.sha256(b"sk-plain-one").digest(), bytes.fromhex(hashed)]
    # every stored digest is compared with hmac.compare_digest, whichever matches (or none)
    calls: list[int] = []
    real = auth.hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append(1)
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    ring = auth.KeyRing(loaded * 4)
    for presented in ("sk-plain-one", "sk-hashed-two", "nope"):
        calls.clear()
        ring.accepts(presented)
        assert len(calls) == len(ring.keys)


def test_redis_password_and_acl_user(stack: Stack, tmp_path: Path) -> None:
    password, acl_password = "pw-Redis-s3cret", "acl-Pass-w0rd"
    with RedisServer(password=password) as server:
        admin = redis.Redis(port=server.port, password=password)
        admin.execute_command(
            "ACL",
            "SETUSER",
            "macpool",
            "on",
            f">{acl_password}",
            "~macpool:*",
            "&macpool:*",
            "+@all",
            "-@dangerous",
        )
        user_url = f"redis://macpool:{acl_password}@127.0.0.1:{server.port}/0"
        limited = redis.Redis.from_url(user_url)
        with pytest.raises(redis.exceptions.NoPermissionError):
            limited.get("someone-else:key")  # the ACL is live: only macpool:* keys
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(port=server.port).ping()
        rig = Rig(stack, server.url)  # the password URL for the agents
        rig.node("acl", cap=2)
        router = rig.router(redis_url=user_url)  # the ACL user for the router
        rig.wait_ready(router, nodes=1)
        assert httpx.get(router.url + "/ready", timeout=10).status_code == 200
        reply = httpx.post(router.url + "/v1/chat/completions", json=chat("", 2, False), timeout=30)
        assert reply.status_code == 200
        wait_until(lambda: admin.zcard("macpool:{pool}:resv:acl") == 0, 10, "the reservation released")
        limited.close()
        admin.close()
    for log in tmp_path.glob("*.log"):
        text = log.read_text(errors="replace")
        assert password not in text and acl_password not in text, log.name


def test_error_bodies_carry_nothing_internal(rig: Rig, spawn: SpawnFactory) -> None:
    router = rig.router("--max-body-bytes", "4096", "--first-byte-timeout", "3")
    bodies = []
    # no node yet: 503 no_nodes
    bodies.append(httpx.post(router.url + "/v1/chat/completions", json=chat(), timeout=10))
    node = rig.node("leak", cap=1)
    # an agent that wants another token: the router's answer names no URL and no token
    sim = rig.sim("other")
    other = rig.agent("other", sim.url, "--token", "some-other-token", cap=1)
    rig.wait_ready(router, nodes=2)
    with httpx.Client(base_url=router.url, timeout=30) as client:
        bodies += [
            client.get("/nope"),
            client.delete("/v1/chat/completions"),
            client.post("/v1/chat/completions", content=b"{not json", headers=JSON),
            client.post("/v1/chat/completions", content=b"[1]", headers=JSON),
            client.post("/v1/chat/completions", content=b"x" * 5000, headers=JSON),
            client.post("/v1/chat/completions", content=b"{}", headers={"Content-Type": "text/plain"}),  # 415
            client.post("/v1/chat/completions", json=chat("no-such-model")),
            client.post("/v1/chat/completions", json={"model": 5}),
        ]
        for _ in range(6):  # some land on the misconfigured agent (502), the rest are served
            bodies.append(client.post("/v1/chat/completions", json=chat("", 2, False)))
        node.agent.child.kill()  # a dead agent: connect errors, failover, maybe 502/503
        for _ in range(4):
            bodies.append(client.post("/v1/chat/completions", json=chat("", 2, False)))
    statuses = {reply.status_code for reply in bodies}
    assert {400, 404, 405, 413, 415, 503} <= statuses, statuses
    assert 502 in statuses, statuses
    for reply in bodies:
        assert_clean(
            reply.text,
            node.agent.url,
            node.sim.url,
            other.url,
            sim.url,
            "some-other-token",
            f":{node.agent.port}",
            f":{other.port}",
        )
        if reply.status_code >= 400:
            assert set(reply.json()["error"]) >= {"message", "type", "code"}


def _echo_pool(rig: Rig, spawn: SpawnFactory) -> tuple[Server, Server, Server]:
    """A router and an agent in front of tests/reliability/echo_upstream.py (it answers what it received)."""
    port = free_port()
    echo = spawn(
        argv=[sys.executable, "-m", "tests.reliability.echo_upstream", "--port", str(port)],
        port=port,
        name="echo",
    )
    agent = rig.agent("echo", echo.url, cap=2)
    router = rig.router()
    rig.wait_ready(router, nodes=1)
    return echo, agent, router


def test_headers_sanitised_both_ways(rig: Rig, spawn: SpawnFactory) -> None:
    echo, agent, router = _echo_pool(rig, spawn)
    sent = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
        "Connection: keep-alive, X-Hop-Client\r\nX-Hop-Client: private\r\nKeep-Alive: timeout=5\r\n"
        "TE: trailers\r\nProxy-Authorization: Basic Zm9vOmJhcg==\r\nX-Conversation-Id: conv-1\r\n"
        "X-Macpool-Token: forged\r\nX-Macpool-Node: forged-node\r\nX-Macpool-Reason: forged\r\n"
        "X-Request-ID: req-abc-123\r\nAuthorization: Bearer client-key\r\nX-Client-Kept: yes\r\n"
    )
    body = json.dumps(chat("", 2, False)).encode()
    with socket.create_connection(("127.0.0.1", router.port), timeout=30) as sock:
        sock.sendall(f"{sent}Content-Length: {len(body)}\r\n\r\n".encode() + body)
        raw = b""
        while b"\r\n\r\n" not in raw or not raw.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            raw += chunk
    head, _, payload = raw.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    assert " 200 " in status_line, raw[:500]
    down = [line.split(":", 1)[0].strip().lower() for line in header_lines]
    values = {line.split(":", 1)[0].strip().lower(): line.split(":", 1)[1].strip() for line in header_lines}
    if payload.startswith(b"{") is False:  # chunked
        payload = payload.split(b"\r\n", 1)[1].rsplit(b"\r\n0\r\n", 1)[0]
    received = {k.lower(): v for k, v in json.loads(payload)["headers"]}
    # upstream (what llama-server got): no hop-by-hop, no X-Conversation-Id, no forged X-Macpool-*,
    # not the client's key; the request id kept
    for name in (
        "keep-alive",
        "te",
        "proxy-authorization",
        "x-hop-client",
        "x-conversation-id",
        "x-macpool-token",
        "x-macpool-stream",
        "x-macpool-node",
        "x-macpool-reason",
        "authorization",
    ):
        assert name not in received, (name, received)
    assert received["x-request-id"] == "req-abc-123"
    assert received["x-client-kept"] == "yes"
    # downstream (what the client got): none of the upstream's hop-by-hop headers; our own ids
    for name in ("keep-alive", "proxy-authenticate", "upgrade", "trailer", "x-hop-upstream"):
        assert name not in down, (name, header_lines)
    assert values.get("x-upstream-kept") == "yes"
    assert values["x-request-id"] == "req-abc-123"
    assert values["x-macpool-node"] == "echo"
    assert_clean(raw, agent.url, echo.url)


def test_a_body_the_router_found_streamed_is_passed_on_unparsed(rig: Rig, spawn: SpawnFactory) -> None:
    _, agent, router = _echo_pool(rig, spawn)
    url, token = "/v1/chat/completions", {"x-macpool-token": AGENT_TOKEN}

    def upstream_got(base: str, body: dict[str, object], headers: dict[str, str]) -> dict[str, object]:
        answer = httpx.post(base + url, json=body, headers=headers, timeout=30)
        assert answer.status_code == 200, answer.text
        got: dict[str, object] = json.loads(answer.json()["body"])
        return got

    # through the router, a streamed request reaches llama-server as the client sent it
    streamed = chat("", 2, True)
    assert upstream_got(router.url, streamed, {}) == streamed
    # the agent asks for a stream in a client's stead only when nobody said the body is streamed already
    plain = chat("", 2, False)
    assert upstream_got(agent.url, plain, token)["stream"] is True
    # the router's word is taken for it (the agent does not parse the body again): passed on as it is
    assert upstream_got(agent.url, plain, token | {"x-macpool-stream": "1"}) == plain


# --- safe defaults (docs/security.md "Safe defaults") ------------------------------------------------------

READ_KEY = "reliability-read-key-5e1b"
SECRET_FLAGS = ("--admin-key", "--read-key", "--agent-token")


def _refused_at_start(*args: str, env: dict[str, str] | None = None) -> str:
    """``macpool <args>`` exits 2 at once with one line on stderr (no traceback); that line."""
    result = subprocess.run(macpool_argv(*args), capture_output=True, text=True, timeout=60,
                            env={**os.environ, **(env or {})})
    assert result.returncode == 2, (args, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if "warning:" not in line]
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_an_open_router_or_agent_beyond_loopback_refuses_to_start(rig: Rig, spawn: SpawnFactory) -> None:
    line = _refused_at_start("router", "--redis-url", rig.redis_url, "--host", "0.0.0.0")
    assert "refusing to serve 0.0.0.0 without client API keys" in line and "--trusted-network" in line
    line = _refused_at_start("agent", "run", "--upstream", "http://127.0.0.1:9", "--redis-url", rig.redis_url,
                             "--host", "0.0.0.0")
    assert "refusing to serve 0.0.0.0 without an agent token" in line and "--trusted-network" in line
    # the operator's word that the network is trusted, or a credential: they start
    open_router = spawn("router", "--redis-url", rig.redis_url, "--host", "0.0.0.0", "--trusted-network",
                        name="router-trusted")
    assert httpx.get(open_router.url + "/health", timeout=10).status_code == 200
    sim = rig.sim("open")
    agent = spawn("agent", "run", "--upstream", sim.url, "--redis-url", rig.redis_url, "--node-id", "open",
                  "--host", "0.0.0.0", "--trusted-network", name="agent-trusted")
    assert httpx.get(agent.url + "/health", timeout=10).status_code == 200
    # loopback stays as it was: no key, no flag
    local = spawn("router", "--redis-url", rig.redis_url, name="router-local")
    assert httpx.get(local.url + "/health", timeout=10).status_code == 200


def test_secrets_from_files_and_the_environment_placeholders_and_short_ones_refused(
    rig: Rig, spawn: SpawnFactory, tmp_path: Path
) -> None:
    for value, why in (("CHANGE-ME", "placeholder"), ("change-me-to-a-long-secret", "placeholder"),
                       ("<your admin key>", "placeholder"), ("short-secret", "12 characters")):
        line = _refused_at_start("router", "--redis-url", rig.redis_url, env={"MACPOOL_ADMIN_KEY": value})
        assert why in line and value not in line, line
        line = _refused_at_start("agent", "run", "--upstream", "http://127.0.0.1:9", "--redis-url",
                                 rig.redis_url, env={"MACPOOL_AGENT_TOKEN": value})
        assert why in line and value not in line, line
    line = _refused_at_start("router", "--redis-url", rig.redis_url, "--admin-key-file", str(tmp_path / "no"))
    assert "No such file" in line
    empty = tmp_path / "empty"
    empty.write_text("\n")
    assert "empty" in _refused_at_start("agent", "run", "--upstream", "http://127.0.0.1:9", "--token-file",
                                        str(empty))
    # from files: the first line, its line end dropped; the router's and the agent's token agree
    (tmp_path / "admin").write_text(ADMIN_KEY + "\n")
    (tmp_path / "token").write_text(AGENT_TOKEN + "\n")
    sim = rig.sim("files")
    spawn("agent", "run", "--upstream", sim.url, "--redis-url", rig.redis_url, "--node-id", "files",
          "--token-file", str(tmp_path / "token"), "--heartbeat-interval", "0.3", name="agent-files")
    router = spawn("router", "--redis-url", rig.redis_url, "--admin-key-file", str(tmp_path / "admin"),
                   "--agent-token-file", str(tmp_path / "token"), "--refresh-interval", "0.5",
                   name="router-files")
    rig.wait_ready(router, nodes=1)
    served = httpx.post(router.url + "/v1/chat/completions", json=chat("", 2, False), timeout=30)
    assert served.status_code == 200, served.text  # the agent took the router's token
    drained = httpx.post(router.url + "/admin/nodes/files/drain", timeout=10,
                         headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert drained.status_code == 200
    argv = psutil.Process(router.child.pid).cmdline()
    assert not any(AGENT_TOKEN in arg or ADMIN_KEY in arg for arg in argv)


def test_a_secret_on_the_command_line_draws_a_warning(rig: Rig) -> None:
    for flag in SECRET_FLAGS:
        result = subprocess.run(macpool_argv("router", "--redis-url", rig.redis_url, flag, "x" * 20 + "y",
                                             "--help"), capture_output=True, text=True, timeout=60)
        assert f"warning: {flag} on the command line is visible" in result.stderr, flag
    result = subprocess.run(macpool_argv("agent", "run", "--token=" + AGENT_TOKEN, "--upstream", "bad"),
                            capture_output=True, text=True, timeout=60)
    assert "warning: --token on the command line is visible" in result.stderr
    assert AGENT_TOKEN not in result.stderr


def test_the_embedded_redis_shows_no_password_in_ps() -> None:
    password = "embedded-redis-password-3d9a"
    with RedisServer(password=password) as server:
        assert server.process is not None
        assert not any(password in arg for arg in psutil.Process(server.process.pid).cmdline())
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(port=server.port).ping()
        assert redis.Redis.from_url(server.url).ping()

def test_the_demo_shows_no_secret_in_ps(tmp_path: Path) -> None:
    pool = demo.Pool(demo.DemoSettings(nodes=1, port=free_port(), speed=20), tmp_path)
    try:
        pool.start(lambda line: None)
        secret = (pool.settings.admin_key, pool.settings.agent_token)
        assert len(pool.stack.procs) >= 3
        for proc in pool.stack.procs:
            argv = psutil.Process(proc.pid).cmdline()
            assert not any(s in arg for s in secret for arg in argv), (proc.name, argv)
    finally:
        pool.stack.stop()


def _observability(router: Server) -> dict[str, int]:
    return {path: httpx.get(router.url + path, timeout=10).status_code
            for path in ("/metrics", "/api/pool", "/api/pool/scale")}


def test_observability_needs_the_read_or_admin_key(rig: Rig, spawn: SpawnFactory, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("sk-client-key-of-a-team name=team\n")
    (tmp_path / "read").write_text(READ_KEY)
    rig.node("obs", cap=2)
    router = rig.router("--api-keys-file", str(keys), "--read-key-file", str(tmp_path / "read"))
    rig.wait_ready(router, nodes=1, key=READ_KEY)
    paths = ("/metrics", "/api/pool", "/api/pool/scale", "/api/pool/stream")
    for headers, cookies, status in (
        ({}, {}, 401),
        ({"Authorization": "Bearer sk-client-key-of-a-team"}, {}, 401),  # a client key is not for this
        ({"Authorization": f"Bearer {READ_KEY}x"}, {}, 401),
        ({"Authorization": f"Bearer {READ_KEY}"}, {}, 200),
        ({"Authorization": f"Bearer {ADMIN_KEY}"}, {}, 200),
        ({}, {"macpool_key": READ_KEY}, 200),  # the dashboard's cookie (its EventSource sends no header)
    ):
        with httpx.Client(base_url=router.url, headers=headers, cookies=cookies, timeout=10) as client:
            for path in paths:
                with client.stream("GET", path) as reply:
                    assert reply.status_code == status, (path, headers, cookies)
                    if status == 401:
                        reply.read()
                        assert reply.json()["error"]["code"] == "invalid_read_key"
                        assert_clean(reply.text, READ_KEY, ADMIN_KEY)
    # liveness, readiness and the page itself (it holds no figure, and asks for the key) stay open
    for path in ("/health", "/ready", "/dashboard"):
        assert httpx.get(router.url + path, timeout=10).status_code == 200, path
    # the read key is no admin key
    drain = httpx.post(router.url + "/admin/nodes/obs/drain", timeout=10,
                       headers={"Authorization": f"Bearer {READ_KEY}"})
    assert drain.status_code == 401


def test_observability_beyond_loopback_needs_a_key_even_without_a_read_key(
    rig: Rig, spawn: SpawnFactory, tmp_path: Path
) -> None:
    keys = tmp_path / "keys"
    keys.write_text("sk-client-key-of-a-team\n")
    lan = rig.router("--host", "0.0.0.0", "--api-keys-file", str(keys))  # an admin key, no read key
    assert set(_observability(lan).values()) == {401}
    with_admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    assert httpx.get(lan.url + "/api/pool", headers=with_admin, timeout=10).status_code == 200
    # on loopback without a read key, as before: open (the demo's dashboard needs no key)
    local = rig.router(name="router-local")
    assert set(_observability(local).values()) == {200}
    # beyond loopback, trusted, with no key at all: nothing to ask for
    trusted = spawn("router", "--redis-url", rig.redis_url, "--host", "0.0.0.0", "--trusted-network",
                    name="router-trusted")
    assert set(_observability(trusted).values()) == {200}
    # client keys but neither a read key nor an admin key: closed, and the answer says what to set
    bare = spawn("router", "--redis-url", rig.redis_url, "--host", "0.0.0.0", "--api-keys-file", str(keys),
                 name="router-bare")
    reply = httpx.get(bare.url + "/api/pool", timeout=10)
    assert reply.status_code == 401 and reply.json()["error"]["code"] == "read_disabled"


def test_agent_status_hides_paths_and_argv_without_the_token(rig: Rig) -> None:
    model = tiny_model.ensure("tiny")
    command = f"{sys.executable} -m macpool.cli sim --preset m5max-128g-14b-q4 --speed 20"
    agent = rig.spawn("agent", "run", "--llama-server", command, "--model", str(model), "--parallel", "1",
                      "--ctx-per-slot", "256", "--redis-url", rig.redis_url, "--node-id", "status",
                      "--heartbeat-interval", "0.3", env={"MACPOOL_AGENT_TOKEN": AGENT_TOKEN},
                      name="agent-status")

    def status(headers: dict[str, str]) -> dict[str, Any]:
        reply = httpx.get(agent.url + "/status", headers=headers, timeout=10)
        assert reply.status_code == 200
        got: dict[str, Any] = reply.json()
        return got

    full = wait_until(lambda: (s := status({"X-Macpool-Token": AGENT_TOKEN})).get("llama_server") and s,
                      60, "the supervised server described")
    assert full["model"]["path"] == str(model) and full["llama_server"]["argv"]
    for headers in ({}, {"X-Macpool-Token": "wrong"}):
        public = status(headers)
        assert "path" not in public["model"] and "argv" not in public["llama_server"], public
        assert public["state"] == full["state"] and "pid" in public["llama_server"]
        assert str(model) not in json.dumps(public)
    assert httpx.get(agent.url + "/health", timeout=10).status_code == 200


# --- browsers (docs/security.md "Safe defaults") ---------------------------------------------------------

@pytest.mark.in_process
def test_a_browser_cannot_send_a_simple_cross_site_request(rig: Rig) -> None:
    node = rig.node("web", cap=2)
    router = rig.router("--cors-origins", "https://chat.example.com")
    rig.wait_ready(router, nodes=1)
    body = json.dumps(chat("", 2, False)).encode()
    url = router.url + "/v1/chat/completions"
    # what a page can send without a preflight: a form or text/plain (415), or a Blob with no type at all,
    # which the page sends with its Origin (403)
    for content_type in ("text/plain;charset=UTF-8", "application/x-www-form-urlencoded"):
        reply = httpx.post(url, content=body, headers={"Content-Type": content_type}, timeout=10)
        assert reply.status_code == 415, (content_type, reply.text)
        assert reply.json()["error"]["code"] == "unsupported_media_type"
    untyped = httpx.post(url, content=body, headers={"Origin": "https://evil.example.com"}, timeout=10)
    assert untyped.status_code == 403 and untyped.json()["error"]["code"] == "origin_not_allowed"
    assert httpx.post(url, content=body, timeout=10).status_code == 200  # no browser: read as JSON
    messages = httpx.post(router.url + "/v1/messages", content=b"{}", timeout=10,
                          headers={"Content-Type": "text/plain"})
    assert messages.status_code == 415 and messages.json()["type"] == "error"  # Anthropic's document
    # an origin not allowed is refused whatever it sends; the allowed one, the router's own, and a client
    # that is no browser (no Origin) are served
    origins = (("https://evil.example.com", 403), ("null", 403), ("https://chat.example.com", 200),
               (router.url, 200), (None, 200))
    for origin, status in origins:
        headers = {"Content-Type": "application/json; charset=utf-8"} | ({"Origin": origin} if origin else {})
        reply = httpx.post(url, content=body, headers=headers, timeout=30)
        assert reply.status_code == status, (origin, reply.text)
        if status == 403:
            assert reply.json()["error"]["code"] == "origin_not_allowed"
    evil = {"Origin": "https://evil.example.com"}
    assert httpx.get(router.url + "/api/pool", headers=evil, timeout=10).status_code == 403
    assert node.stats()["completed"] == 4  # the untyped one without an Origin, and the three allowed


def test_a_batch_key_cannot_raise_itself_to_interactive(rig: Rig, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("sk-nightly-batch-key name=nightly priority=batch\nsk-interactive-key-1 name=dev\n")
    node = rig.node("prio", cap=1, speed=2.0)
    # batch never queues (its share of the queue is 0): a batch request finds a full pool shed at once
    router = rig.router("--api-keys-file", str(keys), "--batch-queue-share", "0", "--queue-size", "4",
                        "--queue-timeout", "30")
    rig.wait_ready(router, nodes=1)
    url = router.url + "/v1/chat/completions"
    with ThreadPoolExecutor(2) as pool:
        busy = pool.submit(httpx.post, url, json=chat("", 600, False), timeout=120,
                           headers={"Authorization": "Bearer sk-interactive-key-1"})
        wait_until(lambda: node.stats()["processing"] == 1, 10, "the node's one slot busy")
        raised = httpx.post(url, json=chat("", 2, False), timeout=30, headers={
            "Authorization": "Bearer sk-nightly-batch-key", "X-Macpool-Priority": "interactive"})
        assert raised.status_code == 503 and raised.json()["error"]["code"] == "batch_shed", raised.text
        # the header still lowers: an interactive key's request asking for batch is shed the same way
        lowered = httpx.post(url, json=chat("", 2, False), timeout=30, headers={
            "Authorization": "Bearer sk-interactive-key-1", "X-Macpool-Priority": "batch"})
        assert lowered.status_code == 503 and lowered.json()["error"]["code"] == "batch_shed"
        assert not busy.done()  # (both found the slot taken)
        assert busy.result(timeout=120).status_code == 200


def test_top_shows_what_redis_says_as_text_not_markup() -> None:
    forged = "[link=http://evil.example][bold red]mac-1[/bold red][/link]"
    view = {"router_id": "r", "redis_ok": True, "pool": {},
            "nodes": [{"node_id": forged, "models": ["[blink]m[/blink]"], "reason": "[red]x[/red]"}]}
    console = Console(width=400, record=True)
    console.print(TopView().render(view, "http://router", 0.0, 400))
    text = console.export_text()
    assert forged in text and "[blink]m[/blink]" in text and "[red]x[/red]" in text
