"""Assemblers: each folds one dialect's llama-server event stream back into the document llama-server answers
the same request with when it is not streamed (node_agent/unstream.py says why the agent asks for a stream).

One module per dialect: ``openai`` (chat, completions), ``native`` (``/completion``, ``/infill``),
``messages`` (Anthropic Messages), ``responses`` (OpenAI Responses).
"""

from __future__ import annotations

import json
from typing import Any

from macpool.sse import Event, EventDecoder


class Assembler:
    """Reads an SSE body line by line and hands each event to :meth:`fold`; the subclass builds the document.

    ``error`` is llama-server's error when the stream carried one (the non-streamed answer would have been
    that error, with its ``code`` as the status); ``complete`` says whether the stream reached its last event.
    """

    def __init__(self) -> None:
        self.events = 0
        self.error: dict[str, Any] | None = None
        self._decoder = EventDecoder()

    def feed_line(self, line: str) -> None:
        """One line of the SSE body, without its line end."""
        event = self._decoder.feed(line)
        if event is not None:
            self.feed_event(event)

    def end(self) -> None:
        """The body ended (an event whose blank line never came still counts)."""
        event = self._decoder.end()
        if event is not None:
            self.feed_event(event)

    def feed_event(self, sse: Event) -> None:
        if sse.data == "[DONE]":
            return
        event = json_object(sse.data)
        if sse.event == "error":  # an Anthropic stream's error event (or llama-server's own error line)
            self.error = event or {"message": sse.data}
            return
        if event is None:
            return
        if "error" in event:
            error = event["error"]
            self.error = error if isinstance(error, dict) else {"message": str(error)}
            return
        self.events += 1
        self.fold(event)

    def fold(self, event: dict[str, Any]) -> None:
        """One event's data."""
        raise NotImplementedError

    @property
    def complete(self) -> bool:
        """The stream's last event (the one llama-server sends when the generation ends) has come."""
        raise NotImplementedError

    def result(self, request: dict[str, Any]) -> dict[str, Any]:
        """The document llama-server returns for ``request`` without ``stream``."""
        raise NotImplementedError


def json_object(text: str) -> dict[str, Any] | None:
    """``text`` as a JSON object, or None for anything else."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None
