"""Faults with real processes: kill -9 mid-stream, a hung node, a router replica killed, a slow loader."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from macpool.contract import now_ms
from tests.reliability.conftest import Rig, assert_clean, chat, sse_events, wait_until

pytestmark = pytest.mark.slow


def _open(client: httpx.Client, body: dict[str, object]) -> tuple[httpx.Response, Iterator[bytes], bytes]:
    request = client.build_request("POST", "/v1/chat/completions", json=body)
    response = client.send(request, stream=True)
    assert response.status_code == 200, response.read()
    chunks = response.iter_raw()
    return response, chunks, next(chunks)


def _drain(chunks: Iterator[bytes]) -> tuple[bytes, float]:
    """Read a stream to its end; (everything read, seconds it took)."""
    started = time.monotonic()
    parts = []
    try:
        for chunk in chunks:
            parts.append(chunk)
    except httpx.HTTPError:
        pass
    return b"".join(parts), time.monotonic() - started


def test_kill9_mid_stream(rig: Rig) -> None:
    """kill -9 of one node's agent and another node's llama-server (simulator) mid-stream: both affected
    streams end with an SSE error event within 2 s; the third stream goes on; no reservation leaks."""
    nodes = [rig.node(f"n{i}", cap=2, speed=1) for i in (1, 2, 3)]
    router = rig.router()
    rig.wait_ready(router, nodes=3)
    body = chat(rig.model(router), max_tokens=3000)
    by_id = {node.node_id: node for node in nodes}
    with httpx.Client(base_url=router.url, timeout=30) as client:
        streams = [_open(client, body) for _ in nodes]  # least-utilised placement: one on each node
        placed = [by_id[response.headers["x-macpool-node"]] for response, _, _ in streams]
        assert len({node.node_id for node in placed}) == 3
        (agent_victim, agent_stream), (sim_victim, sim_stream) = zip(placed[:2], streams[:2], strict=True)
        agent_victim.agent.child.kill()
        sim_victim.sim.child.kill()
        for victim, (response, chunks, first), what in (
            (agent_victim, agent_stream, "agent"),
            (sim_victim, sim_stream, "llama-server"),
        ):
            rest, took = _drain(chunks)
            events = sse_events(first + rest)
            assert "error" in events[-1], rest[-300:]
            assert took < 2.0
            assert_clean(rest, victim.agent.url, victim.sim.url)
            print(f"{what} kill -9: stream ended in {took:.3f}s with {events[-1]['error']['code']}")
            response.close()
        # both are counted as the failures they are, the agent's own error event included
        metrics = client.get("/metrics").text
        for victim in (agent_victim, sim_victim):
            series = f'macpool_upstream_errors_total{{kind="midstream",node="{victim.node_id}"}}'
            assert series + " 1.0" in metrics, [ln for ln in metrics.splitlines() if "upstream_err" in ln]
            assert f'node="{victim.node_id}",status="200"' not in metrics
        # the third client is unaffected: its stream keeps flowing
        survivor_response, survivor_chunks, _ = streams[2]
        for _ in range(5):
            assert b"error" not in next(survivor_chunks)
        survivor_response.close()
    left = time.monotonic()
    wait_until(lambda: rig.pool_doc(router)["pool"]["nodes_ready"] == 1, 15, "the victims out of rotation")
    print(f"both victims out of rotation {time.monotonic() - left:.2f}s after the streams ended")
    wait_until(lambda: all(rig.reservations(n.node_id) == 0 for n in nodes), 10, "every reservation released")
    # the pool keeps serving on the survivor
    reply = httpx.post(
        router.url + "/v1/chat/completions", json=chat(str(body["model"]), 4, False), timeout=30
    )
    assert reply.status_code == 200 and reply.headers["x-macpool-node"] == placed[2].node_id


def test_hung_node_opens_the_circuit_and_comes_back(rig: Rig) -> None:
    """SIGSTOP: idle and first-byte timeouts fire, the circuit opens, the node is skipped; SIGCONT heals."""
    # slow heartbeats for the hung node: its key outlives the test, so only the circuit can skip it
    hung = rig.node("hung", cap=2, speed=1, agent_args=("--heartbeat-interval", "4"))
    rig.node("ok", cap=4, speed=20)
    router = rig.router(
        "--first-byte-timeout",
        "1.5",
        "--response-timeout",  # the probes below are not streamed
        "1.5",
        "--idle-timeout",
        "1.5",
        "--circuit-failures",
        "1",
        "--circuit-cooldown",
        "1",
        "--stale-after",
        "30",
    )
    rig.wait_ready(router, nodes=2, timeout=40)
    model = rig.model(router)
    with httpx.Client(base_url=router.url, timeout=30) as client:
        # a stream in progress on the hung node
        stream = wait_until(lambda: _on(client, chat(model, 3000), "hung"), 30, "a stream on the hung node")
        response, chunks = stream
        for sig_target in (hung.agent, hung.sim):
            sig_target.child.signal(signal.SIGSTOP)
        try:
            rest, _ = _drain(chunks)
            response.close()
            assert "error" in sse_events(rest)[-1]
            assert sse_events(rest)[-1]["error"]["code"] == "upstream_idle_timeout"
            # new requests: the first that lands on the hung node times out before its first byte and opens
            # the circuit; from then on every request goes to the healthy node
            statuses = []
            for _ in range(12):
                reply = client.post("/v1/chat/completions", json=chat(model, 2, False))
                statuses.append((reply.status_code, reply.headers.get("x-macpool-node")))
                assert_clean(reply.text, hung.agent.url)
            pool = {n["node_id"]: n for n in rig.pool_doc(router)["nodes"]}
            assert pool["hung"]["circuit"] == "open", (statuses, pool["hung"])
            assert statuses[-4:] == [(200, "ok")] * 4, statuses
            assert all(code in (200, 504) for code, _ in statuses), statuses
        finally:
            for sig_target in (hung.agent, hung.sim):
                sig_target.child.signal(signal.SIGCONT)
        # back: a fresh heartbeat after the cooldown lets traffic probe it again, and it is used
        wait_until(
            lambda: _on(client, chat(model, 2, False), "hung", stream=False), 40, "traffic on the node"
        )
    wait_until(lambda: rig.reservations("hung") == 0 and rig.reservations("ok") == 0, 10, "no reservations")


def _on(
    client: httpx.Client, body: dict[str, object], node_id: str, stream: bool = True
) -> tuple[httpx.Response, Iterator[bytes]] | None:
    """Send ``body``; the open stream when it landed on ``node_id``, else close it and say None."""
    request = client.build_request("POST", "/v1/chat/completions", json=body)
    response = client.send(request, stream=True)
    if response.status_code == 200 and response.headers.get("x-macpool-node") == node_id:
        if not stream:
            response.read()
            return response, iter(())
        chunks = response.iter_raw()
        next(chunks)
        return response, chunks
    response.close()
    return None


def test_router_replica_killed_under_load(rig: Rig) -> None:
    """kill -9 of one replica: it stops beating, and the other replica gives its reservations back within
    5 s (the liveness period and a beat), long before their 30 s lease; the other replica serves meanwhile."""
    rig.node("n1", cap=3, speed=1)
    rig.node("n2", cap=3, speed=1)
    doomed = rig.router("--router-id", "doomed", name="router-a")
    other = rig.router("--router-id", "other", name="router-b")
    rig.wait_ready(doomed, nodes=2)
    rig.wait_ready(other, nodes=2)
    model = rig.model(doomed)

    def doomed_leases() -> int:
        with rig.store() as store:
            live = [
                store.zrangebyscore(rig.keys.reservations(node), now_ms(), "+inf") for node in ("n1", "n2")
            ]
            return sum(1 for members in live for member in members if member.startswith(b"doomed:"))

    with (
        httpx.Client(base_url=doomed.url, timeout=30) as a,
        httpx.Client(base_url=other.url, timeout=30) as b,
    ):
        held = [_open(a, chat(model, 3000)) for _ in range(3)]
        assert doomed_leases() == 3
        doomed.child.kill()
        killed = time.monotonic()
        for response, _, _ in held:
            response.close()
        reply = b.post("/v1/chat/completions", json=chat(model, 2, False))
        assert reply.status_code == 200
        wait_until(lambda: doomed_leases() == 0, 15, "the dead replica's leases reclaimed")
        reclaimed = time.monotonic() - killed
        print(f"leases of the killed replica reclaimed after {reclaimed:.2f}s (lease 30s, liveness 4s)")
        assert reclaimed <= 5 + 1  # (one more second: this test polls, on a loaded machine)
        # all six slots usable again through the surviving replica
        streams = [_open(b, chat(model, 3000)) for _ in range(6)]
        for response, _, _ in streams:
            response.close()
    # the killed replica restarted on its port serves again with no manual step
    again = rig.router(port=doomed.port, name="router-a2")
    rig.wait_ready(again, nodes=2)
    assert (
        httpx.post(again.url + "/v1/chat/completions", json=chat(model, 2, False), timeout=30).status_code
        == 200
    )
    wait_until(lambda: rig.reservations("n1") + rig.reservations("n2") == 0, 10, "no reservations left")


@pytest.mark.in_process
def test_slow_loading_upstream_stays_starting(rig: Rig) -> None:
    """A llama-server still loading (503 on /health): the node is `starting` and receives nothing."""
    # in-process servers start in milliseconds: 6 s of loading leave time for the checks below
    sim = rig.sim("slow", "--load-seconds", "6", ready_path="/sim/stats")
    router = rig.router()
    agent = rig.agent("slow", sim.url, cap=2)
    doc = wait_until(
        lambda: [n for n in rig.pool_doc(router)["nodes"] if n["node_id"] == "slow"], 15, "the node"
    )
    assert doc[0]["state"] == "starting"
    reply = httpx.post(router.url + "/v1/chat/completions", json=chat("", 2, False), timeout=10)
    assert reply.status_code == 503 and reply.headers["x-macpool-reason"] == "no_nodes"
    assert reply.headers["retry-after"].isdigit()
    assert_clean(reply.text, agent.url, sim.url)
    assert httpx.get(sim.url + "/sim/stats", timeout=5).json()["completed"] == 0
    assert httpx.get(agent.url + "/status", timeout=5).json()["state"] == "starting"  # still serving
    rig.wait_ready(router, nodes=1, timeout=30)
    reply = httpx.post(router.url + "/v1/chat/completions", json=chat("", 2, False), timeout=30)
    assert reply.status_code == 200


def test_a_node_dying_under_a_full_queue_costs_no_502(rig: Rig) -> None:
    """Queued requests are not handed a dead node's freed slots: they fail over or wait for the live one."""
    dying = rig.node("dying", cap=3, speed=1)
    rig.node("live", cap=3, speed=1)
    router = rig.router("--queue-size", "6", "--queue-timeout", "5")
    rig.wait_ready(router, nodes=2)
    model = rig.model(router)
    seen: list[tuple[float, int, str]] = []
    stop = time.monotonic() + 6.0

    def client() -> None:
        with httpx.Client(base_url=router.url, timeout=30) as http:
            while time.monotonic() < stop:
                reply = http.post("/v1/chat/completions", json=chat(model, 40, False))
                code = reply.json().get("error", {}).get("code", "") if reply.status_code != 200 else ""
                seen.append((time.monotonic(), reply.status_code, code))

    with ThreadPoolExecutor(12) as pool:  # 12 clients on 6 slots: the queue is always in use
        running = [pool.submit(client) for _ in range(12)]
        time.sleep(2.0)
        killed_at = time.monotonic()
        dying.agent.child.kill()
        for future in running:
            future.result()
    after = [(status, code) for at, status, code in seen if at > killed_at]
    assert not [s for s in seen if s[1] not in (200, 503)], seen  # no 502: nothing reached a client half-done
    assert sum(1 for status, _ in after if status == 200) >= 3, after  # the live node kept serving


