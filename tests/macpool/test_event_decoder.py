"""macpool/sse.py: event streams read as the HTML standard reads them."""

from __future__ import annotations

from macpool.sse import Event, EventDecoder


def read(text: str) -> list[Event]:
    decoder = EventDecoder()
    events = [event for line in text.split("\n") if (event := decoder.feed(line.removesuffix("\r")))]
    last = decoder.end()
    return [*events, last] if last else events


def test_events_named_joined_and_dispatched_at_their_blank_line() -> None:
    stream = ("event: message_start\ndata: {\"a\": 1}\n\n: a keep-alive comment\n\n"
              "data: line one\ndata:line two\n\ndata: [DONE]\n\n")
    assert read(stream) == [Event('{"a": 1}', "message_start"), Event("line one\nline two"), Event("[DONE]")]


def test_an_event_without_its_blank_line_still_counts_at_the_end_and_names_do_not_leak() -> None:
    assert read("event: ping\n\ndata: x\nid: 7\nretry: 10") == [Event("x")]
    assert read("data: a\r\n\r\ndata: b") == [Event("a"), Event("b")]


def test_llama_servers_own_error_line_is_an_error_event_at_once() -> None:
    decoder = EventDecoder()
    assert decoder.feed('error: {"code": 500}') == Event('{"code": 500}', "error")
