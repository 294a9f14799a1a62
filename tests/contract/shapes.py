"""What the contract tests compare: the shape of a JSON document, and the events of a named-event stream."""

from __future__ import annotations

import json
from typing import Any

import httpx


def skeleton(value: Any) -> Any:
    """``value`` with every leaf replaced by its JSON type name (keys compare order-free, as dicts do); a
    list becomes the sorted distinct skeletons of its items."""
    if isinstance(value, dict):
        return {key: skeleton(item) for key, item in value.items()}
    if isinstance(value, list):
        distinct = {json.dumps(skeleton(item), sort_keys=True) for item in value}
        return [json.loads(item) for item in sorted(distinct)]
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    return "string"


def named_events(response: httpx.Response) -> list[tuple[str, dict[str, Any]]]:
    """The ``(name, data)`` of each event of an Anthropic Messages or Responses stream, checking its framing:
    an ``event:`` line naming the data's ``type``, one ``data:`` line, a blank line; no ``[DONE]``."""
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    events = []
    for block in response.text.split("\n\n"):
        if not block.strip():
            continue
        name_line, data_line = block.split("\n")
        assert name_line.startswith("event: ") and data_line.startswith("data: "), block[:80]
        name, data = name_line.removeprefix("event: "), json.loads(data_line.removeprefix("data: "))
        assert data["type"] == name
        events.append((name, data))
    return events


def error(status: int, type_: str, message: str) -> dict[str, Any]:
    """llama-server's error document, on every API (Anthropic's paths included)."""
    return {"error": {"code": status, "message": message, "type": type_}}


TIMINGS = {
    key: "number" for key in (
        "cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_n",
        "predicted_ms", "predicted_per_token_ms", "predicted_per_second",
    )
}
