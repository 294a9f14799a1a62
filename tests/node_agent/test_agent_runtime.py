"""The agent's lifecycle state and its named transitions (node_agent/runtime.py), in process."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
from prometheus_client import CollectorRegistry
from starlette.testclient import TestClient

from macpool.contract import NODE_STATES
from macpool.upstream import Upstream
from node_agent.gateway import create_app
from node_agent.runtime import PrefillReading, Runtime
from node_agent.settings import AgentSettings
from tests.conftest import Server, chat

CHAT = "/v1/chat/completions"
BODY = chat(max_tokens=5, stream=False)


def attached() -> Runtime:
    return Runtime(AgentSettings(upstream="http://upstream"), upstream_url="http://upstream")


def supervised(folder: Path) -> Runtime:
    model = folder / "m.gguf"  # the settings check it is there; the runtime does not read it
    model.write_bytes(b"GGUF")
    return Runtime(AgentSettings(llama_server="true", model=model))


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def shown_states(runtime: Runtime) -> list[str]:
    registry = runtime.metrics.registry
    return [s for s in NODE_STATES if sample(registry, "macpool_agent_state_info", state=s) == 1]


def test_a_new_agent_is_starting_and_admits_nothing(tmp_path: Path) -> None:
    runtime = attached()
    assert (runtime.state, runtime.capacity, runtime.admitting) == ("starting", 0, False)
    assert shown_states(runtime) == ["starting"]
    assert runtime.llama_state is None  # attached: the heartbeat judges llama-server from its answers
    assert supervised(tmp_path).llama_state == "starting"


def test_the_heartbeat_decision_sets_state_capacity_and_admission() -> None:
    runtime = attached()
    assert runtime.capacity_decided("ready", capacity=4, total_slots=8) == "ready"
    assert (runtime.state, runtime.capacity, runtime.total_slots, runtime.admitting) == ("ready", 4, 8, True)
    assert sample(runtime.metrics.registry, "macpool_agent_capacity_requests") == 4
    assert shown_states(runtime) == ["ready"]
    assert runtime.capacity_decided("paging", capacity=0, total_slots=8) == "paging"
    assert not runtime.admitting and shown_states(runtime) == ["paging"]
    assert runtime.capacity_decided("ready", capacity=3, total_slots=8) == "ready"
    assert runtime.admitting


def test_a_lost_upstream_stops_admission_and_asks_for_a_beat_now() -> None:
    runtime = attached()
    runtime.capacity_decided("ready", capacity=2, total_slots=2)
    runtime.upstream_lost()
    assert not runtime.admitting and runtime.beat_now.is_set()
    assert runtime.state == "ready"  # the heartbeat says what it is now, at once
    runtime.capacity_decided("unhealthy", capacity=2, total_slots=2)
    assert (runtime.state, runtime.admitting) == ("unhealthy", False)


def test_a_supervised_llama_server_going_down_and_up(tmp_path: Path) -> None:
    runtime = supervised(tmp_path)
    runtime.llama_up()
    assert runtime.llama_state is None
    runtime.capacity_decided("ready", capacity=2, total_slots=2)
    runtime.llama_down()
    assert (runtime.state, runtime.admitting, runtime.llama_state) == ("unhealthy", False, "unhealthy")
    assert runtime.beat_now.is_set()
    assert sample(runtime.metrics.registry, "macpool_agent_llama_server_restarts_total") == 1
    runtime.llama_up()
    assert runtime.llama_state is None and runtime.state == "unhealthy"  # until the next heartbeat
    runtime.capacity_decided("ready", capacity=2, total_slots=2)
    assert runtime.admitting


def test_draining_is_the_last_state(tmp_path: Path) -> None:
    runtime = supervised(tmp_path)
    runtime.capacity_decided("ready", capacity=2, total_slots=2)
    runtime.begin_drain()
    assert (runtime.state, runtime.admitting, runtime.draining) == ("draining", False, True)
    for state in NODE_STATES:
        assert runtime.capacity_decided(state, capacity=5, total_slots=6) == "draining"
        assert not runtime.admitting
    assert runtime.capacity == 5  # still published: the routers see what it holds
    runtime.llama_down()
    runtime.llama_up()
    runtime.upstream_lost()
    assert (runtime.state, runtime.admitting) == ("draining", False)
    assert shown_states(runtime) == ["draining"]


def test_held_slots_are_counted_until_released() -> None:
    runtime = attached()
    runtime.hold(2)
    runtime.hold(1)
    assert runtime.in_flight == 3
    runtime.release(2)
    assert runtime.in_flight == 1
    assert sample(runtime.metrics.registry, "macpool_agent_in_flight_requests") == 1


def answering(url: str) -> Runtime:
    """A runtime relaying to the upstream at ``url`` through a real client."""
    transport = Upstream(keepalive_expiry=1.0)
    return Runtime(AgentSettings(upstream=url), upstream_url=url,
                   http=httpx.AsyncClient(transport=transport), upstream_transport=transport)


def test_a_prompt_read_apart_from_most_of_its_wait_does_not_swing_the_macs_prompt_speed() -> None:
    """Eight prompts in flight on a Mac that processes 5,000 tokens a second: a reading a second after the
    last one sees a 4-second prompt finish (llama-server's seconds for it) but only that second of the waits
    (8 prompts, 1 s each, in a second of prompting), so on its own it would say 40,000 tokens a second."""
    runtime = attached()
    steady = PrefillReading(tokens=20_000, seconds=4.0, busy=4.0, summed=4.0, cached=10_000, prompts=1)
    for _ in range(4):
        runtime.note_prefill(steady)
    assert runtime.prefill_tokens_per_s == 5_000 and runtime.prefill_depth == 20_000
    runtime.note_prefill(PrefillReading(tokens=20_000, seconds=4.0, busy=1.0, summed=8.0, cached=10_000,
                                        prompts=1))
    assert runtime.prefill_tokens_per_s is not None and runtime.prefill_tokens_per_s < 1.5 * 5_000
    assert runtime.prefill_depth == 20_000


def test_the_gateway_admits_by_the_runtime_state(sim: Callable[..., Server]) -> None:
    runtime = answering(sim("--speed", "50").url)
    with TestClient(create_app(runtime)) as client:
        starting = client.post(CHAT, json=BODY)
        assert starting.status_code == 503 and starting.json()["error"]["code"] == "node_unavailable"
        runtime.capacity_decided("ready", capacity=1, total_slots=1)
        assert client.post(CHAT, json=BODY).status_code == 200
        assert runtime.in_flight == 0
        runtime.hold(1)  # another request's slot
        full = client.post(CHAT, json=BODY)
        assert full.status_code == 503 and full.json()["error"]["code"] == "node_full"
        runtime.release(1)
        runtime.begin_drain()
        draining = client.post(CHAT, json=BODY)
        assert draining.status_code == 503 and draining.json()["error"]["code"] == "node_draining"
        shown = client.get("/status").json()
        assert (shown["state"], shown["admitting"], shown["in_flight"]) == ("draining", False, 0)
        assert client.portal is not None
        client.portal.call(runtime.transport().aclose)  # its connections belong to the app's loop
