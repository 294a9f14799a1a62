"""A request may name the slot it runs in (``id_slot``): llama-server honours it on the chat, completion and
Responses APIs and not on Messages, whose conversion to a chat request leaves it out. The agent names a
session's slot (node_agent/slots.py) only where it is honoured."""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import pytest

from tests.contract.conftest import Target


def cached(target: Target, path: str, text: str, slot: int) -> int:
    """Prompt tokens read from a cache when ``text`` is asked for in ``slot`` over ``path``."""
    if path == "/v1/messages":
        body: dict[str, Any] = {"max_tokens": 1, "messages": [{"role": "user", "content": text}]}
    elif path == "/v1/responses":
        body = {"max_output_tokens": 1, "input": text}
    else:
        body = {"max_tokens": 1, "messages": [{"role": "user", "content": text}]}
    response = httpx.post(target.url + path, json={**body, "id_slot": slot}, timeout=60)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    if path == "/v1/messages":
        return int(usage["cache_read_input_tokens"])
    if path == "/v1/responses":
        return int(usage["input_tokens_details"]["cached_tokens"])
    return int(usage["prompt_tokens_details"]["cached_tokens"])


@pytest.mark.parametrize(("path", "honoured"), [
    ("/v1/chat/completions", True), ("/v1/responses", True), ("/v1/messages", False),
])
def test_a_named_slot_is_where_the_request_runs(api_target: Target, path: str, honoured: bool) -> None:
    history = f"session {uuid.uuid4().hex}: " + "the pool keeps a session's prompt in one slot. " * 8
    tokenized = httpx.post(api_target.url + "/tokenize", json={"content": history}, timeout=60)
    n = len(tokenized.json()["tokens"])
    cached(api_target, "/v1/chat/completions", history, 0)  # the history in slot 0
    # its next turn named to slot 1: llama-server would choose slot 0 by its prompt, and does where the
    # name is not read
    turn = cached(api_target, path, history + " And then?", 1)
    if honoured:
        assert turn < n / 4  # at most the chat template's opening, shared with what slot 1 held
        assert cached(api_target, path, history + " And then? Go on.", 1) > n  # now slot 1 holds it
    else:
        assert turn > n
