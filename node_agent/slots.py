"""Which of llama-server's slots a session's request runs in (``id_slot``), on a node whose slots each keep
their own KV cells.

llama-server gives a new prompt the idle slot whose cached prompt shares the largest part of it. Coding
agents' sessions share a long prefix (Codex's instructions and tools, some 26K tokens), so a new session
takes the slot of a live one that is between two turns, and that one processes its whole history again at
its next turn. The agent names the slot instead, for the requests the router marks with their session
(``X-Macpool-Session``): a session's turns go to the slot that holds its history; a new session gets the
idle slot of a session that has ended (its prompt kept as far as the new one shares it), else one no
session holds, else the least recently used one.

A slot is named only where that is safe and useful:

- the slots keep their own cells (with a unified cache llama-server saves every idle slot to its prompt
  cache and clears it as a task starts: which slot a prompt gets does not matter there);
- the API is one whose body llama-server reads ``id_slot`` from (``macpool/apis.py``; not Messages, whose
  conversion drops it), and the request runs one generation;
- the slot is idle for certain: llama-server saves and loads its prompt cache into a named slot before it
  looks whether the slot is busy, which would overwrite a running request's cache. While a request whose
  slot llama-server chose is in flight and the agent does not know which slot that is, no slot is named.

The agent finds that slot where it can (``observe``): llama-server's ``/slots`` lists the slots processing
a task, and when one request of unknown slot is in flight and one processing slot is not one of the agent's
known ones, that slot is the request's. So Claude Code's sessions on Messages are known too: a new Codex
session does not take the slot of a live one as free, and slots are named again while it runs.

A request that ends before llama-server finished it (its client gone, say) may still run there until
llama-server's next step, in a slot the agent now takes as free: a task no request of the agent's holds.
Taken for a new request's, it would give that request the wrong slot, and the slot the request really runs
in could be named for another while it runs. So the next look at ``/slots`` after such an end takes every
task it finds in a slot the agent does not know as such a leftover, and finds no slot; a leftover is one no
more once ``/slots`` no longer lists it. At worst a request that began meanwhile is not found while it runs.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

UNNAMED = -1  # llama-server's "any slot"


@dataclass(eq=False)
class Claim:
    """One generation request's slot: the one the agent named, or ``UNNAMED`` and, once ``observe`` finds
    it, the one llama-server chose (``found``)."""

    session: str
    slot: int = UNNAMED
    why: str = "unnamed"  # own, ended, free, evicted (a slot named) or unnamed
    found: int = UNNAMED

    @property
    def where(self) -> int:
        """The slot it runs in, as far as the agent knows (``UNNAMED``: it does not)."""
        return self.slot if self.slot != UNNAMED else self.found


@dataclass
class _Slot:
    session: str = ""  # the session whose prompt it holds ("": none the agent knows of)
    last_used: float = float("-inf")
    busy: bool = False


class SlotNames:
    """The slot each request runs in: named by the agent, or found in llama-server's ``/slots``."""

    def __init__(self, session_ttl: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.session_ttl = session_ttl
        self._clock = clock
        self._slots: list[_Slot] = []
        self._unknown: list[Claim] = []  # requests in flight in a slot llama-server chose, not found yet
        self._found_tasks: deque[int] = deque(maxlen=64)  # llama-server's id_task of the slots found
        self._leftovers: set[int] = set()  # tasks of requests that ended early, as far as the agent can tell
        self._ended_early = 0  # requests that ended early since the last look at /slots

    def take(self, session: str, n_slots: int, name: bool = True) -> Claim:
        """The slot a request of ``session`` runs in. ``name``: the agent may name one (the API reads
        ``id_slot``); else, or with no session, or at an unsafe moment, llama-server chooses (``UNNAMED``).
        Each call is matched by one ``give_back`` of the claim it returned."""
        if n_slots != len(self._slots) and not self.in_flight:
            self._slots = [_Slot() for _ in range(n_slots)]  # llama-server (re)started with these slots
        claim = Claim(session)
        if name and session and n_slots == len(self._slots):
            claim.slot, claim.why = self._choose(session)
        if claim.slot == UNNAMED:
            self._unknown.append(claim)
        else:
            self._hold(claim.slot, session)
        return claim

    def give_back(self, claim: Claim, ended: bool = True) -> None:
        """``claim``'s request is over. ``ended``: llama-server finished its task (the answer was read to its
        end, or llama-server never had it); else the task may still run there for a step."""
        if not ended and claim.found == UNNAMED:  # (a slot found is known by its task)
            self._ended_early += 1
        if claim in self._unknown:
            self._unknown.remove(claim)
            return
        # (the slots are only forgotten for others when none is busy: this one is still known)
        slot = self._slots[claim.where]
        slot.busy = False
        slot.last_used = self._clock()

    def observe(self, processing: Mapping[int, int]) -> bool:
        """What llama-server's ``/slots`` says now: the id of each slot processing a task, with the task's
        id. One request in flight of unknown slot, and one such slot the agent does not know of: it is
        that request's. Whether it found one."""
        self._leftovers.intersection_update(processing.values())
        strangers = [i for i, task in processing.items() if 0 <= i < len(self._slots)
                     and not self._slots[i].busy and task not in self._found_tasks
                     and task not in self._leftovers]
        if self._ended_early:
            self._leftovers.update(processing[i] for i in strangers)
            self._ended_early = 0
            return False
        if len(self._unknown) != 1:
            return False
        if len(strangers) == 1:
            claim = self._unknown.pop()
            claim.found = strangers[0]
            self._found_tasks.append(processing[claim.found])
            self._hold(claim.found, claim.session)
            return True
        return False

    def unknown(self, claim: Claim) -> bool:
        """Whether ``claim`` runs in a slot llama-server chose that the agent has not found."""
        return claim in self._unknown

    @property
    def ended_early(self) -> bool:
        """Whether a request ended early since the last look at ``/slots`` (one is worth taking)."""
        return self._ended_early > 0

    @property
    def in_flight(self) -> int:
        return len(self._unknown) + sum(slot.busy for slot in self._slots)

    def _hold(self, index: int, session: str) -> None:
        slot = self._slots[index]
        slot.session, slot.busy = session, True

    def _choose(self, session: str) -> tuple[int, str]:
        if self._unknown or len(self._slots) < 2:
            return UNNAMED, "unnamed"
        idle = [i for i, slot in enumerate(self._slots) if not slot.busy]
        if not idle:
            return UNNAMED, "unnamed"  # llama-server queues it, for the first slot that frees
        own = [i for i in idle if self._slots[i].session == session]
        if own:
            return max(own, key=lambda i: self._slots[i].last_used), "own"
        now = self._clock()

        def rank(i: int) -> tuple[int, float]:
            slot = self._slots[i]
            if slot.session and now - slot.last_used > self.session_ttl:
                return 0, slot.last_used  # its session ended: its prompt may share a prefix
            if not slot.session:
                return 1, 0.0
            return 2, slot.last_used  # a live session's: the one idle the longest

        slot = min(idle, key=rank)
        return slot, ("ended", "free", "evicted")[rank(slot)[0]]


def processing_slots(slots: object) -> dict[int, int]:
    """The slots of llama-server's ``/slots`` answer processing a task: slot id -> the task's id."""
    found: dict[int, int] = {}
    for slot in slots if isinstance(slots, list) else ():
        if isinstance(slot, dict) and slot.get("is_processing"):
            index, task = slot.get("id"), slot.get("id_task")
            if type(index) is int and type(task) is int:
                found[index] = task
    return found


def with_slot(body: bytes, slot: int) -> bytes | None:
    """``body`` (a JSON object) naming ``slot``, or None when it is not an object or names one itself."""
    head = body.lstrip()
    if not head.startswith(b"{") or b'"id_slot"' in body:
        return None
    rest = head[1:].lstrip()
    separator = b"" if rest.startswith(b"}") else b","
    return b'{"id_slot":%d%s%s' % (slot, separator, rest)
