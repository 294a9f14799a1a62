"""The memo of a "full" answer: while it holds, arrivals for the model are refused without asking Redis."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

# After Redis answers "every candidate is full and so is the queue", arrivals for the same model are refused
# from memory for up to this long, unless an event that may free room arrives first (see PoolView.version):
# under overload the reject path then costs no Redis round trip at all.
FULL_MEMO_S = 0.05


class FullMemo:
    """Per model, when Redis last said full, as of which pool ``version`` (any event that may free room
    bumps it and ends the memo)."""

    def __init__(self, version: Callable[[], int]) -> None:
        self.version = version
        self._full: dict[str, tuple[int, float]] = {}  # model -> (pool version, when) of the last "full"
        self._asking: set[str] = set()  # models whose lapsed "full" one request is asking Redis about again

    def remembers(self) -> bool:
        """Whether a "full" answer is remembered for some model (it may have lapsed since)."""
        return bool(self._full)

    def knows_full(self, model: str) -> bool:
        """Whether Redis said ``model``'s nodes and the queue were full less than FULL_MEMO_S ago (or one
        request is asking again since), with no event since that may have freed room."""
        memo = self._full.get(model)
        if memo is None:
            return False
        version, when = memo
        if version != self.version():
            del self._full[model]
            return False
        # lapsed by age: one request asks Redis again (Admission.acquire), the others keep the answer until it
        # is back - otherwise every request arriving meanwhile would ask too
        return time.monotonic() - when < FULL_MEMO_S or model in self._asking

    @contextlib.contextmanager
    def asking(self, model: str) -> Iterator[bool]:
        """Around one request's question to Redis: True when it asks again about a lapsed "full"."""
        asking = model in self._full
        if asking:
            self._asking.add(model)
        try:
            yield asking
        finally:
            if asking:
                self._asking.discard(model)

    def answered(self, model: str, full: bool, asked_again: bool) -> None:
        """Redis answered a request for ``model`` that could go anywhere the model runs (an interactive one
        of one generation: another's "full" may leave room for it)."""
        if full:
            self._full[model] = (self.version(), time.monotonic())
        elif asked_again:
            self._full.pop(model, None)