def test_router_shutdown_ends_open_streams_with_an_error_event(rig: Rig) -> None:
    node = rig.node("n1", cap=2, speed=1)
    router = rig.router("--shutdown-timeout", "1")
    rig.wait_ready(router, nodes=1)
    with httpx.Client(base_url=router.url, timeout=30) as client:
        response, chunks, first = _open(client, chat(rig.model(router), max_tokens=3000))
        router.child.signal(signal.SIGTERM)
        rest, took = _drain(chunks)
        response.close()
    events = sse_events(first + rest)
    assert events[-1]["error"]["code"] == "router_shutdown", rest[-300:]
    assert took < 5.0  # the shutdown timeout, then the event: not a stream cut at random
    assert router.child.process is not None
    assert router.child.process.wait(10) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it handled
    wait_until(lambda: rig.reservations(node.node_id) == 0, 5, "the lease released on the way out")
    # uvicorn's line for the stream it cancels is a warning: a router stopped with streams open pages nobody
    assert router.child.log_path is not None
    log = router.child.log_path.read_text()
    assert "WARNING uvicorn.error Cancel 1 running task(s), timeout graceful shutdown exceeded" in log, log
    assert " ERROR " not in log, log


def test_router_shutdown_answers_a_request_still_waiting_for_its_node_with_a_503(rig: Rig) -> None:
    node = rig.node("n1", cap=2, speed=1)
    router = rig.router("--shutdown-timeout", "1")
    rig.wait_ready(router, nodes=1)
    body = {**chat(rig.model(router), max_tokens=3000), "stream": False}  # its answer comes whole, at the end
    with httpx.Client(base_url=router.url, timeout=30) as client, ThreadPoolExecutor(1) as pool:
        pending = pool.submit(client.post, "/v1/chat/completions", json=body)
        wait_until(lambda: rig.reservations(node.node_id) == 1, 5, "the request on its node")
        router.child.signal(signal.SIGTERM)
        answer = pending.result(timeout=20)
    # nothing had reached the client: a JSON 503 to retry, not uvicorn's plain-text 500 and a traceback
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["code"] == "router_shutdown" and answer.headers["retry-after"] == "1"
    assert router.child.process is not None
    router.child.process.wait(10)
    log = router.child.log_path.read_text() if router.child.log_path else ""
    assert "Exception in ASGI application" not in log and " ERROR " not in log, log
    wait_until(lambda: rig.reservations(node.node_id) == 0, 5, "the lease released on the way out")
