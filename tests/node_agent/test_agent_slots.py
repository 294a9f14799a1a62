"""The slot a session's request runs in (node_agent/slots.py)."""

from __future__ import annotations

import json

from node_agent.slots import UNNAMED, SlotNames, with_slot


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_session_keeps_its_slot_and_a_new_one_takes_a_free_one() -> None:
    names = SlotNames(session_ttl=300, clock=Clock())
    a, why = names.take("a", 4)
    assert (a, why) == (0, "free")
    names.give_back(a)
    b, why = names.take("b", 4)
    assert b != a and why == "free"
    names.give_back(b)
    assert names.take("a", 4) == (a, "own")


def test_a_new_session_takes_an_ended_sessions_slot_before_a_free_one_and_a_live_ones_last() -> None:
    clock = Clock()
    names = SlotNames(session_ttl=300, clock=clock)
    for session in ("old", "live"):
        slot, _ = names.take(session, 3)
        names.give_back(slot)
        clock.now += 100
    clock.now += 150  # "old" sent its last turn 350 s ago: it ended; "live" 250 s ago
    ended, why = names.take("new", 3)
    assert (ended, why) == (0, "ended")  # its prompt may share the new one's prefix (the same agent's)
    free, why = names.take("newer", 3)
    assert (free, why) == (2, "free")
    taken, why = names.take("newest", 3)  # only a live session's slot is idle: it is evicted
    assert (taken, why) == (1, "evicted")
    assert names.take("one more", 3) == (UNNAMED, "unnamed")  # every slot busy: llama-server queues it


def test_no_slot_is_named_while_a_request_llama_server_placed_is_in_flight() -> None:
    names = SlotNames(session_ttl=300, clock=Clock())
    unnamed, _ = names.take("", 4)  # a request with no session: llama-server chose its slot
    assert unnamed == UNNAMED
    assert names.take("a", 4) == (UNNAMED, "unnamed")  # any slot might be the one it runs in
    names.give_back(UNNAMED)
    names.give_back(UNNAMED)
    assert names.take("a", 4) == (0, "free") and names.in_flight == 1


def test_a_session_whose_slot_is_busy_gets_another() -> None:
    names = SlotNames(session_ttl=300, clock=Clock())
    first, _ = names.take("a", 2)
    second, why = names.take("a", 2)  # the same session, at once (a side request)
    assert second != first and why == "free"
    assert names.take("a", 2) == (UNNAMED, "unnamed")


def test_other_slots_start_over_once_quiet() -> None:
    names = SlotNames(session_ttl=300, clock=Clock())
    slot, _ = names.take("a", 2)
    assert names.take("b", 4) == (UNNAMED, "unnamed")  # llama-server came back with 4 slots, a still runs
    names.give_back(slot)
    names.give_back(UNNAMED)
    assert names.take("a", 4) == (0, "free")  # what it knew of 2 slots is gone
    assert names.take("b", 1) == (UNNAMED, "unnamed")


def test_the_name_goes_first_in_the_body() -> None:
    named = with_slot(b' {"model": "m", "messages": []}', 3)
    assert named is not None and json.loads(named) == {"id_slot": 3, "model": "m", "messages": []}
    assert json.loads(with_slot(b"{ }", 0) or b"") == {"id_slot": 0}
    assert with_slot(b'{"id_slot": 1}', 0) is None  # the client's own stands
    assert with_slot(b"[1]", 0) is None
