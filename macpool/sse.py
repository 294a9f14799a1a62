"""Server-sent events as the HTML standard reads them, for the streams read through aiohttp (httpx-sse reads
httpx's): lines in, events out - ``data`` lines joined with newlines, an event dispatched at its blank line,
comments and unknown fields skipped.

llama-server once ended a failed stream with a line of its own, ``error: {...}``: it is read as an event named
``error`` at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Event:
    data: str
    event: str = ""  # its ``event:`` field ("": none, a "message")


@dataclass
class EventDecoder:
    _event: str = ""
    _data: list[str] = field(default_factory=list)

    def feed(self, line: str) -> Event | None:
        """One line without its line end; the event it completes, if any."""
        if not line:
            return self._dispatch()
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "error":
            return Event(value, "error")
        return None

    def end(self) -> Event | None:
        """The stream ended: the event its last lines began, if no blank line closed it."""
        return self._dispatch()

    def _dispatch(self) -> Event | None:
        if not self._data:
            self._event = ""
            return None
        event = Event("\n".join(self._data), self._event)
        self._event, self._data = "", []
        return event
