"""Failures: another node is tried before the first byte; after it, the stream ends with an error event."""

from __future__ import annotations

import json

import httpx

from tests.conftest import chat
from tests.router.conftest import Pool


def test_failover_before_first_byte_then_error_event_mid_stream(pool: Pool) -> None:
    nodes = {name: pool.node(name, cap=4, speed=1) for name in ("a", "b")}
    router = pool.router("--queue-size", "0")
    pool.wait_ready(router, nodes=2)
    model = pool.model(router)
    long_body, short_body = chat(model, 4000), chat(model, 4, stream=False)
    with (
        httpx.Client(base_url=router.url, timeout=30) as client,
        client.stream("POST", "/v1/chat/completions", json=long_body) as held,
    ):
        assert held.status_code == 200
        chunks = held.iter_raw()
        next(chunks)
        busy = held.headers["x-macpool-node"]
        idle = "b" if busy == "a" else "a"

        # the idle node is now the least utilised, but its agent is dead (its heartbeat not yet expired):
        # the connect error releases that reservation and the request lands on the other node
        nodes[idle].agent.child.kill()
        answer = client.post("/v1/chat/completions", json=short_body)
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-macpool-node"] == busy
        assert answer.json()["choices"][0]["message"]["content"] is not None

        # now kill the busy node's agent mid-stream: the client sees an SSE error event, then the end
        nodes[busy].agent.child.kill()
        rest = b"".join(chunks)
    events = [line[len(b"data: ") :] for line in rest.split(b"\n") if line.startswith(b"data: ")]
    assert events, rest
    error = json.loads(events[-1])["error"]
    assert error["code"].startswith("upstream_")
    assert "127.0.0.1" not in error["message"]
    metrics = httpx.get(router.url + "/metrics").text
    assert f'macpool_upstream_errors_total{{kind="connect",node="{idle}"}}' in metrics
