"""The benches' one reading of server-sent events (macpool/bench/sse.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from httpx_sse import SSEError

from macpool.bench.sse import EventCounter, Events, delta_text

STREAM = (
    b": a comment, not an event\n\n"
    b'data: {"choices": [{"delta": {"content": "he"}}]}\n\n'
    b"data: {\"choices\":\r\n"
    b'data: [{"delta": {"content": "llo"}}]}\r\n\r\n'  # one event over two lines, CRLF
    b'data: {"error": {"code": "upstream_failed"}}\n\n'
    b"data: [DONE]\n\n"
)


def answer(body: bytes, content_type: str = "text/event-stream") -> httpx.Response:
    return httpx.Response(200, headers={"content-type": content_type}, content=body)


def test_events_are_json_documents_up_to_done() -> None:
    events = Events(answer(STREAM))
    docs = list(events)
    assert [delta_text(doc) for doc in docs] == ["he", "llo", None]
    assert docs[2] == {"error": {"code": "upstream_failed"}}
    assert events.done


def test_events_read_asynchronously() -> None:
    async def read() -> tuple[list[dict[str, Any]], bool]:
        events = Events(answer(STREAM))
        return [doc async for doc in events], events.done

    docs, done = asyncio.run(read())
    assert len(docs) == 3 and done


def test_a_stream_cut_short_is_not_done() -> None:
    events = Events(answer(STREAM.split(b"data: [DONE]")[0] + b'data: {"choi'))
    assert len(list(events)) == 3 and not events.done  # the unfinished event is not one


def test_an_answer_that_is_not_an_event_stream_is_an_error() -> None:
    with pytest.raises(SSEError):
        list(Events(answer(b'{"id": 1}', "application/json")))


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, len(STREAM)])
def test_the_counter_finds_every_event_however_the_bytes_are_split(size: int) -> None:
    counter = EventCounter()
    pieces = [STREAM[i : i + size] for i in range(0, len(STREAM), size)]
    assert sum(counter.feed(piece) for piece in pieces) == 5  # the comment's blank line ends an "event" too
