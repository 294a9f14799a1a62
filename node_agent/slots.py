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
  looks whether the slot is busy, which would overwrite a running request's cache. The agent knows the
  slots its named requests run in, not which one llama-server gave another request: while any such
  request is in flight, no slot is named.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

UNNAMED = -1  # llama-server's "any slot"


@dataclass
class _Slot:
    session: str = ""  # the session whose prompt it holds ("": none the agent put there)
    last_used: float = float("-inf")
    busy: bool = False


class SlotNames:
    """The slot each named request runs in, and the requests in flight the agent could not name."""

    def __init__(self, session_ttl: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.session_ttl = session_ttl
        self._clock = clock
        self._slots: list[_Slot] = []
        self._unnamed = 0  # generation requests in flight in a slot llama-server chose

    def take(self, session: str, n_slots: int) -> tuple[int, str]:
        """The slot a request of ``session`` runs in, or ``UNNAMED`` ("" or an unsafe moment: llama-server
        chooses), and why: "own" (the slot that holds the session), "ended" (an ended session's), "free"
        (no session's), "evicted" (a live session's), "unnamed". Each call is matched by one ``give_back``
        of the slot it returned."""
        slot, why = self._choose(session, n_slots) if session else (UNNAMED, "unnamed")
        if slot == UNNAMED:
            self._unnamed += 1
        else:
            chosen = self._slots[slot]
            chosen.session, chosen.busy = session, True
        return slot, why

    def give_back(self, slot: int) -> None:
        if slot == UNNAMED:
            self._unnamed = max(0, self._unnamed - 1)
            return
        # (the slots are only forgotten for others when none is busy: this one is still known)
        self._slots[slot].busy = False
        self._slots[slot].last_used = self._clock()

    @property
    def in_flight(self) -> int:
        return self._unnamed + sum(slot.busy for slot in self._slots)

    def _choose(self, session: str, n_slots: int) -> tuple[int, str]:
        if n_slots != len(self._slots):
            if self.in_flight:
                return UNNAMED, "unnamed"  # llama-server restarted with other slots: once it is quiet
            self._slots = [_Slot() for _ in range(n_slots)]
        if self._unnamed or n_slots < 2:
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


def with_slot(body: bytes, slot: int) -> bytes | None:
    """``body`` (a JSON object) naming ``slot``, or None when it is not an object or names one itself."""
    head = body.lstrip()
    if not head.startswith(b"{") or b'"id_slot"' in body:
        return None
    rest = head[1:].lstrip()
    separator = b"" if rest.startswith(b"}") else b","
    return b'{"id_slot":%d%s%s' % (slot, separator, rest)
