"""What the performance benches send and serve, as bytes: OpenAI-shaped chat requests, SSE events and
completion bodies, and the httptools-parsed connection of the fast upstream.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import cast

import httptools

MODEL = "sim"
LOOP = "127.0.0.1"


def sse_event(text: str = "tok", finish: str | None = None) -> bytes:
    chunk = {
        "id": "chatcmpl-bench",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": MODEL,
        "choices": [
            {"index": 0, "delta": {"content": text} if finish is None else {}, "finish_reason": finish}
        ],
    }
    return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"


def chunk_frame(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def completion_body(tokens: int) -> bytes:
    return json.dumps(
        {
            "id": "chatcmpl-bench",
            "object": "chat.completion",
            "created": 0,
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "tok " * tokens},
                    "finish_reason": "length",
                }
            ],
            "usage": {"prompt_tokens": 8, "completion_tokens": tokens, "total_tokens": 8 + tokens},
        },
        separators=(",", ":"),
    ).encode()


@dataclass(frozen=True)
class Post:
    """One request of the load client: a JSON body POSTed to ``path``."""

    path: str
    body: bytes


def chat_json(stream: bool, max_tokens: int = 16, prompt_tokens: int = 16, salt: str = "") -> bytes:
    from simulator import tokens as sim_tokens

    return json.dumps(
        {
            "model": MODEL,
            "messages": sim_tokens.chat_messages(prompt_tokens, salt=salt or "bench"),
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": stream,
        }
    ).encode()


class HttpConnection(asyncio.Protocol):
    """An HTTP/1.1 connection parsed by httptools: the subclass sets ``parser`` and its callbacks."""

    parser: httptools.HttpRequestParser | httptools.HttpResponseParser
    transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self.transport is not None:
                self.transport.close()
