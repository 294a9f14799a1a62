"""Assemblers: each folds one dialect's llama-server event stream back into the document llama-server answers
the same request with when it is not streamed (node_agent/unstream.py says why the agent asks for a stream).

One module per dialect: ``openai`` (chat, completions), ``native`` (``/completion``, ``/infill``),
``messages`` (Anthropic Messages), ``responses`` (OpenAI Responses).
"""

from __future__ import annotations

import json
from typing import Any


class Assembler:
    """Reads an SSE body line by line and hands each event to :meth:`fold`; the subclass builds the document.

    ``error`` is llama-server's error when the stream carried one (the non-streamed answer would have been
    that error, with its ``code`` as the status); ``complete`` says whether the stream reached its last event.
    """

    def __init__(self) -> None:
        self.events = 0
        self.error: dict[str, Any] | None = None
        self._name = ""  # the event being read, from its ``event:`` line

    def feed_line(self, line: str) -> None:
        """One line of the SSE body, without its line end."""
        if line.startswith("event: "):
            self._name = line[len("event: "):].strip()
            return
        if not line.startswith("data: "):
            if line.startswith("error: "):  # llama-server's in-stream error line
                self.error = json_object(line[len("error: "):]) or {"message": line}
            elif not line:  # a blank line ends an event
                self._name = ""
            return
        payload = line[len("data: "):].strip()
        name, self._name = self._name, ""
        if payload == "[DONE]":
            return
        event = json_object(payload)
        if event is None:
            return
        if name == "error":  # an Anthropic stream's error event: the data is the error itself
            self.error = event
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
