"""What the performance benches send and serve, as bytes: OpenAI-shaped chat requests, SSE events and
completion bodies.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

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
    from macpool.sim import tokens as sim_tokens

    return json.dumps(
        {
            "model": MODEL,
            "messages": sim_tokens.chat_messages(prompt_tokens, salt=salt or "bench"),
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": stream,
        }
    ).encode()
