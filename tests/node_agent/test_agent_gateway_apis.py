"""The gateway on every path of macpool/apis.py: generation paths under the cap, light paths under a cap of
their own, non-streamed generations folded from a stream - against a stand-in llama-server that answers
when told (tests/node_agent/held_upstream.py), with a real Redis."""

from __future__ import annotations

import json
import signal
import socket
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from macpool.apis import APIS, GENERATION_PATHS, LIGHT_PATHS
from macpool.dev.stack import free_port
from macpool.upstream import Upstream
from node_agent.gateway import create_app, create_models_app
from node_agent.runtime import Runtime
from node_agent.settings import AgentSettings
from tests.conftest import Server, SpawnFactory, metric
from tests.inprocess import LocalStack
from tests.node_agent import held_upstream
from tests.node_agent.helpers import AgentFactory, status, wait_until

MESSAGES = {"model": "held", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
BODIES: dict[str, dict[str, Any]] = {  # a request in each dialect
    "chat": {"model": "held", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
    "completions": {"model": "held", "prompt": "hi", "max_tokens": 8},
    "completion": {"prompt": "hi", "n_predict": 8},
    "infill": {"input_prefix": "def f(", "input_suffix": ")\n", "n_predict": 8},
    "embeddings": {"model": "held", "input": "hi"},
    "rerank": {"model": "held", "query": "hi", "documents": ["a"]},
    "messages": MESSAGES,
    "responses": {"model": "held", "input": "hi", "max_output_tokens": 8},
    "tokenize": {"content": "hi"},
}


# the dialects whose non-streamed generations the agent serves from a stream (node_agent/unstream.py)
FOLDED = ("chat", "completions", "completion", "infill", "messages", "responses")


def body(path: str, **extra: Any) -> dict[str, Any]:
    return {**BODIES[APIS[path].dialect], **extra}


class Held:
    """The stand-in llama-server of one test: what came to it, and its release."""

    def __init__(self, server: Server) -> None:
        self.url = server.url

    def state(self) -> dict[str, Any]:
        data: dict[str, Any] = httpx.get(self.url + "/held", timeout=5).json()
        return data

    def release(self) -> None:
        httpx.post(self.url + "/held/release", timeout=5).raise_for_status()


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=8) as executor:
        yield executor


def _node(local_stack: LocalStack, agent: AgentFactory, *args: str) -> tuple[Held, Server]:
    upstream = local_stack.serve("held", held_upstream.app())
    gateway = agent("--upstream", upstream.url, *args)
    wait_until(lambda: status(gateway.url)["state"] == "ready", what="ready")
    return Held(upstream), gateway


def _post(url: str, path: str, payload: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + path, json=payload, timeout=30)


def _waiting(held: Held, count: int) -> None:
    wait_until(lambda: held.state()["waiting"] == count, timeout=10, what=f"{count} held at llama-server")


def _refused_full(response: httpx.Response) -> None:
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "node_full"
    assert response.headers["retry-after"] == "1" and response.headers["x-macpool-reason"] == "node_full"


@pytest.mark.in_process
def test_light_requests_hold_no_generation_slot_and_have_a_cap_of_their_own(
    local_stack: LocalStack, agent: AgentFactory, pool: ThreadPoolExecutor
) -> None:
    held, gateway = _node(local_stack, agent, "--cap", "1", "--light-cap", "2")
    generating = pool.submit(_post, gateway.url, "/v1/messages", {**MESSAGES, "stream": True})
    _waiting(held, 1)
    _refused_full(_post(gateway.url, "/v1/responses", body("/v1/responses")))  # the one slot is taken
    # every light path is admitted beside it, up to the light cap
    light: list[Future[httpx.Response]] = [
        pool.submit(_post, gateway.url, path, body(path))
        for path in ("/v1/messages/count_tokens", "/tokenize")
    ]
    _waiting(held, 3)
    assert (status(gateway.url)["in_flight"], status(gateway.url)["light_in_flight"]) == (1, 2)
    for path in LIGHT_PATHS:
        over = _post(gateway.url, path, body(path))
        _refused_full(over)
        assert "at most 2 token counts" in over.json()["error"]["message"]
    assert sum(held.state()["arrived"].get(path, 0) for path in LIGHT_PATHS) == 2  # the refused never went
    held.release()
    assert [future.result().status_code for future in (*light, generating)] == [200, 200, 200]
    assert generating.result().text.rstrip().endswith('"message_stop"}')
    # each light path, and both caps given back
    for path in LIGHT_PATHS:
        answer = _post(gateway.url, path, body(path))
        assert answer.status_code == 200 and answer.json() in ({"input_tokens": 3}, {"tokens": [1, 2]}), path
    assert (status(gateway.url)["in_flight"], status(gateway.url)["light_in_flight"]) == (0, 0)
    assert metric(gateway.url, "macpool_agent_light_in_flight_requests") == 0


@pytest.mark.in_process
def test_light_requests_are_refused_while_the_node_is_not_serving(agent: AgentFactory) -> None:
    gateway = agent("--upstream", "http://127.0.0.1:9")  # nothing answers there: the node stays starting
    wait_until(lambda: status(gateway.url)["state"] == "starting", what="starting")
    for path in ("/v1/messages/count_tokens", "/tokenize"):
        refused = _post(gateway.url, path, body(path))
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "node_unavailable"


@pytest.mark.in_process
def test_every_generation_path_holds_a_slot_against_the_cap(
    local_stack: LocalStack, agent: AgentFactory, pool: ThreadPoolExecutor
) -> None:
    held, gateway = _node(local_stack, agent, "--cap", "2")
    first = pool.submit(_post, gateway.url, "/v1/messages", MESSAGES)  # non-streamed: folded from a stream
    second = pool.submit(_post, gateway.url, "/infill", body("/infill", stream=True))
    _waiting(held, 2)
    assert status(gateway.url)["in_flight"] == 2
    for path in GENERATION_PATHS:
        _refused_full(_post(gateway.url, path, body(path)))
    assert sum(held.state()["arrived"].values()) == 2  # none of them reached llama-server
    held.release()
    assert first.result().status_code == second.result().status_code == 200
    wait_until(lambda: status(gateway.url)["in_flight"] == 0, timeout=2, what="slots given back")
    # Responses runs n generations, a slot each; llama-server's Messages converter drops n: one slot
    too_many = _post(gateway.url, "/v1/responses", body("/v1/responses", n=3))
    _refused_full(too_many)
    assert too_many.json()["error"]["message"].endswith("this node runs at most 2")
    assert _post(gateway.url, "/v1/messages", {**MESSAGES, "n": 3}).status_code == 200


@pytest.mark.in_process
def test_every_path_is_answered_and_non_streamed_generations_are_folded(
    local_stack: LocalStack, agent: AgentFactory
) -> None:
    held, gateway = _node(local_stack, agent)
    held.release()
    for path in APIS:
        direct = _post(held.url, path, body(path))
        through = _post(gateway.url, path, body(path))
        assert through.status_code == 200, (path, through.text)
        assert through.json() == direct.json(), path  # the folded stream is llama-server's own answer
        asked_a_stream = held.state()["streamed"].get(path, 0) == 1
        assert asked_a_stream == (APIS[path].dialect in FOLDED and not APIS[path].light), path
        streamed = _post(gateway.url, path, body(path, stream=True))
        assert streamed.status_code == 200
        if asked_a_stream:  # a client's own stream is relayed as it is
            assert streamed.headers["content-type"].startswith("text/event-stream"), path
    assert (status(gateway.url)["in_flight"], status(gateway.url)["light_in_flight"]) == (0, 0)


@pytest.mark.in_process
def test_a_responses_answer_longer_than_aiohttps_line_limit_is_folded(
    local_stack: LocalStack, agent: AgentFactory
) -> None:
    # the stream's last event holds the whole response: one line of about 2 MB here
    held, gateway = _node(local_stack, agent)
    held.release()
    answer = _post(gateway.url, "/v1/responses", body("/v1/responses", max_output_tokens=1_000_000))
    assert answer.status_code == 200, answer.text[:200]
    assert answer.json()["output"][0]["content"][0]["text"] == "a" * 1_000_000


def _raw_post(url: str, path: str, payload: dict[str, Any]) -> socket.socket:
    """A client socket that has sent a POST and reads nothing."""
    data = json.dumps(payload).encode()
    client = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=10)
    head = (f"POST {path} HTTP/1.1\r\nHost: agent\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode()
    client.sendall(head + data)
    return client


@pytest.mark.in_process
@pytest.mark.parametrize("path", ["/v1/messages", "/v1/responses"])
def test_a_client_gone_from_a_non_streamed_request_frees_its_slot_at_once(
    local_stack: LocalStack, agent: AgentFactory, path: str
) -> None:
    held, gateway = _node(local_stack, agent, "--cap", "1")
    client = _raw_post(gateway.url, path, body(path))
    _waiting(held, 1)
    assert held.state()["streamed"] == {path: 1}  # asked of llama-server as a stream, on the client's behalf
    assert status(gateway.url)["in_flight"] == 1
    client.close()
    # the agent closes its stream: llama-server would cancel the task and free the slot now
    wait_until(lambda: held.state()["cancelled"] == 1, timeout=0.5, what="the upstream stream closed")
    wait_until(lambda: status(gateway.url)["in_flight"] == 0, timeout=0.5, what="the agent's slot freed")
    assert metric(gateway.url, f'macpool_agent_requests_total{{endpoint="{path}",status="499"}}') == 1


@pytest.mark.in_process
def test_the_several_models_app_serves_every_path_under_each_model(local_stack: LocalStack) -> None:
    upstream = local_stack.serve("held", held_upstream.app())
    held = Held(upstream)
    held.release()
    transport = Upstream(keepalive_expiry=1.0)
    settings = AgentSettings(upstream=upstream.url)
    runtimes = {name: Runtime(settings, upstream_url=upstream.url, upstream_transport=transport)
                for name in ("a", "b")}
    for runtime in runtimes.values():
        runtime.capacity_decided("ready", capacity=1, total_slots=1)
    agent = local_stack.serve("models", create_models_app(runtimes, Runtime(settings)))
    try:
        for path in APIS:
            answer, direct = _post(agent.url, "/m/b" + path, body(path)), _post(held.url, path, body(path))
            assert answer.status_code == 200 and answer.json() == direct.json(), path
        assert sum(held.state()["arrived"].values()) == 2 * len(APIS)
        assert _post(agent.url, "/m/c/v1/messages", MESSAGES).json()["error"]["code"] == "model_not_found"
    finally:
        local_stack.call(transport.aclose())


@pytest.mark.in_process
def test_light_requests_answer_under_memory_pressure_but_not_without_llama_server(
    local_stack: LocalStack,
) -> None:
    # paging pins the generation slots to the requests in flight; a light request holds none of them
    upstream = local_stack.serve("held", held_upstream.app())
    Held(upstream).release()
    transport = Upstream(keepalive_expiry=1.0)
    runtime = Runtime(AgentSettings(upstream=upstream.url), upstream_url=upstream.url,
                      upstream_transport=transport)
    runtime.capacity_decided("paging", capacity=0, total_slots=4)
    gateway = local_stack.serve("gateway", create_app(runtime), ready=None)
    try:
        _refused_full(_post(gateway.url, "/v1/messages", MESSAGES))
        assert _post(gateway.url, "/tokenize", body("/tokenize")).status_code == 200

        async def lost() -> None:  # on the servers' loop, as the gateway finds it out
            runtime.capacity_decided("ready", capacity=4, total_slots=4)
            runtime.upstream_lost()  # llama-server stopped answering: nothing admitted until a heartbeat

        local_stack.call(lost())
        refused = _post(gateway.url, "/tokenize", body("/tokenize"))
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "node_unavailable"
    finally:
        local_stack.call(transport.aclose())


def test_a_drain_waits_for_the_light_requests_in_flight(
    spawn: SpawnFactory, agent: AgentFactory, pool: ThreadPoolExecutor
) -> None:
    port = free_port()
    argv = [sys.executable, "-m", "tests.node_agent.held_upstream", "--port", str(port)]
    held = Held(spawn(argv=argv, port=port, name="held"))
    gateway = agent("--upstream", held.url, "--drain-timeout", "20")
    wait_until(lambda: status(gateway.url)["state"] == "ready", what="ready")
    counting = pool.submit(_post, gateway.url, "/v1/messages/count_tokens", body("/v1/messages/count_tokens"))
    _waiting(held, 1)
    gateway.child.signal(signal.SIGTERM)
    wait_until(lambda: status(gateway.url)["state"] == "draining", what="draining")
    refused = _post(gateway.url, "/tokenize", body("/tokenize"))
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "node_draining"
    time.sleep(1.5)  # past the second a stopping gateway gives a request it did not wait for
    assert gateway.child.process is not None and gateway.child.process.poll() is None
    held.release()
    assert counting.result().status_code == 200
    assert gateway.child.process.wait(15) == 0


@pytest.mark.in_process
def test_a_stream_cut_mid_way_ends_with_its_apis_own_error_event(
    local_stack: LocalStack, agent: AgentFactory
) -> None:
    from tests import stand_in
    from tests.node_agent import failing_upstream

    upstream = local_stack.serve("failing-upstream", stand_in.app("failing", failing_upstream.ROUTES))
    gateway = agent("--upstream", upstream.url)
    wait_until(lambda: status(gateway.url)["state"] == "ready", what="ready")
    messages = httpx.post(gateway.url + "/v1/messages", timeout=30,
                          json={"model": "m", "max_tokens": 8, "stream": True, "messages": []})
    last = messages.text.rstrip("\n").split("\n\n")[-1]
    name, data = last.split("\n", 1)
    assert name == "event: error", messages.text  # what the anthropic SDK raises on
    error = json.loads(data.removeprefix("data: "))
    assert error["type"] == "error" and error["error"]["type"] == "api_error"
    assert error["error"]["code"] == "upstream_midstream"
    responses = httpx.post(gateway.url + "/v1/responses", timeout=30,
                           json={"model": "m", "input": "hi", "stream": True})
    name, data = responses.text.rstrip("\n").split("\n\n")[-1].split("\n", 1)
    assert name == "event: response.failed", responses.text
    failed = json.loads(data.removeprefix("data: "))
    assert failed["response"]["status"] == "failed"
    assert failed["response"]["error"]["code"] == "upstream_midstream"
