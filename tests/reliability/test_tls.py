"""HTTPS end to end with real processes and the PKI of `macpool pool certs`: an agent that serves HTTPS and
asks its clients for a certificate of the pool CA, in front of a simulator; a router that serves HTTPS,
verifies the agent against the pool CA and shows its own certificate; a router without the CA that refuses
the node; a client certificate of another CA that the agent refuses."""

from __future__ import annotations

import re
import ssl
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from macpool.dev.procs import macpool_argv
from macpool.dev.stack import Proc, Stack
from macpool.upstream import client_tls
from tests.reliability.conftest import AGENT_TOKEN, PRESET

MODEL = "tls-model"
LOOPBACK = ("127.0.0.1", "localhost")


def _certs(out: Path, *args: str) -> None:
    """``macpool pool certs --out OUT ARGS`` as an operator runs it."""
    done = subprocess.run(macpool_argv("pool", "certs", "--out", str(out), *args), capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr


@dataclass
class TlsPool:
    pki: Path
    other: Path  # another CA's PKI
    redis_url: str
    agent: Proc
    router: Proc


@pytest.fixture
def tls_pool(stack: Stack, redis_url: str, tmp_path: Path) -> Iterator[TlsPool]:
    pki, other = tmp_path / "pki", tmp_path / "other-pki"
    _certs(pki, "--router", *LOOPBACK, "--node", "mac-1=" + ",".join(LOOPBACK))
    _certs(other, "--router", *LOOPBACK)
    sim = stack.sim("sim", "--preset", PRESET, "--alias", MODEL, "--speed", "50")
    # mutual TLS: the agent asks every client for a certificate of the pool CA (its readiness probe too)
    agent = stack.agent(
        "agent", sim.url, redis_url, "mac-1", "--token", AGENT_TOKEN, "--heartbeat-interval", "0.2",
        "--tls-cert", str(pki / "node-mac-1.pem"), "--tls-key", str(pki / "node-mac-1-key.pem"),
        "--tls-client-ca", str(pki / "ca.pem"),
        tls=client_tls(pki / "ca.pem", pki / "router.pem", pki / "router-key.pem"),
    )
    router = stack.router(
        "router", redis_url, "--agent-token", AGENT_TOKEN,
        "--tls-cert", str(pki / "router.pem"), "--tls-key", str(pki / "router-key.pem"),
        "--node-ca", str(pki / "ca.pem"), "--node-cert", str(pki / "router.pem"),
        "--node-key", str(pki / "router-key.pem"),
        tls=client_tls(pki / "ca.pem"),
    )
    yield TlsPool(pki, other, redis_url, agent, router)


def _chat(url: str, verify: ssl.SSLContext | bool | None) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=30,
                      verify=True if verify is None else verify)


def test_a_request_over_https_to_an_agent_that_requires_the_pool_ca(tls_pool: TlsPool, stack: Stack) -> None:
    ca = client_tls(tls_pool.pki / "ca.pem")
    assert tls_pool.router.url.startswith("https://") and tls_pool.agent.url.startswith("https://")
    pool = stack.wait_nodes(tls_pool.router.url, 1, verify=ca)
    # the agent's heartbeat names its https:// URL
    assert [node["url"] for node in pool["nodes"]] == [tls_pool.agent.url], pool["nodes"]
    answer = _chat(tls_pool.router.url, ca)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"]
    # clients that do not trust the pool CA do not reach the router
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        _chat(tls_pool.router.url, True)


