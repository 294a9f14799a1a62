"""llama-server's own ``/completion`` and ``/infill``: the last event is the whole answer but its content."""

from __future__ import annotations

from typing import Any

from . import Assembler


class NativeAssembler(Assembler):
    """Each event carries its piece of ``content`` (and its token, when asked); the last one (``"stop":
    true``) every other field of the non-streamed answer."""

    def __init__(self) -> None:
        super().__init__()
        self._text: list[str] = []
        self._tokens: list[int] = []
        self._last: dict[str, Any] = {}

    def fold(self, event: dict[str, Any]) -> None:
        self._last = event
        self._text.append(str(event.get("content") or ""))
        self._tokens += [t for t in event.get("tokens") or [] if isinstance(t, int)]

    @property
    def complete(self) -> bool:
        return self._last.get("stop") is True

    def result(self, request: dict[str, Any]) -> dict[str, Any]:
        document = {**self._last, "content": "".join(self._text)}
        settings = document.get("generation_settings")
        if isinstance(settings, dict):
            document["generation_settings"] = {**settings, "stream": False}
        document["tokens"] = self._tokens if request.get("return_tokens") else []
        return document
