"""Server-sent events as the benches read them, in one place.

- ``Events``: the JSON documents of one streamed OpenAI-style answer read through httpx, parsed by httpx-sse
  (multi-line ``data:`` joined, comments skipped), and whether ``[DONE]`` came;
- ``EventCounter``: how many events a stream read as raw bytes holds (the load client's and the transport
  comparison's), counted at the blank line that ends each event and parsed no further.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
from httpx_sse import EventSource, ServerSentEvent

DONE = "[DONE]"


class Events:
    """``async for doc in Events(response)`` (``for`` on a sync response): each event's JSON document, read to
    the end of the stream so that the connection can be reused; ``done`` tells whether ``[DONE]`` came.

    Raises httpx-sse's ``SSEError`` (an ``httpx.TransportError``) when the answer is not an event stream, and
    ``ValueError`` for an event that is not JSON.
    """

    def __init__(self, response: httpx.Response) -> None:
        self.source = EventSource(response)
        self.done = False

    def _doc(self, event: ServerSentEvent) -> dict[str, Any] | None:
        if event.data == DONE:
            self.done = True
            return None
        doc: dict[str, Any] = json.loads(event.data)
        return doc

    async def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        async for event in self.source.aiter_sse():
            doc = self._doc(event)
            if doc is not None:
                yield doc

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for event in self.source.iter_sse():
            doc = self._doc(event)
            if doc is not None:
                yield doc


def delta_text(doc: dict[str, Any]) -> str | None:
    """The text a chat completion chunk adds, if any."""
    choices = doc.get("choices") or []
    text = (choices[0].get("delta") or {}).get("content") if choices else None
    return text if isinstance(text, str) else None


_LF, _CRLF = b"\n\n", b"\r\n\r\n"


class EventCounter:
    """Counts the events of one stream fed piece by piece: an event ends at a blank line (``\\n\\n`` or
    ``\\r\\n\\r\\n``), whatever its lines. It only finds the ends, cheaply enough for a load client."""

    def __init__(self) -> None:
        self.tail = b""  # the last bytes fed: an event's end may straddle two pieces

    def feed(self, data: bytes) -> int:
        joined = self.tail + data
        # an end wholly within the tail was counted with the previous piece
        found = joined.count(_LF) + joined.count(_CRLF) - self.tail.count(_LF) - self.tail.count(_CRLF)
        self.tail = joined[-3:]
        return found