def test_a_router_without_the_pool_ca_refuses_the_node(tls_pool: TlsPool, stack: Stack) -> None:
    pki = tls_pool.pki
    # its client certificate is right; it checks the agent's against the system's CAs
    router = stack.router("router-no-ca", tls_pool.redis_url, "--agent-token", AGENT_TOKEN,
                          "--node-cert", str(pki / "router.pem"), "--node-key", str(pki / "router-key.pem"),
                          "--circuit-failures", "2", "--circuit-cooldown", "600")
    stack.wait_nodes(router.url, 1)
    # refused as a node that cannot be reached (docs/router.md: 502 upstream_unavailable), then, its
    # circuit open, not tried at all: 503 with Retry-After
    first = _chat(router.url, True)
    assert first.status_code == 502 and first.json()["error"]["code"] == "upstream_unavailable", first.text
    logged = router.log_path.read_text() if router.log_path else ""
    refused = [line for line in logged.splitlines() if "node mac-1: connect failed" in line]
    assert refused and all("CERTIFICATE_VERIFY_FAILED" in line for line in refused), logged[-2000:]
    codes = []
    for _ in range(3):  # each try counts against the node's circuit (two failures open it)
        answer = _chat(router.url, True)
        codes.append((answer.status_code, answer.json()["error"]["code"]))
        if answer.status_code == 503:
            assert answer.headers["retry-after"]
            break
    assert codes[-1] == (503, "no_nodes"), codes


def test_the_agent_refuses_a_client_without_a_certificate_of_the_pool_ca(tls_pool: TlsPool) -> None:
    pki, other = tls_pool.pki, tls_pool.other
    health = tls_pool.agent.url + "/health"
    assert httpx.get(health, verify=client_tls(pki / "ca.pem", pki / "router.pem", pki / "router-key.pem"),
                     timeout=5).status_code == 200
    # TLS 1.3: the client's handshake ends before the agent checks its certificate, and the agent's alert
    # arrives on the first read - a transport error, never an HTTP answer
    for verify in (client_tls(pki / "ca.pem", other / "router.pem", other / "router-key.pem"),
                   client_tls(pki / "ca.pem")):
        with pytest.raises(httpx.TransportError):
            httpx.get(health, verify=verify, timeout=5)
    # and a client with the pool's certificate that does not trust the pool CA stops at the agent's
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(health, verify=client_tls(None, pki / "router.pem", pki / "router-key.pem"), timeout=5)


@pytest.mark.parametrize(("command", "args", "said"), [
    (("router",), ["--tls-cert", "router.pem"], "--tls-cert needs --tls-key"),
    (("router",), ["--node-key", "router-key.pem"], "--node-key without --node-cert"),
    (("router",), ["--node-ca", "missing.pem"], "--node-ca 'PKI/missing.pem': no such file"),
    (("router",), ["--tls-cert", "router.pem", "--tls-key", "ca-key.pem"],
     "not a PEM certificate and its key"),
    (("agent", "run", "--upstream", "http://127.0.0.1:9"), ["--tls-client-ca", "ca.pem"],
     "--tls-client-ca needs --tls-cert"),
    (("agent", "run", "--upstream", "http://127.0.0.1:9"),
     ["--tls-cert", "router.pem", "--tls-key", "router-key.pem", "--advertise-url", "http://mac-1.local:8090"],
     "routers reach it at https://"),
])
def test_tls_settings_that_cannot_work_stop_the_start(tmp_path: Path, command: tuple[str, ...],
                                                      args: list[str], said: str) -> None:
    pki = tmp_path / "pki"
    _certs(pki, "--router", *LOOPBACK)
    paths = [str(pki / arg) if arg.endswith(".pem") else arg for arg in args]
    done = subprocess.run(macpool_argv(*command, *paths), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert said.replace("PKI", str(pki)) in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_a_router_with_a_certificate_of_another_ca_is_refused_by_the_agent(tls_pool: TlsPool,
                                                                           stack: Stack) -> None:
    pki, other = tls_pool.pki, tls_pool.other
    router = stack.router("router-other-cert", tls_pool.redis_url, "--agent-token", AGENT_TOKEN,
                          "--node-ca", str(pki / "ca.pem"), "--node-cert", str(other / "router.pem"),
                          "--node-key", str(other / "router-key.pem"))
    stack.wait_nodes(router.url, 1)
    # TLS 1.3: the router's handshake ends before the agent checks its certificate; the agent's alert
    # closes the connection before any answer
    answer = _chat(router.url, True)
    assert answer.status_code == 502 and answer.json()["error"]["code"] == "upstream_unavailable", answer.text
    logged = router.log_path.read_text() if router.log_path else ""
    # (the alert may come before the request is written, or after: a closed or a reset connection)
    assert re.search(r"node mac-1: (RemoteProtocolError|ReadError|WriteError) before an answer", logged), \
        logged[-2000:]
