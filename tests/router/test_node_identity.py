"""Node identity (docs/security.md, "Node identity"): routers send traffic only to nodes whose heartbeats are
signed with a credential the pool issued to that node, not revoked, at a URL inside --node-networks.

The pool here is real - Redis, simulators, agents and routers on loopback sockets (tests/inprocess.py) - and
the forged nodes are what a compromised Mac with write access to Redis could register: a heartbeat at the
URL of a capture server that records whatever reaches it.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from macpool.contract import NodeDoc, now_ms
from macpool.dev.redis_server import RedisServer
from macpool.identity import NodeCredential, PoolSecret, Revocation, issue, load_credential, load_secret
from macpool.node_cli import main as node_command
from macpool.store import Keys
from macpool.store.api import _json, _node_fields
from macpool.store.scripts import source
from router.settings import Settings
from router.trust import NodeTrust
from tests.capture_server import Capture
from tests.conftest import chat, wait_until
from tests.inprocess import LocalStack, Served

PRESET = "m5max-128g-14b-q4"
KEYS = Keys()


class Pool:
    """A pool secret, credentials issued by `macpool node`, and the servers of one test."""

    def __init__(self, servers: LocalStack, redis_url: str, folder: Path) -> None:
        self.servers = servers
        self.redis_url = redis_url
        self.folder = folder
        self.secret_file = folder / "pool-secret"
        assert node_command(["init", "--pool-secret-file", str(self.secret_file)]) == 0
        self.redis = redis.Redis.from_url(redis_url, decode_responses=True)

    def credential(self, node_id: str) -> Path:
        path = self.folder / f"{node_id}-{time.monotonic_ns()}.credential"
        argv = ["add", node_id, "--pool-secret-file", str(self.secret_file), "--out", str(path)]
        assert node_command(argv) == 0
        return path

    def node(self, node_id: str, *args: str, credential: Path | None = None) -> Served:
        sim = self.servers.sim(f"sim-{node_id}", "--preset", PRESET, "--parallel", "4", "--speed", "200")
        signed = ("--node-credential", str(credential or self.credential(node_id)))
        return self.servers.agent(f"agent-{node_id}", sim.url, self.redis_url, node_id, "--cap", "4", *signed,
                                  *args)

    def router(self, *args: str) -> Served:
        return self.servers.router("router", self.redis_url, "--pool-secret-file", str(self.secret_file),
                                   "--refresh-interval", "0.1", *args)

    def forge(self, doc: NodeDoc) -> None:
        """Write ``doc`` into the pool as an agent's heartbeat would, with a TTL that outlasts the test: what
        anyone with write access to Redis can do."""
        key, call = KEYS.node(doc.node_id), {"id": doc.node_id, "ttl": 120_000, "at": doc.updated_at_ms,
                                             "fields": _node_fields(doc)}
        script = self.redis.register_script(source("heartbeat"))
        assert script(keys=[key, KEYS.nodes], args=[KEYS.events, doc.encode(), _json(call)]) == 1


@pytest.fixture
def pool(local_stack: LocalStack, redis_url: str, tmp_path: Path) -> Pool:
    return Pool(local_stack, redis_url, tmp_path)


def _pool_view(router: Served) -> dict[str, Any]:
    view: dict[str, Any] = httpx.get(router.url + "/api/pool", timeout=5).json()
    return view


def _untrusted(router: Served) -> dict[str, str]:
    """Node id -> why the router refuses it, as /api/pool shows it."""
    return {n["node_id"]: n["reason"] for n in _pool_view(router)["untrusted"] if n["trust"] == "untrusted"}


def _serve(router: Served, count: int) -> set[str]:
    """Send ``count`` requests; the nodes that answered them (each must succeed)."""
    nodes = set()
    with httpx.Client(timeout=30) as client:
        for _ in range(count):
            reply = client.post(router.url + "/v1/chat/completions", json=chat("", 4, False))
            assert reply.status_code == 200, reply.text
            nodes.add(reply.headers["x-macpool-node"])
    return nodes


def _refusals(caplog: pytest.LogCaptureFixture, node_id: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "macpool.router" and r.getMessage().startswith(f"node {node_id} (")
            and "gets no traffic" in r.getMessage()]


def _genuine(pool: Pool, node_id: str) -> NodeDoc:
    raw = pool.redis.hget(KEYS.node(node_id), "doc")
    assert isinstance(raw, str)
    return NodeDoc.decode(raw)


def test_forged_heartbeats_get_no_traffic_and_are_logged_once(
    pool: Pool, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="macpool.router")
    pool.node("mac-a")
    router = pool.router()
    pool.servers.wait_nodes(router.url, 1, exact=True)
    assert _serve(router, 3) == {"mac-a"}  # the signed pool serves

    capture = Capture()
    trap = pool.servers.serve("capture", capture.app(), ready=None)
    genuine = _genuine(pool, "mac-a")
    assert genuine.signer == "mac-a" and genuine.signature
    # what a compromised Mac would register: a "fast" node at a URL it controls, serving the same model
    bait = genuine.model_copy(update={"url": trap.url, "capacity": 4, "tokens_per_s": 1e6, "instance": "x",
                                      "slot_tokens_per_s": 1e6, "updated_at_ms": now_ms()})
    mac_b = issue(load_secret(pool.secret_file), "mac-b", now_ms())  # a credential of the pool, not mac-a's
    forged = {
        "unsigned": bait.model_copy(update={"node_id": "unsigned", "signer": "", "signature": ""}),
        # mac-a's own signature, copied onto another node's document
        "copied": bait.model_copy(update={"node_id": "copied"}),
        # signed by mac-b's genuine credential, for another node id
        "other-id": mac_b.sign(bait.model_copy(update={"node_id": "mac-b"})).model_copy(
            update={"node_id": "other-id"}),
        "mac-b/evil": NodeCredential("mac-c", mac_b.issued_ms, mac_b.key).sign(
            bait.model_copy(update={"node_id": "mac-c"})).model_copy(update={"node_id": "mac-b/evil"}),
    }
    for doc in forged.values():
        pool.forge(doc)
    reasons = wait_until(lambda: (lambda u: u if set(forged) <= set(u) else None)(_untrusted(router)), 10,
                         "the forged nodes shown untrusted")
    assert reasons["unsigned"] == "unsigned heartbeat"
    assert reasons["copied"].startswith("signed with the credential of 'mac-a', which is not this node's")
    assert reasons["other-id"].startswith("signed with the credential of 'mac-b'")
    assert reasons["mac-b/evil"].startswith("signed with the credential of 'mac-c'")

    assert _serve(router, 12) == {"mac-a"}
    assert capture.requests == []  # neither a prompt nor a token reached the forged URL
    assert [n["node_id"] for n in _pool_view(router)["nodes"]] == ["mac-a"]
    metrics = httpx.get(router.url + "/metrics", timeout=5).text
    assert 'macpool_nodes{state="untrusted"} 4.0' in metrics
    for node_id in forged:  # logged once each, with the reason, though re-read on every refresh
        assert _refusals(caplog, node_id) == [
            f"node {node_id} ({trap.url}) is not trusted and gets no traffic: {reasons[node_id]}"]


def test_a_revoked_node_gets_nothing_and_stays_revoked_when_its_record_is_deleted(
    pool: Pool, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="macpool.router")
    pool.node("mac-a")
    pool.node("mac-b")
    router = pool.router()
    pool.servers.wait_nodes(router.url, 2, exact=True)
    assert _serve(router, 12) == {"mac-a", "mac-b"}

    assert node_command(["revoke", "mac-b", "--pool-secret-file", str(pool.secret_file),
                         "--redis-url", pool.redis_url]) == 0
    wait_until(lambda: "mac-b" in _untrusted(router), 10, "mac-b refused")
    assert _untrusted(router)["mac-b"] == "credential of 'mac-b' revoked by the operator"
    assert _serve(router, 8) == {"mac-a"}

    # what a revoked Mac with write access to Redis would do: delete the revocation, and forge one for
    # another node
    assert pool.redis.delete(KEYS.revoked) == 1
    forged = Revocation(node_id="mac-a", before_ms=now_ms() + 60_000, signature="AAAA").encode()
    pool.redis.hset(KEYS.revoked, "mac-a", forged)
    started = now_ms()
    wait_until(lambda: _pool_view(router)["ts_ms"] > started + 1000 and _genuine(pool, "mac-b").updated_at_ms
               > started + 500, 10, "a second of refreshes and heartbeats past the deletion")
    assert _untrusted(router) == {"mac-b": "credential of 'mac-b' revoked by the operator"}
    assert _serve(router, 8) == {"mac-a"}
    assert any("revocation record of node mac-a is not signed with the pool secret" in r.getMessage()
               for r in caplog.records)

    # a credential issued after the revocation brings the Mac back; the revoked one stays revoked
    pool.servers.stop(next(s for s in pool.servers.served if s.name == "agent-mac-b"))
    pool.node("mac-b", credential=pool.credential("mac-b"))
    pool.servers.wait_nodes(router.url, 2, exact=True)
    wait_until(lambda: _serve(router, 4) == {"mac-a", "mac-b"} or None, 20, "mac-b served again")


def test_node_urls_outside_the_node_networks_are_refused(pool: Pool) -> None:
    pool.node("by-address")
    agent = pool.node("by-name")
    port = agent.port
    # the same agent advertised under a host name, resolved by the router (to loopback)
    pool.servers.stop(agent)
    pool.node("by-name", "--advertise-url", f"http://localhost:{port}", credential=pool.credential("by-name"))
    lan = pool.router()
    pool.servers.wait_nodes(lan.url, 2, exact=True)  # the default networks hold loopback

    only_ten = pool.servers.router("router-10", pool.redis_url, "--pool-secret-file", str(pool.secret_file),
                                   "--node-networks", "10.0.0.0/8")
    reasons = wait_until(lambda: (lambda u: u if len(u) == 2 else None)(_untrusted(only_ten)), 10,
                         "both nodes refused")
    assert reasons["by-address"] == "URL host 127.0.0.1 is outside --node-networks"
    assert reasons["by-name"].startswith("URL host localhost (")
    assert reasons["by-name"].endswith(") is outside --node-networks")
    reply = httpx.post(only_ten.url + "/v1/chat/completions", json=chat("", 4, False), timeout=30)
    assert reply.status_code == 503 and reply.json()["error"]["code"] == "no_nodes"


def test_the_agent_takes_only_its_own_token(pool: Pool) -> None:
    credential_file = pool.credential("mac-a")
    agent = pool.node("mac-a", credential=credential_file)
    own = load_credential(credential_file).agent_token
    other = pool.credential("mac-z")
    body = chat("", 4, False)
    for token in ("", "shared-token", load_credential(other).agent_token):
        reply = httpx.post(agent.url + "/v1/chat/completions", json=body, headers={"X-Macpool-Token": token},
                           timeout=30)
        assert reply.status_code == 401, token
    reply = httpx.post(agent.url + "/v1/chat/completions", json=body, headers={"X-Macpool-Token": own},
                       timeout=30)
    assert reply.status_code == 200


def _trust(tmp_path: Path, **settings: object) -> tuple[NodeTrust, PoolSecret]:
    path = tmp_path / "secret"
    assert node_command(["init", "--pool-secret-file", str(path)]) == 0
    trust = NodeTrust(Settings.model_validate({"pool_secret_file": path, **settings}))
    return trust, load_secret(path)


def test_a_replayed_or_altered_heartbeat_is_refused(tmp_path: Path) -> None:
    trust, secret = _trust(tmp_path, stale_after=5.0, node_clock_skew=30.0)
    at = 1_700_000_000_000
    signed = issue(secret, "mac-a", at - 1000).sign(
        NodeDoc(node_id="mac-a", url="http://10.0.0.5:8090", models=["m"], capacity=4, state="ready",
                updated_at_ms=at))
    assert trust.refusal(signed, now=at) is None
    assert trust.refusal(signed, now=at + 34_000) is None
    assert trust.refusal(signed, now=at + 36_000) == "stale or replayed heartbeat: signed more than 35 s ago"
    assert trust.refusal(signed, now=at - 31_000) == \
        "heartbeat signed more than 30 s in the future (clock skew)"
    for change in ({"capacity": 64}, {"url": "http://10.0.0.6:8090"}, {"tokens_per_s": 1e6},
                   {"signer_issued_ms": at}, {"updated_at_ms": at + 1}):
        altered = signed.model_copy(update=change)
        assert trust.refusal(altered, now=at) == \
            "bad signature: not signed with this node's credential, or altered"
    # what a signature leaves out moves no request: the reason shown to people
    assert trust.refusal(signed.model_copy(update={"reason": "edited"}), now=at) is None


def test_optional_identity_refuses_an_unsigned_heartbeat_for_a_node_that_signed(tmp_path: Path) -> None:
    trust, secret = _trust(tmp_path, node_identity="optional", agent_token="shared-token-of-16-chars")
    at = now_ms()
    doc = NodeDoc(node_id="mac-a", url="http://10.0.0.5:8090", updated_at_ms=at)
    assert trust.refusal(doc, now=at) is None and trust.agent_token(doc) == "shared-token-of-16-chars"
    signed = issue(secret, "mac-b", at).sign(doc.model_copy(update={"node_id": "mac-b/model"}))
    assert trust.refusal(signed, now=at) is None
    assert trust.agent_token(signed) == issue(secret, "mac-b", at).agent_token != "shared-token-of-16-chars"
    assert trust.refusal(doc.model_copy(update={"node_id": "mac-b"}), now=at) == \
        "unsigned heartbeat for a node id that signed before"


def test_a_placeholder_of_a_sleeping_mac_needs_no_signature(tmp_path: Path) -> None:
    trust, _ = _trust(tmp_path)
    asleep = NodeDoc(node_id="mac-a", url="", state="asleep", elastic=True, models=["m"],
                     updated_at_ms=now_ms())
    assert trust.refusal(asleep) is None
    assert trust.refusal(asleep.model_copy(update={"state": "ready"})) == "unsigned heartbeat"


def test_credentials_and_secrets_in_files_only_their_owner_reads(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    secret = tmp_path / "secret"
    assert node_command(["init", "--pool-secret-file", str(secret)]) == 0
    assert secret.stat().st_mode & 0o777 == 0o600
    assert node_command(["init", "--pool-secret-file", str(secret)]) == 2  # never overwritten
    assert node_command(["add", "mac-a", "--pool-secret-file", str(secret)]) == 0
    printed = capsys.readouterr().out.strip()
    credential = NodeCredential.parse(printed)
    assert credential.node_id == "mac-a" and printed.startswith("macpool-node-1:mac-a:")
    assert node_command(["add", "a/b", "--pool-secret-file", str(secret)]) == 2
    secret.chmod(0o644)
    assert node_command(["add", "mac-a", "--pool-secret-file", str(secret)]) == 2
    assert "readable by others (mode 644); chmod 600 it" in capsys.readouterr().err


def test_a_mac_with_the_documented_acl_serves_and_cannot_touch_revocations(
    local_stack: LocalStack, tmp_path: Path
) -> None:
    with RedisServer() as server:
        admin = redis.Redis.from_url(server.url)
        # the ACL of docs/security.md, "Revocations, and a Mac that can write Redis"
        admin.execute_command(
            "ACL", "SETUSER", "mac-1", "on", ">mac-1-password", "resetkeys", "resetchannels",
            "~macpool:{pool}:node:mac-1", "~macpool:{pool}:node:mac-1/*", "~macpool:{pool}:desired:mac-1",
            "~macpool:{pool}:desired:mac-1/*", "~macpool:{pool}:nodes", "&macpool:{pool}:events",
            "-@all", "+@connection", "+evalsha", "+eval", "+script|load", "+hget", "+hmget", "+hset",
            "+pexpire", "+zadd", "+zrem", "+del", "+get", "+set", "+publish", "+info",
        )
        mac_url = f"redis://mac-1:mac-1-password@127.0.0.1:{server.port}/0"
        pool = Pool(local_stack, server.url, tmp_path)
        sim = local_stack.sim("sim-mac-1", "--preset", PRESET, "--parallel", "4")
        local_stack.agent("agent-mac-1", sim.url, mac_url, "mac-1", "--cap", "4",
                          "--node-credential", str(pool.credential("mac-1")))
        router = pool.router()
        local_stack.wait_nodes(router.url, 1, exact=True)
        assert _serve(router, 3) == {"mac-1"}
        assert node_command(["revoke", "mac-2", "--pool-secret-file", str(pool.secret_file),
                             "--redis-url", server.url]) == 0
        mac = redis.Redis.from_url(mac_url)
        for attempt in (lambda: mac.hdel(KEYS.revoked, "mac-2"), lambda: mac.delete(KEYS.revoked),
                        lambda: mac.set(KEYS.node("mac-2"), "x"), lambda: mac.get(KEYS.held)):
            with pytest.raises(redis.exceptions.NoPermissionError):
                attempt()
        assert admin.hexists(KEYS.revoked, "mac-2")
        mac.close()
        admin.close()
