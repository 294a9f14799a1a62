"""The cached pool view: events applied in place, candidate rules, passive health, the /api/pool document."""

from __future__ import annotations

import pytest
from redis.asyncio import Redis

from macpool.contract import DeclaredModel, NodeDoc, now_ms
from macpool.store import Store
from router.pool import ModelNotFound, NoNodes, PoolView
from router.settings import Settings


def _view(**overrides: object) -> PoolView:
    settings = Settings.model_validate({"router_id": "r1", "circuit_cooldown": 0.0, **overrides})
    return PoolView(settings, Store(Redis()))  # the client is never used: events are applied by hand


def _heartbeat(view: PoolView, node_id: str, **fields: object) -> None:
    doc = NodeDoc.model_validate({"node_id": node_id, "url": f"http://10.0.0.1/{node_id}", "models": ["m"],
                                  "capacity": 4, "state": "ready", "updated_at_ms": now_ms(), **fields})
    view.apply(f"node {doc.encode()}")


def test_candidates_follow_events() -> None:
    view = _view()
    with pytest.raises(NoNodes):
        view.candidates("m")
    _heartbeat(view, "a")
    _heartbeat(view, "b", models=["other"])
    _heartbeat(view, "c", state="starting")
    assert [d.node_id for d in view.candidates("m")] == ["a"]
    assert {d.node_id for d in view.candidates("")} == {"a", "b"}
    with pytest.raises(ModelNotFound):
        view.candidates("nobody-serves-this")
    view.apply("drain a")
    with pytest.raises(NoNodes):
        view.candidates("m")
    view.apply("undrain a")
    view.apply("gone a")
    with pytest.raises(NoNodes):
        view.candidates("m")
    assert view.models() == ["other"]


def test_freed_events_count_and_notify() -> None:
    view = _view()
    woken: list[str] = []
    view.freed_listeners.append(woken.append)
    _heartbeat(view, "a")
    view.reserved("a", 3)
    view.apply("freed a")
    assert woken == ["a"] and view.snapshot.reservations["a"] == 2
    assert view.freed.rate() > 0


def test_a_node_ready_or_grown_is_announced_as_new_slots() -> None:
    view = _view()
    grown: list[str] = []
    view.grown_listeners.append(grown.append)
    _heartbeat(view, "a", state="standby", capacity=0)
    _heartbeat(view, "a", state="loading", capacity=0)
    assert grown == []
    _heartbeat(view, "a", capacity=2)  # ready
    _heartbeat(view, "a", capacity=2)  # the same: no new slots
    _heartbeat(view, "a", capacity=1)
    _heartbeat(view, "a", capacity=3)  # grown
    _heartbeat(view, "b", capacity=4)  # a new node
    assert grown == ["a", "a", "b"]


def test_a_hand_over_counts_every_slot_it_handed_in_the_release_rate() -> None:
    view = _view()
    woken: list[str] = []
    view.waiter_listeners.append(woken.append)
    view.apply("granted r1 a 2")  # a pair handed two slots
    view.apply("granted r2 a 1")
    assert woken == ["r1", "r2"] and len(view.freed.events) == 3


def test_circuit_opens_on_connect_failures_and_closes_after_a_fresh_heartbeat() -> None:
    view = _view(circuit_failures=2)
    _heartbeat(view, "a")
    view.connect_failed("a")
    assert view.circuit_state("a") == "closed"
    view.connect_failed("a")
    assert view.circuit_state("a") == "open"
    with pytest.raises(NoNodes):
        view.candidates("m")
    _heartbeat(view, "a", updated_at_ms=now_ms() + 1000)  # a new heartbeat after the cooldown: probe again
    assert view.circuit_state("a") == "half_open"
    assert [d.node_id for d in view.candidates("m")] == ["a"]
    view.connected("a")
    assert view.circuit_state("a") == "closed"


def test_pool_document_shape() -> None:
    view = _view()
    _heartbeat(view, "b", capacity=2)
    _heartbeat(view, "a", capacity=6)
    view.reserved("a", 3)
    view.snapshot.queue_depth = 1
    doc = view.to_json()
    assert doc["router_id"] == "r1" and isinstance(doc["ts_ms"], int)
    assert doc["pool"]["capacity"] == 8 and doc["pool"]["busy"] == 3 and doc["pool"]["queued"] == 1
    assert doc["pool"]["saturation"] == 0.5
    assert [n["node_id"] for n in doc["nodes"]] == ["a", "b"]
    assert doc["nodes"][0]["reserved"] == 3 and doc["nodes"][0]["circuit"] == "closed"
    assert doc["nodes"][0]["drained"] is False and "memory" in doc["nodes"][0]


def test_autoscale_decisions_are_kept_for_the_dashboard_and_change_nothing_else() -> None:
    view = _view()
    _heartbeat(view, "a")
    version = view.version
    view.apply('autoscale {"action":"activate","node":"b","reason":"demand 9.0 slots"}')
    view.apply("autoscale not-json")  # unreadable: ignored with a log line
    assert view.to_json()["autoscale"] == [{"action": "activate", "node": "b", "reason": "demand 9.0 slots"}]
    assert view.version == version  # no waiter is woken by a decision


def test_models_say_where_they_are_loaded_and_where_they_could_be() -> None:
    view = _view()
    _heartbeat(view, "a", models=["m", "coder"])
    _heartbeat(view, "b", capacity=2)
    _heartbeat(view, "c", models=["big"], state="standby", capacity=3, elastic=True)
    _heartbeat(view, "d", models=["never"], state="starting")  # not elastic, not ready: not servable
    # a Mac downloading a model the pool declares (node_agent/pool_models.py), and one declared that no Mac
    # has taken yet
    _heartbeat(view, "e", models=["new"], state="downloading", elastic=True, model_states=[
        {"name": "new", "state": "downloading", "download": {"done_bytes": 1, "total_bytes": 4}}])
    view.snapshot.declared = {name: DeclaredModel(name=name, ref=f"org/{name}:Q4_K_M", replicas=2)
                              for name in ("new", "later")}
    view.reserved("a", 3)
    none = {"loaded_on": 0, "loadable_on": 0, "downloading_on": 0, "slots": 0, "free_slots": 0}
    assert view.model_states() == {
        "big": {**none, "loadable_on": 1, "state": "loadable"},
        "coder": {**none, "loaded_on": 1, "slots": 4, "free_slots": 1, "state": "loaded"},
        "later": {**none, "replicas": 2, "state": "declared"},
        "m": {**none, "loaded_on": 2, "slots": 6, "free_slots": 3, "state": "loaded"},
        "new": {**none, "downloading_on": 1, "download_percent": 25.0, "replicas": 2, "state": "downloading"},
    }
    assert list(view.model_states()) == view.models()
