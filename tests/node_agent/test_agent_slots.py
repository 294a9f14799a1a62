"""The slot a session's request runs in (node_agent/slots.py)."""

from __future__ import annotations

import json

from node_agent.slots import UNNAMED, Claim, SlotNames, processing_slots, with_slot


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Requests:
    """``SlotNames`` as the gateway uses it: each request's claim kept until it is given back."""

    def __init__(self, clock: Clock | None = None) -> None:
        self.names = SlotNames(session_ttl=300, clock=clock or Clock())
        self.claims: list[Claim] = []

    def take(self, session: str, n_slots: int, name: bool = True) -> tuple[int, str]:
        claim = self.names.take(session, n_slots, name)
        self.claims.append(claim)
        return claim.slot, claim.why

    def back(self, slot: int) -> None:
        """Give back the latest request whose slot is ``slot`` (``UNNAMED``: one whose slot is unknown)."""
        claim = next(c for c in reversed(self.claims) if c.where == slot)
        self.claims.remove(claim)
        self.names.give_back(claim)


def test_a_session_keeps_its_slot_and_a_new_one_takes_a_free_one() -> None:
    requests = Requests()
    a, why = requests.take("a", 4)
    assert (a, why) == (0, "free")
    requests.back(a)
    b, why = requests.take("b", 4)
    assert b != a and why == "free"
    requests.back(b)
    assert requests.take("a", 4) == (a, "own")


def test_a_new_session_takes_an_ended_sessions_slot_before_a_free_one_and_a_live_ones_last() -> None:
    clock = Clock()
    requests = Requests(clock)
    for session in ("old", "live"):
        slot, _ = requests.take(session, 3)
        requests.back(slot)
        clock.now += 100
    clock.now += 150  # "old" sent its last turn 350 s ago: it ended; "live" 250 s ago
    ended, why = requests.take("new", 3)
    assert (ended, why) == (0, "ended")  # its prompt may share the new one's prefix (the same agent's)
    free, why = requests.take("newer", 3)
    assert (free, why) == (2, "free")
    evicted, why = requests.take("newest", 3)  # only a live session's slot is idle: it is evicted
    assert (evicted, why) == (1, "evicted")
    assert requests.take("one more", 3) == (UNNAMED, "unnamed")  # every slot busy: llama-server queues it


def test_no_slot_is_named_while_a_request_llama_server_placed_is_in_flight() -> None:
    requests = Requests()
    unnamed, _ = requests.take("", 4)  # a request with no session: llama-server chose its slot
    assert unnamed == UNNAMED
    assert requests.take("a", 4) == (UNNAMED, "unnamed")  # any slot might be the one it runs in
    requests.back(UNNAMED)
    requests.back(UNNAMED)
    assert requests.take("a", 4) == (0, "free") and requests.names.in_flight == 1


def test_the_slot_llama_server_chose_is_found_in_its_slots_list() -> None:
    clock = Clock()
    requests = Requests(clock)
    codex, _ = requests.take("codex", 3)  # slot 0, named
    claude = requests.names.take("claude", 3, name=False)  # Messages: llama-server chooses
    assert claude.slot == UNNAMED and requests.names.unknown(claude)
    assert requests.take("other", 3) == (UNNAMED, "unnamed")  # not while claude's slot is unknown
    requests.back(UNNAMED)
    assert not requests.names.observe({0: 7})  # llama-server has not begun it yet: only the named one runs
    assert requests.names.observe({0: 7, 2: 9})  # slot 2 is claude's
    assert claude.where == 2 and not requests.names.unknown(claude)
    assert requests.take("other", 3) == (1, "free")  # named again, never slot 2
    requests.back(codex)
    clock.now += 10
    requests.names.give_back(claude)
    requests.back(1)
    # claude's slot holds a live session now, not a free slot: a new session takes it last
    assert requests.take("new", 3) == (0, "evicted")  # the live session idle the longest: codex


def test_a_slot_is_not_guessed_among_several() -> None:
    requests = Requests()
    requests.take("", 4)  # fills the list of slots
    requests.back(UNNAMED)
    first = requests.names.take("a", 4, name=False)
    second = requests.names.take("b", 4, name=False)
    assert not requests.names.observe({1: 5})  # two requests of unknown slot: which one is it
    requests.names.give_back(second)
    assert not requests.names.observe({1: 5, 3: 6})  # two strangers: one may be a task just cancelled
    assert requests.names.observe({3: 6}) and first.where == 3
    third = requests.names.take("c", 4, name=False)
    assert not requests.names.observe({3: 6})  # task 6 is first's: not the third's
    assert requests.names.observe({3: 6, 0: 8}) and third.where == 0


