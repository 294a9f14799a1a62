"""Every error path answers OpenAI-shaped JSON with the right status, and never names a node's address."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import metric
from tests.router.conftest import Pool, wait_until

API_KEY = "client-secret"
ADMIN_KEY = "admin-secret-for-tests"


pytestmark = pytest.mark.in_process  # none of these tests is about a process


def _error(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error: dict[str, Any] = response.json()["error"]
    assert error["code"] == code and error["message"] and error["type"]
    assert "127.0.0.1" not in response.text and "Traceback" not in response.text
    return error


def test_error_paths_auth_and_admin(pool: Pool, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"{API_KEY}\n")
    router = pool.router(
        "--api-keys-file",
        str(keys),
        "--admin-key",
        ADMIN_KEY,
        "--max-body-bytes",
        "2000",
        "--queue-size",
        "0",
    )
    auth = {"Authorization": f"Bearer {API_KEY}"}
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    body = {"model": "whatever", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    with httpx.Client(base_url=router.url, timeout=30) as client:
        # an empty pool
        no_nodes = client.post("/v1/chat/completions", json=body, headers=auth)
        _error(no_nodes, 503, "no_nodes")
        assert no_nodes.headers["x-macpool-reason"] == "no_nodes" and no_nodes.headers["retry-after"]
        assert client.get("/ready").status_code == 503
        assert client.get("/health").status_code == 200

        pool.node("n1", cap=2)
        pool.wait_ready(router, nodes=1)
        assert client.get("/ready").status_code == 200
        models = client.get("/v1/models", headers=auth).json()
        assert models["object"] == "list"
        body["model"] = model = models["data"][0]["id"]
        assert client.get(f"/v1/models/{model}", headers=auth).json() == models["data"][0]
        _error(client.get("/v1/models/org/no-such-model", headers=auth), 404, "model_not_found")
        _error(client.get(f"/v1/models/{model}"), 401, "invalid_api_key")

        # auth
        _error(client.post("/v1/chat/completions", json=body), 401, "invalid_api_key")
        _error(
            client.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer nope"}),
            401,
            "invalid_api_key",
        )
        _error(client.get("/v1/models"), 401, "invalid_api_key")
        ok = client.post(
            "/v1/chat/completions",
            json=body,
            headers={**auth, "X-Request-ID": "req-123", "X-Conversation-Id": "c1"},
        )
        assert ok.status_code == 200, ok.text
        assert ok.headers["x-request-id"] == "req-123"

        # input
        typed = {**auth, "Content-Type": "application/json"}
        _error(client.post("/v1/chat/completions", content=b"{not json", headers=typed), 400, "invalid_json")
        _error(client.post("/v1/chat/completions", content=b"[1, 2]", headers=typed), 400, "invalid_request")
        _error(
            client.post("/v1/chat/completions", content=b" " * 3000, headers=typed), 413, "request_too_large"
        )
        _error(
            client.post("/v1/chat/completions", json={**body, "model": "no-such-model"}, headers=auth),
            404,
            "model_not_found",
        )
        _error(client.get("/v1/chat/completions", headers=auth), 405, "method_not_allowed")
        _error(client.post("/no/such/path", headers=auth), 404, "not_found")

        # admin: drain takes the node out of rotation, undrain puts it back
        _error(client.post("/admin/nodes/n1/drain"), 401, "invalid_admin_key")
        _error(client.post("/admin/nodes/n1/drain", headers=auth), 401, "invalid_admin_key")
        _error(client.post("/admin/nodes/ghost/drain", headers=admin), 404, "node_not_found")
        assert client.post("/admin/nodes/n1/drain", headers=admin).json() == {
            "node_id": "n1",
            "drained": True,
        }
        _error(client.post("/v1/chat/completions", json=body, headers=auth), 503, "no_nodes")
        assert client.get("/api/pool").json()["nodes"][0]["drained"] is True
        assert client.post("/admin/nodes/n1/undrain", headers=admin).status_code == 200
        assert client.post("/v1/chat/completions", json=body, headers=auth).status_code == 200

        view = client.get("/api/pool").json()
        assert set(view) == {"ts_ms", "router_id", "redis_ok", "pool", "nodes", "tenants", "affinity",
                             "queue_wait_p50_ms", "prefill_backlog_s", "autoscale", "untrusted"}
        assert set(view["pool"]) == {
            "capacity",
            "busy",
            "queued",
            "queued_slots",
            "nodes_total",
            "nodes_ready",
            "requests_per_s",
            "rejections_per_s",
            "saturation",
        }
        node = view["nodes"][0]
        assert node["node_id"] == "n1" and node["capacity"] == 2 and node["circuit"] == "closed"
        assert {"reserved", "drained", "memory", "models"} <= set(node)
        assert model in node["models"]

        metrics = client.get("/metrics").text
        for name in (
            "macpool_requests_total",
            "macpool_rejections_total",
            "macpool_queue_depth",
            "macpool_queue_wait_seconds",
            "macpool_ttft_seconds",
            "macpool_request_duration_seconds",
            "macpool_upstream_errors_total",
            "macpool_pool_slots",
            "macpool_nodes",
            "macpool_pool_saturation",
            "macpool_affinity_total",
            "macpool_queued",
            "macpool_tenant_in_flight",
            "macpool_key_limited_total",
        ):
            assert f"# TYPE {name}" in metrics, name
        assert 'macpool_rejections_total{reason="no_nodes"} 2.0' in metrics
        # refused before routing, counted too (the /v1/models 401 is not a generation request: not counted)
        refused = 'macpool_requests_total{{model="",node="",status="{}"}}'
        assert metric(router.url, refused.format(401)) == 2
        assert metric(router.url, refused.format(400)) == 2
        assert metric(router.url, refused.format(413)) == 1
        wait_until(lambda: 'macpool_pool_slots{state="total"} 2.0' in client.get("/metrics").text)


def test_odd_bodies_and_answers_relayed_as_they_are(pool: Pool) -> None:
    router = pool.router("--queue-size", "0")
    pool.node("n1", cap=4)
    pool.wait_ready(router, nodes=1)
    model = pool.model(router)
    chat = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    lone = b'{"model": "%s", "max_tokens": 4, "messages": [{"role": "user", "content": "\\ud800 hi"}]}'
    typed = {"Content-Type": "application/json"}
    with httpx.Client(base_url=router.url, timeout=30, headers=typed) as client:
        # a lone surrogate is a valid JSON escape: forwarded as sent (the prompt-prefix hash copes)
        assert client.post("/v1/chat/completions", content=lone % model.encode()).status_code == 200
        _error(client.post("/v1/chat/completions", content=b'{"model": "\\udc80"}'), 400, "invalid_model")
        for bad in (0, False, [], {}):  # not "no model": a wrong one
            _error(client.post("/v1/chat/completions", json={**chat, "model": bad}), 400, "invalid_model")
        # an answer keeps its own type: JSON for a request that asked for a stream the endpoint has not
        embedded = client.post("/v1/embeddings", json={"model": model, "input": "hello", "stream": True})
        assert embedded.status_code == 200
        assert embedded.headers["content-type"].startswith("application/json")
        assert embedded.json()["data"][0]["embedding"]
        # a trailing slash names the same endpoint (no redirect a POST would have to follow)
        assert client.post("/v1/chat/completions/", json=chat).status_code == 200
        # a request id that is not printable ASCII is replaced, not echoed garbled
        odd = client.post("/v1/chat/completions", json=chat, headers={"X-Request-ID": b"\xff\xfeid"})
        assert odd.status_code == 200 and len(odd.headers["x-request-id"]) == 32
        with client.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as streamed:
            assert streamed.headers.get_list("x-accel-buffering") == ["no"]
            assert "data: [DONE]" in streamed.read().decode()


def test_a_non_streamed_answer_may_take_longer_than_the_first_byte_timeout(pool: Pool) -> None:
    # its first byte comes with its last: the router waits --response-timeout for it
    router = pool.router("--first-byte-timeout", "0.5", "--queue-size", "0")
    pool.node("n1", cap=2, speed=1.0)
    pool.wait_ready(router, nodes=1)
    body = {"model": pool.model(router), "max_tokens": 120, "messages": [{"role": "user", "content": "hi"}]}
    with httpx.Client(base_url=router.url, timeout=60) as client:
        started = time.monotonic()
        answer = client.post("/v1/chat/completions", json=body)
        assert answer.status_code == 200, answer.text
        assert time.monotonic() - started > 0.5  # it did outlast the first-byte timeout
        assert answer.json()["usage"]["completion_tokens"] == 120


def test_a_model_no_node_serves_is_not_a_metric_label(pool: Pool) -> None:
    # with no node in the pool, any model name gets 503 no_nodes: counted under its name, each new name would
    # be a new series kept for good (a client could grow the router's memory and /metrics at will)
    router = pool.router()
    with httpx.Client(base_url=router.url, timeout=30) as client:
        for name in ("made-up-1", "made-up-2"):
            _error(client.post("/v1/chat/completions", json={"model": name}), 503, "no_nodes")
        assert "made-up" not in client.get("/metrics").text
    assert metric(router.url, 'macpool_requests_total{model="",node="",status="503"}') == 2