def test_a_task_left_running_by_a_request_that_ended_early_is_taken_for_no_requests() -> None:
    requests = Requests()
    requests.take("", 4)  # fills the list of slots
    requests.back(UNNAMED)
    gone = requests.names.take("a", 4, name=False)  # its client leaves before llama-server is done
    requests.names.give_back(gone, ended=False)
    new = requests.names.take("b", 4, name=False)  # llama-server has not begun it yet
    # slot 1 still runs the task of the request that ended: not the new one's, now or later
    assert not requests.names.observe({1: 5})
    assert not requests.names.observe({1: 5}) and requests.names.unknown(new)
    assert requests.names.observe({1: 5, 2: 9}) and new.where == 2
    requests.names.give_back(new)
    # the leftover is one no more once llama-server no longer lists it: a later request in slot 1 is found
    assert not requests.names.observe({})
    later = requests.names.take("c", 4, name=False)
    assert requests.names.observe({1: 12}) and later.where == 1


def test_a_named_slot_given_back_early_may_still_run_its_task() -> None:
    requests = Requests()
    named, why = requests.take("a", 4)
    assert (named, why) == (0, "free")
    claim = requests.claims.pop()
    requests.names.give_back(claim, ended=False)  # slot 0 is free to the agent, busy in llama-server
    new = requests.names.take("b", 4, name=False)
    assert not requests.names.observe({0: 7})  # task 7 is the ended request's
    assert requests.names.observe({0: 7, 3: 8}) and new.where == 3


def test_a_request_that_ended_in_full_leaves_nothing_behind() -> None:
    requests = Requests()
    requests.take("a", 4)
    requests.back(0)  # its answer was read to its end
    assert not requests.names.ended_early
    new = requests.names.take("b", 4, name=False)
    assert requests.names.observe({0: 7}) and new.where == 0


def test_a_found_slot_given_back_early_is_known_by_its_task() -> None:
    requests = Requests()
    requests.take("", 4)
    requests.back(UNNAMED)
    first = requests.names.take("a", 4, name=False)
    assert requests.names.observe({2: 6}) and first.where == 2
    requests.names.give_back(first, ended=False)
    assert not requests.names.ended_early  # task 6 is known to be first's
    second = requests.names.take("b", 4, name=False)
    assert requests.names.observe({2: 6, 3: 10}) and second.where == 3


def test_processing_slots_are_read_from_llama_servers_slots_list() -> None:
    listed = [
        {"id": 0, "n_ctx": 1024, "is_processing": False},
        {"id": 1, "n_ctx": 1024, "is_processing": True, "id_task": 59, "n_prompt_tokens": 658},
        {"id": 2, "is_processing": True},  # no task id: not counted
        "junk",
    ]
    assert processing_slots(listed) == {1: 59}
    assert processing_slots({"error": "x"}) == {}


def test_a_session_whose_slot_is_busy_gets_another() -> None:
    requests = Requests()
    first, _ = requests.take("a", 2)
    second, why = requests.take("a", 2)  # the same session, at once (a side request)
    assert second != first and why == "free"
    assert requests.take("a", 2) == (UNNAMED, "unnamed")


def test_other_slots_start_over_once_quiet() -> None:
    requests = Requests()
    slot, _ = requests.take("a", 2)
    assert requests.take("b", 4) == (UNNAMED, "unnamed")  # llama-server came back with 4 slots, a still runs
    requests.back(slot)
    requests.back(UNNAMED)
    assert requests.take("a", 4) == (0, "free")  # what it knew of 2 slots is gone
    assert requests.take("b", 1) == (UNNAMED, "unnamed")


def test_the_name_goes_first_in_the_body() -> None:
    named = with_slot(b' {"model": "m", "messages": []}', 3)
    assert named is not None and json.loads(named) == {"id_slot": 3, "model": "m", "messages": []}
    assert json.loads(with_slot(b"{ }", 0) or b"") == {"id_slot": 0}
    assert with_slot(b'{"id_slot": 1}', 0) is None  # the client's own stands
    assert with_slot(b"[1]", 0) is None
